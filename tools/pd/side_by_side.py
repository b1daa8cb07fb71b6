"""kvrail.vllm and vLLM's own NixlConnector side by side, as operators run them: the same
vllm-router in P/D mode, the same client (``vllm bench serve``, random dataset, one seed: the
same prompts), 1 prefill + 1 decode ``vllm serve`` engine per configuration, interleaved
rounds (the order rotates each round), medians of the rounds, ratios to the first:

* ``nixl``: NixlConnector on the real NIXL 1.5.1, UCX with its defaults (on one host UCX
  picks shared memory or cross-memory attach);
* ``nixl-ucx-tcp``: the same, with ``UCX_TLS=tcp`` (labelled: not how users run it);
* ``nixl-on-kvrail``: the same NixlConnector, unchanged, on kvrail's NIXL compat package;
* ``kvrail-pull`` / ``kvrail-push``: kvrail.vllm's connectors.

    python tools/pd/side_by_side.py --rounds 3 [--configs nixl,nixl-on-kvrail,kvrail-pull,kvrail-push]

One configuration runs at a time: its engines and router start, two requests warm them (the
first handshakes), the bench runs, everything stops. A plain engine (no connector) answers the
same prompts once; every configuration's tokens are checked against it request by request
(load.py's check: the same tokens, or each within 0.5 nats of the plain engine's top choice).
The engines share this host's cores with each other, the router and the client: the times
are those of the deployment, of which the KV transfer is a part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from load import bench, compare, plain_engine  # noqa: E402

# name -> (cluster mode, engine environment)
CONFIGS = {
    "nixl": ("nixl", {}),
    "nixl-ucx-tcp": ("nixl", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}),
    "nixl-on-kvrail": ("nixl-on-kvrail", {}),
    "kvrail-pull": ("pull", {}),
    "kvrail-push": ("push", {}),
}
DEFAULT = "nixl,nixl-on-kvrail,kvrail-pull,kvrail-push"
# what each round reports, from vllm bench serve's result
METRICS = {"TTFT p50 ms": "median_ttft_ms", "TTFT p99 ms": "p99_ttft_ms", "ITL p50 ms": "median_itl_ms",
           "ITL p99 ms": "p99_itl_ms", "out tok/s": "output_throughput"}


def one(name: str, a, logs: str, plain_url: str, want: dict) -> dict:
    """One round of configuration ``name``: its metrics, request counts and token check."""
    mode, env = CONFIGS[name]
    extra = {} if mode.startswith("nixl") else {"kv_lease_duration": 10}
    c = Cluster(1, 1, mode, logs=os.path.join(logs, name), extra=extra, env=env)
    try:
        t = time.time()
        c.start()
        up = time.time() - t
        for i in range(2):
            status, r = c.complete([(k * 31 + i) % 499 + 3 for k in range(300)], max_tokens=2)
            if status != 200:
                raise RuntimeError(f"{name}: warm-up request failed: {r}")
        got = bench(c.python, c.router.url, c.model, os.path.join(logs, name, "bench"), a.prompts, a.rate,
                    a.input_len, a.output_len)
    finally:
        c.stop()
    v = compare(got, want, plain_url)
    row = {k: got.get(m, 0.0) for k, m in METRICS.items()}
    row.update(completed=got.get("completed", 0), same=len(v["same"]), near=v["near"], other=v["other"],
               failed=v["failed"], up_s=round(up, 1))
    return row


def table(names: List[str], rounds: Dict[str, List[dict]]) -> str:
    med = {n: {k: statistics.median(r[k] for r in rounds[n]) for k in METRICS} for n in names}
    head = "| configuration | " + " | ".join(METRICS) + " | answered | plain's tokens / near tie / other |"
    lines = [head, "|" + "---|" * (len(METRICS) + 3)]
    for n in names:
        cells = []
        for k in METRICS:
            x, base = med[n][k], med[names[0]][k]
            cells.append(f"{x:.1f}" + (f" ({x / base:.2f}x)" if n != names[0] and base else ""))
        done = sum(r["completed"] for r in rounds[n])
        total = sum(r["completed"] + len(r["failed"]) for r in rounds[n])
        same = sum(r["same"] for r in rounds[n])
        near = sum(len(r["near"]) for r in rounds[n])
        other = sum(len(r["other"]) for r in rounds[n])
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {done}/{total} | {same} / {near} / {other} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=DEFAULT, help=f"comma-separated, of {', '.join(CONFIGS)} ({DEFAULT})")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    ap.add_argument("--input-len", type=int, default=600, help="prompt tokens (+-50 %%; blocks are 128 tokens)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--logs", default=None, help="(target/pd-side-by-side)")
    ap.add_argument("--json", default=None, help="write every round's numbers here")
    a = ap.parse_args()
    names = a.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            ap.error(f"unknown configuration {n!r} (known: {', '.join(CONFIGS)})")
    logs = a.logs or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "target",
                                  "pd-side-by-side")
    os.makedirs(logs, exist_ok=True)
    probe = Cluster(logs=logs)
    plain = plain_engine(probe.python, probe.model, logs)
    rounds: Dict[str, List[dict]] = {n: [] for n in names}
    try:
        plain.start().wait()
        want = bench(probe.python, plain.url, probe.model, os.path.join(logs, "plain"), a.prompts, a.rate,
                     a.input_len, a.output_len)
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                row = one(n, a, logs, plain.url, want)
                rounds[n].append(row)
                print(f"round {r} {n:15s} " + ", ".join(f"{k} {row[k]:.1f}" for k in METRICS)
                      + f"; {row['completed']} answered, failed {row['failed']}, near {row['near']}, "
                      f"other {row['other']} (up in {row['up_s']} s)", flush=True)
    finally:
        plain.kill()
    print(f"\n{a.rounds} rounds, {a.prompts} prompts @ {a.rate}/s, input {a.input_len} +-50 %, output "
          f"{a.output_len}; medians of the rounds, ratios to {names[0]}:\n")
    print(table(names, rounds))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rounds": rounds}, f, indent=1)
    bad = any(r["other"] or r["failed"] for rs in rounds.values() for r in rs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
