#!/usr/bin/env python3
"""A program written against NIXL's Python agent API (``nixl._api``), run unchanged against
the real NIXL and against ``kvrail.nixl``: only the import differs (``--impl``).

Two processes — a target and an initiator — exchange metadata over a pipe, then:

* unprepped WRITEs (``initialize_xfer``) of 4 KiB, 64 KiB, 1 MiB and 8 MiB, each with a
  notification the target waits for before it checks every byte;
* a 64-descriptor scattered WRITE, with the gaps between descriptors checked untouched;
* prepped READs (``prep_xfer_dlist`` + ``make_prepped_xfer``) of every size, by index;
* a handle posted again with a new notification (``transfer(handle, msg)``), and again with
  none (the last one is kept, as NIXL does);
* standalone notifications both ways (``send_notif``; ``get_new_notifs`` is a dict of peer
  name -> list of bytes; ``check_remote_xfer_done`` by prefix);
* errors: an unknown peer, descriptors outside registered memory, a removed peer.

Every check prints ``ok``/``FAIL``; the exit status is the number of failures (0: passed).
``--bench`` instead prints MB/s of WRITE and READ at 64 KiB, 1 MiB and 8 MiB, 8 in flight.

Run the real NIXL with ``UCX_TLS=tcp UCX_NET_DEVICES=lo`` on a host without RDMA.
"""

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

SIZES = [4096, 65536, 1 << 20, 8 << 20]
AREA = sum(SIZES)  # each phase has its own area of the buffer
SCATTER = 64  # descriptors of the scattered WRITE, 4 KiB each with 4 KiB gaps
BUF = 3 * AREA + SCATTER * 8192
DEADLINE = 120.0


def load(impl):
    if impl == "nixl":
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
    else:
        from kvrail.nixl import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def pattern(seed, n):
    """Bytes that differ at every offset and between seeds."""
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed * 40503)) >> np.uint64(7)).astype(np.uint8)


def offsets():
    out, off = [], 0
    for s in SIZES:
        out.append(off)
        off += s
    return out


