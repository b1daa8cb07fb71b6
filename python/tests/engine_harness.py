#!/usr/bin/env python3
"""An engine harness for ``kvrail.vllm``: a prefill (P) and a decode (D) engine in separate
processes, each driving the connector in both roles the way vLLM's scheduler and model
runner do (seed 002's call order), with numpy arrays as the paged KV caches (one pooled
allocation per engine, a view per layer) and kvrail-demo's fake model computing the KV.
The parent is the proxy: in pull mode it sends each request to P and hands P's
``kv_transfer_params`` to D; in push modes it sends both legs at once (D registers while P
prefills, so push_stream's blocks go to D as prefill steps close them — the harness reports
the bytes written before each prompt ended). D checks every KV byte attention reads against
the model.

    engine_harness.py --mode pull|push|push_stream [--memory host|npu] [--requests N] [--kill-d]

``--kill-d`` SIGKILLs D after it admitted a request and before it stepped: P must free the
request's blocks by lease expiry. The agent's settings come from ``KVRAIL_AGENT_CONFIG``
(JSON; e.g. ``{"backend": "verbs"}`` in the lab). Prints one line per request and a
summary; the exit status is 0 only when every check passed.
"""

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from types import SimpleNamespace

import numpy as np

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 8, 128, 16, 64
STEP_TOKENS = 32  # tokens a prefill step computes (vLLM's max_num_batched_tokens)
DEADLINE = 120.0
M64 = (1 << 64) - 1


# ---- kvrail-demo's fake model (tools/src/bin/kvrail-demo/model.rs), in numpy ------------

def tokens(seed, n):
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) ^ (i * np.uint64(0x9E3779B97F4A7C15))) * np.uint64(0xD6E8FEB86659FD93)
    return ((x >> np.uint64(47)) % np.uint64(151936)).astype(np.uint64)


def _rotl7(x):
    return (x << np.uint64(7)) | (x >> np.uint64(57))


