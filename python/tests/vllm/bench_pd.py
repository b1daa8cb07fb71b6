"""Side by side, the same P/D program and prompts, interleaved rounds (the order rotates
each round), medians:

* ``nixl``: vLLM's own NixlConnector on the real NIXL 1.5.1 (UCX over TCP; NIXL from
  target/vllm-nixl, put first on the engines' PYTHONPATH);
* ``nixl-on-kvrail``: the same NixlConnector, unchanged, on kvrail's NIXL compat package
  (the venv's own ``nixl``; kvrail's TCP transport);
* ``kvrail``: kvrail.vllm's connector (TCP).

Only the measured pair runs: the other is stopped (SIGSTOP) for the round — NIXL's idle
engines spin a core each (UCX progress threads), which on a 2-core machine would slow
whatever else runs. Per round and connector: D's time to first token for single requests (vLLM's own
``first_token_latency``: D's queueing, the KV load and its first forward), and the KV
throughput over a batch (the batch's prompt KV bytes over D's time to every first token).
P prefills first, as a proxy has it do; P's time is not counted.

    python bench_pd.py [--rounds 5] [--model DIR] [--json FILE]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drive import Engine, prompt  # noqa: E402
from tiny_model import CONFIG, make  # noqa: E402

SINGLE = [prompt(n, 50 + i) for i, n in enumerate((64, 512, 1500))]
BATCH = [prompt(1500, 80 + i) for i in range(16)]
UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
NIXL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "target", "vllm-nixl")
ON_KVRAIL = {"KVRAIL_AGENT_CONFIG": '{"backend": "tcp", "listen": "127.0.0.1:0"}'}


def kv_bytes_per_token():
    c = CONFIG
    head = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head * 2 * 2  # K and V, bf16


def engines(py, model, name, logs):
    env_p, env_d, connector = {}, {}, name
    if name == "nixl":
        if not os.path.isdir(NIXL_DIR):
            sys.exit(f"no real NIXL at {NIXL_DIR}: run python/tests/vllm/run.sh first")
        # vLLM's CPU attention on an AMX host needs the tile data kvrail's modules ask for;
        # the real NIXL's engines get it from tools/pd's sitecustomize (else D dies with SIGILL)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools", "pd"))
        from cluster import amx_site

        path = os.pathsep.join([amx_site(), os.path.abspath(NIXL_DIR)])
        env_p = {**UCX, "PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": "15701"}
        env_d = {**UCX, "PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": "15711"}
    elif name == "nixl-on-kvrail":
        connector = "nixl"
        env_p = {**ON_KVRAIL, "VLLM_NIXL_SIDE_CHANNEL_PORT": "15721"}
        env_d = {**ON_KVRAIL, "VLLM_NIXL_SIDE_CHANNEL_PORT": "15731"}
    p = Engine(py, model, "producer", connector=connector, engine_id=f"p-{name}", env=env_p,
               log=os.path.join(logs, f"bench-p-{name}.log"))
    d = Engine(py, model, "consumer", connector=connector, engine_id=f"d-{name}", env=env_d,
               log=os.path.join(logs, f"bench-d-{name}.log"))
    p.ready()
    d.ready()
    return p, d


def measured(pairs, c):
    """One round of pair ``c``, the other pairs stopped meanwhile (SIGSTOP)."""
    others = [e for k, pd in pairs.items() if k != c for e in pd]
    for e in others:
        e.pause()
    try:
        return one_round(*pairs[c])
    finally:
        for e in others:
            e.resume()


def one_round(p, d):
    """(TTFTs of the single requests, KV GB/s of the batch); D's tokens, to check."""
    ttft, toks = [], []
    for x in SINGLE:
        pr = p.call(op="generate", prompts=[x], max_tokens=1, params=[{"do_remote_decode": True}])
        dr = d.call(op="generate", prompts=[x], max_tokens=1, params=pr["kv_params"])
        ttft.append(dr["ttft"][0])
        toks.append(dr["tokens"][0])
    pr = p.call(op="generate", prompts=BATCH, max_tokens=1, params=[{"do_remote_decode": True}] * len(BATCH))
    t0 = time.perf_counter()
    dr = d.call(op="generate", prompts=BATCH, max_tokens=1, params=pr["kv_params"])
    secs = time.perf_counter() - t0
    kv = sum(len(x) for x in BATCH) * kv_bytes_per_token()
    return ttft, kv / secs / 1e9, toks + dr["tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default="/tmp/kvrail-vllm-logs")
    a = ap.parse_args()
    os.makedirs(a.logs, exist_ok=True)
    model = make(a.model or os.path.join(a.logs, "tinyllama"))
    py = sys.executable
    names = ["nixl", "nixl-on-kvrail", "kvrail"]
    pairs = {c: engines(py, model, c, a.logs) for c in names}
    got = {c: {"ttft": [], "gbps": []} for c in names}
    tokens = {}
    try:
        # one warm-up round each: the handshakes and the first allocations
        for c in names:
            measured(pairs, c)
        for r in range(a.rounds):
            for c in names[r % len(names):] + names[: r % len(names)]:
                ttft, gbps, toks = measured(pairs, c)
                got[c]["ttft"].append(ttft)
                got[c]["gbps"].append(gbps)
                tokens.setdefault(c, toks)
                print(f"round {r} {c:14s} ttft {[f'{x * 1e3:.1f}' for x in ttft]} ms, batch {gbps:.3f} GB/s", flush=True)
    finally:
        for p, d in pairs.values():
            p.close()
            d.close()
    for c in names[1:]:
        assert tokens[c] == tokens["nixl"], f"{c}'s D gave other tokens than NIXL's"
    out = {"rounds": a.rounds, "single_prompt_tokens": [len(x) for x in SINGLE],
           "batch": [len(BATCH), len(BATCH[0])], "kv_bytes_per_token": kv_bytes_per_token()}
    for c in names:
        per = list(zip(*got[c]["ttft"]))
        out[c] = {
            "ttft_ms_median": [round(statistics.median(x) * 1e3, 2) for x in per],
            "batch_gbps_median": round(statistics.median(got[c]["gbps"]), 4),
        }
    for c in names[1:]:
        out[f"ratio_ttft_{c}_over_nixl"] = [
            round(k / n, 3) for k, n in zip(out[c]["ttft_ms_median"], out["nixl"]["ttft_ms_median"])
        ]
        out[f"ratio_gbps_{c}_over_nixl"] = round(out[c]["batch_gbps_median"] / out["nixl"]["batch_gbps_median"], 3)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
