"""One real vLLM engine (the CPU build, offline ``LLM`` API, in-process) that a test drives
over stdin/stdout, one JSON object a line:

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": n, "params": [dict|null]}
      -> {"tokens": [[...]], "kv_params": [dict|null], "secs": s, "ttft": [s...]}
    {"op": "kv", "blocks": [[ids...]], "tokens": [n...]}
      -> {"sums": [[[layer][block] hex]]}     (checksums of the prompt tokens' KV bytes)
    {"op": "damage", "block": id}                 (flip a byte of every layer of block id)
    {"op": "metrics"} -> {"metrics": {name: value}}
    {"op": "blocks", "ids": [request ids]} -> {"blocks": [[ids]]} (D: where loaded KV landed)
    {"op": "exit"}

    python engine.py --model DIR --role plain|producer|consumer --connector kvrail|nixl
                     [--mode pull|push|push_stream] [--engine-id ID]

Lines that are not JSON (vLLM's logs go to stderr) never reach stdout.
"""

import argparse
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# replies go to the original stdout; everything else anything prints (vLLM, C libraries)
# goes to stderr
REPLIES = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def kv_config(args):
    if args.role == "plain":
        return None
    if args.connector == "nixl":
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "engine_id": args.engine_id,
        }
    name = {"pull": "KvrailPullConnector", "push": "KvrailPushConnector", "push_stream": "KvrailPushConnector"}
    extra = {"kvrail_agent_config": {"listen": "127.0.0.1:0", "backend": os.environ.get("KVRAIL_BACKEND", "tcp")}}
    if args.mode == "push_stream":
        extra["push_stream"] = True
    extra.update(json.loads(args.extra or "{}"))
    return {
        "kv_connector": name[args.mode],
        "kv_connector_module_path": "kvrail.vllm",
        "kv_role": {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}[args.role],
        "kv_buffer_device": "cpu",
        "engine_id": args.engine_id,
        "kv_connector_extra_config": extra,
        **json.loads(args.top or "{}"),
    }


def runner_of(llm):
    """The engine core, and the model runner when it lives in this process (TP 1)."""
    core = llm.llm_engine.engine_core.engine_core
    driver = getattr(core.model_executor, "driver_worker", None)
    return core, (driver.worker.model_runner if driver is not None else None)


def prompt_sums(runner, blocks, tokens):
    """sha256 of every byte of each block that holds prompt tokens, layer by layer (whole
    blocks: the backend's own arrangement inside a block does not matter)."""
    import torch

    out = []
    for t in runner.kv_caches:
        bs = t.shape[2]
        used = blocks[: (tokens + bs - 1) // bs]
        out.append([hashlib.sha256(t[b].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16] for b in used])
    return out


def record_loads(core):
    """D's blocks for each request that loads KV, as the scheduler hands them to the
    connector (``update_state_after_alloc``): for a connector that does not report where
    its KV landed (vLLM's NixlConnector)."""
    conn = core.scheduler.connector
    got = {}
    orig = conn.update_state_after_alloc

    def rec(request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            got[request.request_id] = list(blocks.get_block_ids()[0])
        return orig(request, blocks, num_external_tokens)

    conn.update_state_after_alloc = rec
    return got


def loaded_blocks(core, loads, rid):
    if loads is None:
        return core.scheduler.connector.received_block_ids(rid)
    # the engine core's request id is the output's with a suffix
    return next((v for k, v in loads.items() if k == rid or k.startswith(rid + "-")), None)


def settle(llm, core, limit=50):
    """Step while the scheduler has work, as ``vllm serve``'s engine loop does (the offline
    API's ``generate`` stops stepping when its requests end: a connector that asked to step
    once more, to tell its workers about the blocks it holds for D, would wait for the next
    request)."""
    for _ in range(limit):
        if not core.scheduler.has_requests():
            return
        llm.llm_engine.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=["plain", "producer", "consumer", "both"], required=True)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (> 1: vLLM's mp executor, a process a rank)")
    ap.add_argument("--connector", choices=["kvrail", "nixl"], default="kvrail")
    ap.add_argument("--mode", choices=["pull", "push", "push_stream"], default="pull")
    ap.add_argument("--engine-id", default=None)
    ap.add_argument("--extra", default=None, help="kv_connector_extra_config additions (JSON)")
    ap.add_argument("--top", default=None, help="kv_transfer_config additions (JSON), e.g. kv_load_failure_policy")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's default; off unless given here")
    args = ap.parse_args()
    args.engine_id = args.engine_id or f"{args.role}-engine"

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        disable_log_stats=False,
        # each request's prompt KV comes from P or from its own compute, never from an
        # earlier request's blocks (the tests send a prompt more than once), unless a test
        # asks for vLLM's default
        enable_prefix_caching=args.prefix_caching,
    )
    if args.tp > 1:
        # vLLM CPU runs TP with its mp executor, a core per rank
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))
        kw.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    cfg = kv_config(args)
    if cfg is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**cfg)
    llm = LLM(**kw)
    core, runner = runner_of(llm)
    loads = record_loads(core) if cfg is not None and args.connector == "nixl" else None
    out = REPLIES
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "generate":
            params = cmd.get("params") or [None] * len(cmd["prompts"])
            sps = []
            for p in params:
                extra = {"kv_transfer_params": p} if p is not None else None
                sps.append(
                    SamplingParams(
                        max_tokens=cmd["max_tokens"], temperature=0, detokenize=False, extra_args=extra
                    )
                )
            prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
            t0 = time.perf_counter()
            res = llm.generate(prompts, sps, use_tqdm=False)
            secs = time.perf_counter() - t0
            settle(llm, core)
            ttft = []
            for r in res:
                m = getattr(r, "metrics", None)
                f = getattr(m, "first_token_latency", None) if m is not None else None
                ttft.append(f)
            reply = {
                "ids": [r.request_id for r in res],
                "tokens": [list(r.outputs[0].token_ids) for r in res],
                "kv_params": [getattr(r, "kv_transfer_params", None) for r in res],
                "secs": secs,
                "ttft": ttft,
            }
        elif op == "kv":
            reply = {
                "sums": [prompt_sums(runner, b, n) for b, n in zip(cmd["blocks"], cmd["tokens"])]
            }
        elif op == "raw":
            import torch

            t = runner.kv_caches[cmd.get("layer", 0)]
            reply = {"hex": t[cmd["block"]].contiguous().view(torch.uint8).numpy().tobytes().hex()}
        elif op == "damage":
            import torch

            for t in runner.kv_caches:
                v = t[cmd["block"]].view(torch.uint8)
                flat = v.reshape(-1)
                flat[7] ^= 0x5A
            reply = {"damaged": cmd["block"]}
        elif op == "metrics":
            m = {}
            for x in llm.get_metrics():
                v = getattr(x, "value", None)
                if v is None:
                    v = getattr(x, "count", None)
                m[x.name] = m.get(x.name, 0) + (v or 0)
            reply = {"metrics": m}
        elif op == "blocks":
            reply = {"blocks": [loaded_blocks(core, loads, r) for r in cmd["ids"]]}
        else:
            reply = {"error": f"unknown op {op}"}
        print(json.dumps(reply), file=out, flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


if __name__ == "__main__":
    main()