class Checks:
    def __init__(self, who):
        self.who, self.failed, self.passed = who, 0, 0

    def __call__(self, ok, what):
        print(f"{'ok  ' if ok else 'FAIL'} [{self.who}] {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        return ok


def wait_state(agent, h):
    t = time.time()
    while True:
        st = agent.check_xfer_state(h)
        if st != "PROC" or time.time() - t > DEADLINE:
            return st


def wait_notif(agent, peer, tag):
    t = time.time()
    while time.time() - t < DEADLINE:
        if agent.check_remote_xfer_done(peer, tag):
            return True
        time.sleep(0.0005)
    return False


def target(conn, impl):
    nixl_agent, nixl_agent_config = load(impl)
    ck = Checks("target")
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(BUF, dtype=np.uint8)
    buf[AREA:2 * AREA] = pattern(2, AREA)  # what the initiator READs
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    peer = agent.add_remote_agent(conn.recv())
    ck(peer in (b"initiator", "initiator"), f"add_remote_agent names the peer ({peer!r})")
    ck(isinstance(peer, bytes), "add_remote_agent returns bytes")
    # unprepped WRITEs: a notification per size, then every byte
    want = pattern(1, AREA)
    for s, off in zip(SIZES, offsets()):
        ck(wait_notif(agent, "initiator", f"W-{s}".encode()), f"WRITE {s} B: notification")
        ck(np.array_equal(buf[off:off + s], want[off:off + s]), f"WRITE {s} B: every byte")
    # the scattered WRITE (posted once the sizes were checked): landed, gaps untouched
    conn.send("sizes checked")
    notifs = {}
    t = time.time()
    while not notifs and time.time() - t < DEADLINE:
        notifs = agent.get_new_notifs()
        time.sleep(0.0005)
    ck(notifs == {"initiator": [b"scatter"]}, f"get_new_notifs shape: {notifs!r}")
    base = 3 * AREA
    sc = pattern(3, SCATTER * 8192)
    ok = all(
        np.array_equal(buf[base + k * 8192:base + k * 8192 + 4096], sc[k * 8192:k * 8192 + 4096])
        and not buf[base + k * 8192 + 4096:base + (k + 1) * 8192].any()
        for k in range(SCATTER)
    )
    ck(ok, f"scattered WRITE of {SCATTER} descriptors: every byte, gaps untouched")
    # reposts: the new message, then the same again when none is given
    conn.send("scatter checked")  # the initiator reposts only now: one notification each
    ck(wait_notif(agent, "initiator", b"again-1"), "repost with a new notification")
    ck(wait_notif(agent, "initiator", b"again-1"), "repost without one keeps the last")
    # READs by the initiator: their notifications
    for s in SIZES:
        ck(wait_notif(agent, "initiator", f"R-{s}".encode()), f"READ {s} B: notification")
    ck(not np.array_equal(buf[AREA:2 * AREA], np.zeros(AREA, np.uint8)), "READ source intact")
    # standalone notifications both ways
    ck(wait_notif(agent, "initiator", b"hello target"), "send_notif initiator -> target")
    agent.send_notif(peer, b"hello initiator")
    conn.send(("done", ck.failed, ck.passed))
    conn.recv()  # the initiator is finished with this agent


def initiator(conn, impl):
    nixl_agent, nixl_agent_config = load(impl)
    ck = Checks("initiator")
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(BUF, dtype=np.uint8)
    buf[:AREA] = pattern(1, AREA)  # what it WRITEs
    buf[3 * AREA:] = pattern(3, SCATTER * 8192)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    meta, raddr = conn.recv()
    conn.send(agent.get_agent_metadata())
    peer = agent.add_remote_agent(meta)
    ck(peer in (b"target", "target"), f"add_remote_agent names the peer ({peer!r})")
    la, offs = buf.ctypes.data, offsets()
    # errors NIXL shows: an unknown peer, descriptors outside registered memory
    one_l = agent.get_xfer_descs([(la, 4096, 0)], "DRAM")
    one_r = agent.get_xfer_descs([(raddr, 4096, 0)], "DRAM")
    for what, args in [
        ("unknown peer", (one_l, one_r, "nobody")),
        ("local descriptor outside registered memory", (agent.get_xfer_descs([(8, 4096, 0)], "DRAM"), one_r, peer)),
        ("remote descriptor outside registered memory", (one_l, agent.get_xfer_descs([(8, 4096, 0)], "DRAM"), peer)),
    ]:
        try:
            agent.initialize_xfer("WRITE", *args, b"x")
            ck(False, f"{what}: refused")
        except Exception as e:
            ck(type(e).__name__ == "nixlNotFoundError", f"{what}: {type(e).__name__}")
    # unprepped WRITEs, one per size
    for s, off in zip(SIZES, offs):
        h = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(la + off, s, 0)], "DRAM"),
            agent.get_xfer_descs([(raddr + off, s, 0)], "DRAM"),
            peer,
            f"W-{s}".encode(),
        )
        st = agent.transfer(h)
        ck(st in ("PROC", "DONE"), f"WRITE {s} B: transfer() -> {st}")
        ck(wait_state(agent, h) == "DONE", f"WRITE {s} B: DONE")
        agent.release_xfer_handle(h)
    # scattered WRITE, once the target took every notification so far
    ck(conn.recv() == "sizes checked", "target checked the WRITEs")
    base = 3 * AREA
    ldl = agent.get_xfer_descs([(la + base + k * 8192, 4096, 0) for k in range(SCATTER)], "DRAM")
    rdl = agent.get_xfer_descs([(raddr + base + k * 8192, 4096, 0) for k in range(SCATTER)], "DRAM")
    h = agent.initialize_xfer("WRITE", ldl, rdl, peer, b"scatter")
    agent.transfer(h)
    ck(wait_state(agent, h) == "DONE", f"scattered WRITE of {SCATTER} descriptors: DONE")
    ck(conn.recv() == "scatter checked", "target checked the scattered WRITE")
    for msg in (b"again-1", b""):
        agent.transfer(h, msg)
        ck(wait_state(agent, h) == "DONE", f"repost (notif {msg!r}): DONE")
    agent.release_xfer_handle(h)
    # prepped READs from the target's second area into the initiator's second area
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(la + AREA + o, s, 0) for s, o in zip(SIZES, offs)], "DRAM")
    remote = agent.prep_xfer_dlist(peer, [(raddr + AREA + o, s, 0) for s, o in zip(SIZES, offs)], "DRAM")
    want = pattern(2, AREA)
    for i, (s, off) in enumerate(zip(SIZES, offs)):
        h = agent.make_prepped_xfer("READ", local, [i], remote, [i], f"R-{s}".encode())
        agent.transfer(h)
        ck(wait_state(agent, h) == "DONE", f"prepped READ {s} B: DONE")
        got = buf[AREA + off:AREA + off + s]
        ck(np.array_equal(got, want[off:off + s]), f"prepped READ {s} B: every byte")
        agent.release_xfer_handle(h)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    agent.send_notif(peer, b"hello target")
    ck(wait_notif(agent, "target", b"hello initiator"), "send_notif target -> initiator")
    res = conn.recv()
    # a removed peer is unknown again
    agent.remove_remote_agent(peer)
    try:
        agent.initialize_xfer("WRITE", one_l, one_r, peer, b"x")
        ck(False, "removed peer: refused")
    except Exception as e:
        ck(type(e).__name__ == "nixlNotFoundError", f"removed peer: {type(e).__name__}")
    if impl == "kvrail":  # what carried it (kvrail only; NIXL has no such call)
        k = agent.agent.kvrail
        print(f"[initiator] kvrail backend {k.backend}; rail bytes {k.rail_bytes()}; "
              f"payload bytes copied {k.payload_bytes_copied()}", flush=True)
    agent.deregister_memory(reg)
    conn.send("bye")
    print(f"[target] {res[2]} ok, {res[1]} failed", flush=True)
    print(f"[initiator] {ck.passed} ok, {ck.failed} failed", flush=True)
    sys.stdout.flush()
    # os._exit: NIXL 1.5.1's agent crashed (SIGSEGV) in its destructor at interpreter exit
    os._exit(min(res[1] + ck.failed, 100))


