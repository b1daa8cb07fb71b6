#!/usr/bin/env python3
"""Mooncake Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`, metadata P2PHANDSHAKE)
as a bandwidth peer: python/bench-peers.py runs it on TCP loopback, tools/lab/bench.sh on rxe
(protocol rdma). Two processes like kvrail-perf's server and client, `depth` transfers in
flight (each finished one replaced at once), WRITE and READ. The READ's bytes are checked
once at the end (a pattern the target wrote).

    mooncake_bench.py target SIZE DEPTH        # prints "READY <rpc port> <buffer address>"
    mooncake_bench.py initiator SIZE DEPTH SECS OP HOST:PORT ADDR   # "BENCH OP SIZE MB/s"

Environment: MC_PROTOCOL (tcp; or rdma), MC_DEVICE (the RDMA device, rdma only), MC_HOST
(this process's address, 127.0.0.1), MC_TARGET_SECS (the target waits this long instead of
for its stdin to close); on rxe also MC_GID_INDEX (Mooncake's own).
"""

import os
import sys
import time

import numpy as np
from mooncake.engine import TransferEngine


def engine(size, depth):
    te = TransferEngine()
    proto, dev = os.environ.get("MC_PROTOCOL", "tcp"), os.environ.get("MC_DEVICE", "")
    if te.initialize(os.environ.get("MC_HOST", "127.0.0.1"), "P2PHANDSHAKE", proto, dev) != 0:
        sys.exit("mooncake: initialize failed")
    buf = np.zeros(size * depth, dtype=np.uint8)
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        sys.exit("mooncake: register_memory failed")
    return te, buf


def pattern(n):
    return (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) >> np.uint64(11)).astype(np.uint8)


def main():
    role, size, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    te, buf = engine(size, depth)
    if role == "target":
        buf[:] = pattern(buf.nbytes)
        print(f"READY {te.get_rpc_port()} {buf.ctypes.data}", flush=True)
        if os.environ.get("MC_TARGET_SECS"):
            time.sleep(float(os.environ["MC_TARGET_SECS"]))  # until killed, at most this long
        else:
            sys.stdin.read()  # until the bench closes our stdin
        return
    secs, op, target, peer = float(sys.argv[4]), sys.argv[5], sys.argv[6], int(sys.argv[7])
    base = buf.ctypes.data
    submit = te.batch_transfer_async_write if op == "WRITE" else te.batch_transfer_async_read

    def start(i):
        b = submit(target, [base + i * size], [peer + i * size], [size])
        if b < 0:
            sys.exit(f"mooncake: submit failed ({b})")
        return b

    # one warm-up round, then `depth` in flight for `secs`
    if te.get_batch_transfer_status([start(i) for i in range(depth)]) != 0:
        sys.exit("mooncake: warm-up failed")
    inflight = [start(i) for i in range(depth)]
    n, t0, i = 0, time.perf_counter(), 0
    while True:
        if te.get_batch_transfer_status([inflight[i]]) != 0:
            sys.exit("mooncake: a transfer failed")
        n += 1
        if time.perf_counter() - t0 >= secs:
            break
        inflight[i] = start(i)
        i = (i + 1) % depth
    for j in range(depth):
        if j != i and te.get_batch_transfer_status([inflight[j]]) != 0:
            sys.exit("mooncake: a transfer failed")
        n += j != i
    dt = time.perf_counter() - t0
    if op == "READ":
        want = pattern(buf.nbytes)
        if not np.array_equal(buf, want):
            sys.exit("mooncake: READ bytes differ")
    print(f"BENCH {op} {size} {n * size / dt / 1e6:.1f}", flush=True)


if __name__ == "__main__":
    main()
