#!/usr/bin/env python3
"""kvrail's C ABI from Python with ctypes (no build step): two agents in loopback, a READ of
three descriptors and a notification, every byte checked; then a WRITE between buffers the
Python program owns (registered in place with kvrail_agent_register_memory), checked in
Python's own memory.

usage: check.py path/to/libkvrail_ffi.so
env:   KVRAIL_CONFIG (agent JSON, default TCP on 127.0.0.1),
       KVRAIL_EXPECT_BACKEND (tcp|verbs: fail unless the agents use it)
"""
import ctypes as C
import os
import sys
import time

lib = C.CDLL(sys.argv[1])
OK, BUFFER_TOO_SMALL, XFER_FAILED = 0, 102, 300
READ, WRITE = 0, 1
ACCESS_NONE, ACCESS_READ = 0, 1


class Desc(C.Structure):
    _fields_ = [("region", C.c_uint32), ("offset", C.c_uint64), ("len", C.c_uint64)]


class MemDesc(C.Structure):
    _fields_ = [("addr", C.c_uint64), ("len", C.c_uint64), ("kind", C.c_uint32),
                ("device_id", C.c_int32), ("dmabuf_fd", C.c_int32), ("dmabuf_offset", C.c_uint64)]


MEM_HOST = 0
ACCESS_WRITE = 2


lib.kvrail_result_message.restype = C.c_char_p
lib.kvrail_result_message.argtypes = [C.c_uint32]
for name, args in {
    "kvrail_agent_new": [C.c_char_p, C.c_char_p, C.POINTER(C.c_void_p)],
    "kvrail_agent_backend": [C.c_void_p, C.POINTER(C.c_uint32)],
    "kvrail_agent_register": [C.c_void_p, C.c_size_t, C.c_uint32, C.POINTER(C.c_uint32)],
    "kvrail_agent_register_memory": [C.c_void_p, C.POINTER(MemDesc), C.c_uint32, C.POINTER(C.c_uint32)],
    "kvrail_agent_deregister": [C.c_void_p, C.c_uint32],
    "kvrail_agent_write_region": [C.c_void_p, C.c_uint32, C.c_uint64, C.c_char_p, C.c_size_t],
    "kvrail_agent_read_region": [C.c_void_p, C.c_uint32, C.c_uint64, C.c_void_p, C.c_size_t],
    "kvrail_agent_side_channel_addr": [C.c_void_p, C.c_void_p, C.c_size_t, C.POINTER(C.c_size_t)],
    "kvrail_agent_load_remote": [C.c_void_p, C.c_char_p, C.c_void_p, C.c_size_t, C.POINTER(C.c_size_t)],
    "kvrail_agent_send_notif": [C.c_void_p, C.c_char_p, C.c_char_p, C.c_size_t],
    "kvrail_agent_get_notif": [C.c_void_p, C.c_void_p, C.c_size_t, C.POINTER(C.c_size_t),
                               C.c_void_p, C.c_size_t, C.POINTER(C.c_size_t), C.POINTER(C.c_bool)],
    "kvrail_xfer_new": [C.c_void_p, C.c_uint32, C.POINTER(Desc), C.c_size_t, C.c_char_p,
                        C.POINTER(Desc), C.c_size_t, C.c_char_p, C.c_size_t, C.POINTER(C.c_void_p)],
    "kvrail_xfer_post": [C.c_void_p],
    "kvrail_xfer_wait": [C.c_void_p, C.c_uint64],
    "kvrail_xfer_free": [C.c_void_p],
    "kvrail_last_error": [C.c_void_p, C.c_size_t, C.POINTER(C.c_size_t)],
}.items():
    f = getattr(lib, name)
    f.argtypes = args
    f.restype = C.c_uint32
lib.kvrail_agent_free.argtypes = [C.c_void_p]
lib.kvrail_agent_free.restype = None


def check(rc, what):
    if rc != OK:
        buf = C.create_string_buffer(512)
        n = C.c_size_t(0)
        lib.kvrail_last_error(buf, 512, C.byref(n))
        raise SystemExit(f"{what}: {lib.kvrail_result_message(rc).decode()} ({rc}): "
                         f"{buf.raw[:n.value].decode()}")


def agent(name):
    a = C.c_void_p()
    cfg = os.environ.get("KVRAIL_CONFIG", '{"backend":"tcp","listen":"127.0.0.1:0"}')
    check(lib.kvrail_agent_new(name.encode(), cfg.encode(), C.byref(a)), f"agent {name}")
    return a


def text(fn, *args):
    buf = C.create_string_buffer(256)
    n = C.c_size_t(0)
    check(fn(*args, buf, 256, C.byref(n)), fn.__name__)
    return buf.raw[: n.value].decode()


p, d = agent("prefill-0"), agent("decode-0")
backend = C.c_uint32(9)
check(lib.kvrail_agent_backend(d, C.byref(backend)), "backend")
backend = "verbs" if backend.value == 1 else "tcp"
print(f"backend {backend}")
want = os.environ.get("KVRAIL_EXPECT_BACKEND")
if want and want != backend:
    raise SystemExit(f"expected backend {want}, got {backend}")

LEN = 256 * 1024
src, dst = C.c_uint32(), C.c_uint32()
check(lib.kvrail_agent_register(p, LEN, ACCESS_READ, C.byref(src)), "register src")
check(lib.kvrail_agent_register(d, LEN, ACCESS_NONE, C.byref(dst)), "register dst")
data = bytes((i * 7 + (i >> 8)) & 0xFF for i in range(LEN))
check(lib.kvrail_agent_write_region(p, src, 0, data, LEN), "write_region")