def bench_target(conn, impl, sizes, inflight):
    nixl_agent, nixl_agent_config = load(impl)
    agent = nixl_agent("bench-target", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(max(sizes) * inflight, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    agent.add_remote_agent(conn.recv())
    conn.recv()


def bench_initiator(conn, impl, sizes, inflight, secs):
    nixl_agent, nixl_agent_config = load(impl)
    agent = nixl_agent("bench-initiator", nixl_agent_config(backends=["UCX"]))
    buf = np.ones(max(sizes) * inflight, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    meta, raddr = conn.recv()
    conn.send(agent.get_agent_metadata())
    peer = agent.add_remote_agent(meta)
    la = buf.ctypes.data
    out = []
    for op in ("WRITE", "READ"):
        for s in sizes:
            hs = [
                agent.initialize_xfer(
                    op,
                    agent.get_xfer_descs([(la + k * s, s, 0)], "DRAM"),
                    agent.get_xfer_descs([(raddr + k * s, s, 0)], "DRAM"),
                    peer,
                )
                for k in range(inflight)
            ]
            for h in hs:  # warm-up round
                agent.transfer(h)
            for h in hs:
                wait_state(agent, h)
            n, t0 = 0, time.perf_counter()
            for h in hs:
                agent.transfer(h)
            while time.perf_counter() - t0 < secs:
                for h in hs:
                    st = agent.check_xfer_state(h)
                    if st == "DONE":
                        n += 1
                        agent.transfer(h)
                    elif st == "ERR":
                        raise SystemExit(f"{op} {s}: transfer failed")
            for h in hs:
                if wait_state(agent, h) == "DONE":
                    n += 1
            dt = time.perf_counter() - t0
            out.append((op, s, n * s / dt / 1e6))
            for h in hs:
                agent.release_xfer_handle(h)
    conn.send("bye")
    for op, s, mbs in out:
        print(f"BENCH {impl} {op} {s} {mbs:.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["nixl", "kvrail"], default="kvrail")
    ap.add_argument("--bench", action="store_true", help="MB/s instead of the checks")
    ap.add_argument("--sizes", default="65536,1048576,8388608")
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--secs", type=float, default=2.0, help="seconds per bench case")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    c1, c2 = ctx.Pipe()
    if a.bench:
        sizes = [int(x) for x in a.sizes.split(",")]
        t = ctx.Process(target=bench_target, args=(c1, a.impl, sizes, a.inflight))
        t.start()
        bench_initiator(c2, a.impl, sizes, a.inflight, a.secs)
        t.join(30)
        sys.stdout.flush()
        os._exit(0)  # NIXL 1.5.1's agent crashes in its destructor at interpreter exit
    t = ctx.Process(target=target, args=(c1, a.impl))
    t.start()
    try:
        initiator(c2, a.impl)
    finally:
        t.join(30)
        if t.is_alive():
            t.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