def block_kv(toks, layer, plane, bi):
    """Block ``bi`` of the prompt at (layer, plane): [head][token][dim] fp16 bits (uint16),
    zeros after the prompt's end."""
    out = np.zeros((KV_HEADS, BLOCK_SIZE, HEAD_SIZE), dtype=np.uint16)
    pos = np.arange(bi * BLOCK_SIZE, min((bi + 1) * BLOCK_SIZE, len(toks)), dtype=np.uint64)
    if len(pos) == 0:
        return out
    tok = toks[pos.astype(np.int64)]
    h = np.arange(KV_HEADS, dtype=np.uint64)[:, None, None]
    d = np.arange(HEAD_SIZE, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        x = (tok * np.uint64(0x9E3779B97F4A7C15))[None, :, None] ^ _rotl7(pos)[None, :, None]
        x = x ^ np.uint64(layer << 48) ^ np.uint64(plane << 44) ^ (h << np.uint64(32)) ^ d
        v = ((x * np.uint64(0xBF58476D1CE4E5B9)) >> np.uint64(40)) & np.uint64(0xFFFF)
    out[:, : len(pos), :] = v.astype(np.uint16)
    return out


def prompt_kv_bytes(seed, n):
    """Every block of the prompt, layer by layer, K then V: what ``kvrail-demo fake-kv`` writes."""
    toks = tokens(seed, n)
    nb = -(-n // BLOCK_SIZE)
    return b"".join(
        block_kv(toks, l, p, b).tobytes() for l in range(LAYERS) for p in range(2) for b in range(nb)
    )


# ---- one engine ---------------------------------------------------------------------------

# ---- the KV cache: numpy (host) or NPU memory of the RBLN test runtime ------------------

class HostCache:
    """One pooled numpy allocation, a view per layer: [2, blocks, heads, block_size, dim]."""

    device = "cpu"

    def __init__(self):
        self.kv = np.zeros((LAYERS, 2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE), dtype=np.uint16)

    def layers(self):
        return [self.kv[l] for l in range(LAYERS)]

    def write(self, l, p, blk, arr):
        self.kv[l, p, blk] = arr

    def read(self, l, p, blk):
        return self.kv[l, p, blk]


class NpuTensor:
    """A tensor in NPU memory as the connector sees one: ``data_ptr()``, ``numel()``,
    ``element_size()``, ``shape`` and a non-CPU ``device``."""

    def __init__(self, ptr, shape):
        self.ptr, self.shape = ptr, shape
        self.device = SimpleNamespace(type="rbln", index=0)

    def data_ptr(self):
        return self.ptr

    def numel(self):
        n = 1
        for x in self.shape:
            n *= x
        return n

    def element_size(self):
        return 2

    def is_contiguous(self):
        return True


class NpuCache:
    """One ``rbln_malloc`` allocation (the RBLN test runtime named by RBLN_RUNTIME_LIB), a
    view per layer; the fake model writes and D reads through ``rbln_memcpy``."""

    device = "rbln"

    def __init__(self):
        import ctypes

        self.c = ctypes
        self.rt = ctypes.CDLL(os.environ["RBLN_RUNTIME_LIB"])
        self.layer_bytes = 2 * NUM_BLOCKS * KV_HEADS * BLOCK_SIZE * HEAD_SIZE * 2
        ptr = ctypes.c_void_p()
        rc = self.rt.rbln_malloc(0, ctypes.c_uint64(LAYERS * self.layer_bytes), ctypes.byref(ptr))
        if rc != 0:
            raise RuntimeError(f"rbln_malloc: {rc}")
        self.base = ptr.value
        self.block_bytes = KV_HEADS * BLOCK_SIZE * HEAD_SIZE * 2

    def layers(self):
        return [NpuTensor(self.base + l * self.layer_bytes, (2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE)) for l in range(LAYERS)]

    def _at(self, l, p, blk):
        return self.base + l * self.layer_bytes + (p * NUM_BLOCKS + blk) * self.block_bytes

    def write(self, l, p, blk, arr):
        a = np.ascontiguousarray(arr, dtype=np.uint16)
        rc = self.rt.rbln_memcpy(0, self.c.c_void_p(self._at(l, p, blk)), self.c.c_void_p(a.ctypes.data), self.c.c_uint64(a.nbytes), 0)
        if rc != 0:
            raise RuntimeError(f"rbln_memcpy H2D: {rc}")

    def read(self, l, p, blk):
        out = np.empty((KV_HEADS, BLOCK_SIZE, HEAD_SIZE), dtype=np.uint16)
        rc = self.rt.rbln_memcpy(0, self.c.c_void_p(out.ctypes.data), self.c.c_void_p(self._at(l, p, blk)), self.c.c_uint64(out.nbytes), 1)
        if rc != 0:
            raise RuntimeError(f"rbln_memcpy D2H: {rc}")
        return out


def build_npu_runtime():
    """Build the RBLN test runtime (rbln-sys/testlib) once; RBLN_RUNTIME_LIB names it."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(root, "target", "py-rbln", "librbln_test.so")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    src = os.path.join(root, "rbln-sys", "testlib", "rbln_test_runtime.c")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-pthread", "-o", out, src], check=True)
    os.environ["RBLN_RUNTIME_LIB"] = out


class Request:
    """What vLLM's scheduler hands the connector: id, prompt length, transfer parameters."""

    def __init__(self, request_id, n, params):
        self.request_id = request_id
        self.num_prompt_tokens = n
        self.kv_transfer_params = params


class Engine:
    def __init__(self, name, role, mode, lease, memory):
        from kvrail.vllm import KVConnectorRole, KvrailPullConnector, KvrailPushConnector

        self.cache = NpuCache() if memory == "npu" else HostCache()

        extra = {"kv_lease_duration": lease}
        if mode == "push_stream":
            extra["push_stream"] = True
        agent = json.loads(os.environ.get("KVRAIL_AGENT_CONFIG") or "{}")
        agent.setdefault("listen", "127.0.0.1:0")
        extra["kvrail_agent_config"] = agent
        cfg = {
            "kv_connector": "KvrailPullConnector" if mode == "pull" else "KvrailPushConnector",
            "kv_connector_module_path": "kvrail.vllm",
            "kv_role": role,
            "kv_buffer_device": self.cache.device,
            "engine_id": name,
            "kv_connector_extra_config": extra,
        }
        vc = SimpleNamespace(
            kv_transfer_config=cfg,
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=STEP_TOKENS),
            cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
            tp_rank=0,
        )
        cls = KvrailPullConnector if mode == "pull" else KvrailPushConnector
        self.sched = cls(vc, KVConnectorRole.SCHEDULER)
        self.worker = cls(vc, KVConnectorRole.WORKER)
        self.names = [f"model.layers.{l}.self_attn" for l in range(LAYERS)]
        self.worker.register_kv_caches(dict(zip(self.names, self.cache.layers())))
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})
        self.free = list(range(1, NUM_BLOCKS))
        self.reqs = {}  # id -> dict(req, blocks, computed, seed)

    def alloc(self, n):
        nb = -(-n // BLOCK_SIZE)
        if nb > len(self.free):
            raise RuntimeError("out of KV blocks")
        b, self.free = self.free[:nb], self.free[nb:]
        return b

    def step(self, scheduler_output=None):
        """One engine step: the scheduler's metadata, the worker's forward hooks, the
        workers' report back to the scheduler."""
        meta = self.sched.build_connector_meta(scheduler_output)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for n in self.names:
            self.worker.wait_for_layer_load(n)
            self.worker.save_kv_layer(n, None, None)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        out = SimpleNamespace(finished_sending=sending, finished_recving=recving)
        self.sched.update_connector_output(out)
        return sending or set(), recving or set(), self.worker.get_block_ids_with_load_errors()


def _compute(e, r, upto):
    """The forward: the fake model's KV of tokens [computed, upto) into the cache."""
    toks = tokens(r["seed"], r["req"].num_prompt_tokens)
    first, last = r["computed"] // BLOCK_SIZE, -(-upto // BLOCK_SIZE)
    for bi in range(first, last):
        blk = r["blocks"][bi]
        for l in range(LAYERS):
            for p in range(2):
                e.cache.write(l, p, blk, block_kv(toks[:upto], l, p, bi))
    r["computed"] = upto


def prefill_main(conn, mode, lease, memory):
    e = Engine("prefill-py", "kv_producer", mode, lease, memory)
    hs = e.worker.get_handshake_metadata()
    conn.send(("ready", e.worker._worker.backend, hs.host, hs.port))
    held = {}  # request id -> (blocks, finished at)
    pending = []
    while True:
        while conn.poll():
            m = conn.recv()
            if m[0] == "quit":
                conn.send(("bye", len(e.free)))
                return
            _, rid, seed, n = m
            req = Request(rid, n, {"do_remote_decode": True})
            e.sched.on_new_request(req)
            e.sched.get_num_new_matched_tokens(req, 0)
            blocks = e.alloc(n)
            e.sched.update_state_after_alloc(req, blocks, 0)
            e.reqs[rid] = {"req": req, "blocks": blocks, "computed": 0, "seed": seed, "new": True,
                           "posted": e.worker._worker.bytes_posted()}
            pending.append(rid)
        # the scheduler output of this step (what earlier steps computed), then the forward
        new, cached = [], SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
        for rid in pending:
            r = e.reqs[rid]
            if r.pop("new", False):
                new.append(SimpleNamespace(req_id=rid, block_ids=(r["blocks"],), num_computed_tokens=r["computed"]))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(r["computed"])
        sending, _, _ = e.step(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached))
        for rid in list(pending):
            r = e.reqs[rid]
            _compute(e, r, min(r["computed"] + STEP_TOKENS, r["req"].num_prompt_tokens))
            if r["computed"] == r["req"].num_prompt_tokens:
                pending.remove(rid)
                # push_stream: what P already WROTE to D while the prompt was being computed
                streamed = e.worker._worker.bytes_posted() - r["posted"]
                delay, params = e.sched.request_finished(r["req"], r["blocks"])
                if not delay or not params:
                    conn.send(("error", rid, f"P did not hold the blocks ({delay}, {params})"))
                held[rid] = (r["blocks"], time.time())
                conn.send(("prefilled", rid, params, streamed))
        for rid in sending:
            blocks, t = held.pop(rid)
            e.free.extend(blocks)
            conn.send(("freed", rid, time.time() - t))
        if not e.sched.has_pending_push_work() and not pending and not held:
            time.sleep(0.002)
        elif pending and mode == "push_stream":
            time.sleep(0.01)  # a forward takes time: D's registration arrives mid-prefill
        else:
            time.sleep(0.0005)