addr = text(lib.kvrail_agent_side_channel_addr, p)
peer = text(lib.kvrail_agent_load_remote, d, addr.encode())
assert peer == "prefill-0", peer

spans = [(0, 1), (4096, 65536), (100000, LEN - 100000)]
local = (Desc * 3)(*[Desc(dst.value, o, n) for o, n in spans])
remote = (Desc * 3)(*[Desc(src.value, o, n) for o, n in spans])
x = C.c_void_p()
check(lib.kvrail_xfer_new(d, READ, local, 3, peer.encode(), remote, 3, b"pulled", 6, C.byref(x)), "xfer_new")
check(lib.kvrail_xfer_post(x), "post")
check(lib.kvrail_xfer_wait(x, 60000), "wait")
check(lib.kvrail_xfer_free(x), "free")

got = C.create_string_buffer(LEN)
check(lib.kvrail_agent_read_region(d, dst, 0, got, LEN), "read_region")
for o, n in spans:
    if got.raw[o:o + n] != data[o:o + n]:
        raise SystemExit(f"bytes at {o}+{n} differ")
if got.raw[1:4096] != bytes(4095):
    raise SystemExit("bytes outside the descriptors were written")

# the READ's notification reaches prefill; then a plain one goes back
deadline = time.time() + 30
pbuf, dbuf = C.create_string_buffer(64), C.create_string_buffer(64)
pn, dn, have = C.c_size_t(), C.c_size_t(), C.c_bool(False)


def next_notif(a):
    while time.time() < deadline:
        check(lib.kvrail_agent_get_notif(a, pbuf, 64, C.byref(pn), dbuf, 64, C.byref(dn), C.byref(have)), "get_notif")
        if have.value:
            return pbuf.raw[: pn.value].decode(), dbuf.raw[: dn.value]
        time.sleep(0.001)
    raise SystemExit("no notification")


assert next_notif(p) == ("decode-0", b"pulled")
# prefill loads decode too, to notify it
assert text(lib.kvrail_agent_load_remote, p, text(lib.kvrail_agent_side_channel_addr, d).encode()) == "decode-0"
check(lib.kvrail_agent_send_notif(p, b"decode-0", b"hello from python", 17), "send_notif")
assert next_notif(d) == ("prefill-0", b"hello from python")
# a buffer too small keeps the notification queued
check(lib.kvrail_agent_send_notif(p, b"decode-0", b"x" * 100, 100), "send_notif")
while True:
    rc = lib.kvrail_agent_get_notif(d, pbuf, 64, C.byref(pn), dbuf, 64, C.byref(dn), C.byref(have))
    if rc == BUFFER_TOO_SMALL:
        break
    check(rc, "get_notif")
    time.sleep(0.001)
    if time.time() > deadline:
        raise SystemExit("no notification")
big = C.create_string_buffer(128)
check(lib.kvrail_agent_get_notif(d, pbuf, 64, C.byref(pn), big, 128, C.byref(dn), C.byref(have)), "get_notif")
assert have.value and big.raw[: dn.value] == b"x" * 100

# the engine's own memory: Python buffers registered in place; D WRITEs into P's
OWN = 64 * 1024
mine = (C.c_char * OWN).from_buffer(bytearray(bytes((i * 13 + 5) & 0xFF for i in range(OWN))))
theirs = (C.c_char * OWN).from_buffer(bytearray(OWN))
own_src, own_dst = C.c_uint32(), C.c_uint32()
check(lib.kvrail_agent_register_memory(
    d, C.byref(MemDesc(C.addressof(mine), OWN, MEM_HOST, -1, -1, 0)), ACCESS_NONE, C.byref(own_src)),
    "register_memory (decode)")
check(lib.kvrail_agent_register_memory(
    p, C.byref(MemDesc(C.addressof(theirs), OWN, MEM_HOST, -1, -1, 0)), ACCESS_WRITE, C.byref(own_dst)),
    "register_memory (prefill)")
text(lib.kvrail_agent_load_remote, d, addr.encode())  # prefill's new region
one = (Desc * 1)(Desc(own_src.value, 100, OWN - 200))
two = (Desc * 1)(Desc(own_dst.value, 100, OWN - 200))
check(lib.kvrail_xfer_new(d, WRITE, one, 1, peer.encode(), two, 1, None, 0, C.byref(x)), "xfer_new (own)")
check(lib.kvrail_xfer_post(x), "post (own)")
check(lib.kvrail_xfer_wait(x, 60000), "wait (own)")
check(lib.kvrail_xfer_free(x), "free (own)")
# read straight from Python's buffer: no kvrail call in between
if bytes(theirs)[100:OWN - 100] != bytes(mine)[100:OWN - 100] or bytes(theirs)[:100] != bytes(100):
    raise SystemExit("WRITE into Python's own buffer: bytes differ")
check(lib.kvrail_agent_deregister(p, own_dst.value), "deregister (prefill)")
check(lib.kvrail_agent_deregister(d, own_src.value), "deregister (decode)")

lib.kvrail_agent_free(d)
lib.kvrail_agent_free(p)
print("python check passed: 3 descriptors READ byte-exact, notifications both ways, "
      "a WRITE between Python's own buffers")