def decode_main(conn, mode, lease, memory):
    e = Engine("decode-py", "kv_consumer", mode, lease, memory)
    conn.send(("ready", e.worker._worker.backend, None, None))
    waiting = {}
    while True:
        while conn.poll():
            m = conn.recv()
            if m[0] == "quit":
                conn.send(("bye", len(e.free)))
                return
            _, rid, seed, n, params = m
            req = Request(rid, n, params)
            e.sched.on_new_request(req)
            ext, is_async = e.sched.get_num_new_matched_tokens(req, 0)
            if ext != n or not is_async:
                conn.send(("error", rid, f"matched {ext} of {n} ({is_async})"))
                continue
            blocks = e.alloc(n)
            e.sched.update_state_after_alloc(req, blocks, ext)
            waiting[rid] = (req, blocks, seed, time.time())
            conn.send(("admitted", rid))
        _, recving, errors = e.step()
        for rid in recving:
            req, blocks, seed, t0 = waiting.pop(rid)
            n = req.num_prompt_tokens
            bad = 0
            if errors & set(blocks):
                bad = -1
            else:
                toks = tokens(seed, n)
                for bi, blk in enumerate(blocks):
                    for l in range(LAYERS):
                        for p in range(2):
                            want = block_kv(toks, l, p, bi)
                            got = e.cache.read(l, p, blk)
                            # attention reads the prompt's tokens: every one of them
                            upto = min(BLOCK_SIZE, n - bi * BLOCK_SIZE)
                            bad += int(np.count_nonzero(got[:, :upto, :] != want[:, :upto, :]))
            e.sched.request_finished(req, blocks)
            e.free.extend(blocks)
            conn.send(("received", rid, bad, time.time() - t0))
        time.sleep(0.0005)


def _expect(conn, kinds, timeout=DEADLINE):
    if not conn.poll(timeout):
        raise SystemExit(f"no answer within {timeout} s (waiting for {kinds})")
    m = conn.recv()
    if m[0] == "error":
        raise SystemExit(f"engine error: {m[1:]}")
    if m[0] not in kinds:
        raise SystemExit(f"unexpected {m}")
    return m


def run(mode, requests, kill_d, lease, memory):
    if memory == "npu":
        build_npu_runtime()
    ctx = mp.get_context("spawn")
    pp, pc = ctx.Pipe()
    dp, dc = ctx.Pipe()
    P = ctx.Process(target=prefill_main, args=(pc, mode, lease, memory))
    D = ctx.Process(target=decode_main, args=(dc, mode, lease, memory))
    P.start()
    D.start()
    failures = 0
    try:
        _, pb, p_host, p_port = _expect(pp, ["ready"])
        db = _expect(dp, ["ready"])[1]
        print(f"harness: {mode}, {memory} memory, P on {pb}, D on {db}; {LAYERS} layers x {KV_HEADS} KV heads x {HEAD_SIZE}, fp16, block size {BLOCK_SIZE}, prefill step {STEP_TOKENS} tokens", flush=True)
        rng = np.random.default_rng(11)
        if kill_d:
            n = 100
            pp.send(("prefill", "req-killed", 99, n))
            _, rid, params, _ = _expect(pp, ["prefilled"])
            dp.send(("decode", rid, 99, n, params))
            _expect(dp, ["admitted"])
            os.kill(D.pid, signal.SIGKILL)
            t0 = time.time()
            _, rid, held = _expect(pp, ["freed"], timeout=lease * 4 + 30)
            print(f"D killed after admitting {rid}: P freed its blocks by lease after {held:.1f} s (lease {lease} s)", flush=True)
            pp.send(("quit",))
            free = _expect(pp, ["bye"])[1]
            ok = free == NUM_BLOCKS - 1 and held >= lease * 0.5
            print(f"P holds no blocks: {free == NUM_BLOCKS - 1}", flush=True)
            return 0 if ok else 1
        streamed_total = 0
        for k in range(requests):
            n = int(rng.integers(20, 400))
            rid = f"req-{k}"
            pp.send(("prefill", rid, k + 1, n))
            if mode == "pull":
                # D needs P's blocks: the proxy waits for P's parameters
                _, rid, params, streamed = _expect(pp, ["prefilled"])
                dp.send(("decode", rid, k + 1, n, params))
                _expect(dp, ["admitted"])
            else:
                # push: both legs at once, D registers while P prefills
                early = {"do_remote_prefill": True, "remote_engine_id": "prefill-py", "remote_host": p_host,
                         "remote_port": p_port, "remote_block_ids": [], "remote_request_id": rid, "tp_size": 1}
                dp.send(("decode", rid, k + 1, n, early))
                _expect(dp, ["admitted"])
                _, rid, params, streamed = _expect(pp, ["prefilled"])
            streamed_total += streamed
            _, rid, bad, dt = _expect(dp, ["received"])
            freed = _expect(pp, ["freed"])
            status = "byte-exact" if bad == 0 else f"{bad} WRONG bytes" if bad > 0 else "load error"
            also = f"; {streamed} bytes WRITTEN before the prompt ended" if mode == "push_stream" else ""
            print(f"  {rid}: {n} tokens, {status}, received {dt * 1000:.1f} ms after admission; P freed it{also}", flush=True)
            failures += bad != 0
        pp.send(("quit",))
        dp.send(("quit",))
        pfree, dfree = _expect(pp, ["bye"])[1], _expect(dp, ["bye"])[1]
        leak = (NUM_BLOCKS - 1 - pfree) + (NUM_BLOCKS - 1 - dfree)
        print(f"harness {mode}: {requests - failures} of {requests} requests byte-exact; blocks leaked {leak}", flush=True)
        if mode == "push_stream":
            print(f"push_stream: {streamed_total} bytes went to D before their prompts ended", flush=True)
            if streamed_total == 0:
                return 1
        return 0 if failures == 0 and leak == 0 else 1
    finally:
        for proc in (P, D):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["pull", "push", "push_stream"], default="pull")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--kill-d", action="store_true")
    ap.add_argument("--lease", type=int, default=30)
    ap.add_argument("--memory", choices=["host", "npu"], default=None,
                    help="the engines' KV caches: numpy arrays, or NPU memory of the RBLN test runtime "
                         "(default: npu for push_stream, which is device to device only; host otherwise)")
    a = ap.parse_args()
    memory = a.memory or ("npu" if a.mode == "push_stream" else "host")
    return run(a.mode, a.requests, a.kill_d, a.lease, memory)


if __name__ == "__main__":
    sys.exit(main())
