#!/usr/bin/env python3
"""The floor of one TCP stream for a transfer engine: what a plain socket loop, with no engine
around it, moves between distinct buffers, as `bench-peers.py` measures kvrail-perf.

The sender sends SIZE-byte messages, each a 16-byte header (slot, length) and the payload
straight from its slot's buffer, taking SLOTS buffers in turn; the receiver reads each
payload straight into its own buffer of that slot (`recv_into`). No acknowledgements, no
notifications, no copy of the program's own: the kernel's copies only, as iperf3's (and,
as iperf3, it does not check the bytes; a header naming no slot ends it). With
SLOTS × SIZE larger than the caches (kvrail-perf's 8 in flight of 8 MiB: 64 MiB a side)
every byte is read and written in memory that is not in cache, which iperf3, sending one
1 MiB buffer again and again into one 1 MiB buffer, never does.

    socket_floor.py recv PORT SIZE SLOTS        # prints "LISTEN", then serves one sender
    socket_floor.py send PORT SIZE SLOTS SECS   # prints "FLOOR <MB/s>" (10^6 B/s)
"""

import os
import socket
import struct
import sys
import time

HEADER = struct.Struct("<QQ")


def buffers(size, slots):
    """SLOTS distinct buffers of SIZE bytes, every page written (faulted in before timing)."""
    return [memoryview(bytearray(os.urandom(1) * size)) for _ in range(slots)]


def recv_exact(sock, view):
    """Fill `view` from the socket; False when the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def receive(port, size, slots):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(1)
    views = buffers(size, slots)
    print("LISTEN", flush=True)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as kvrail's connections
    header = memoryview(bytearray(HEADER.size))
    while recv_exact(conn, header):
        slot, length = HEADER.unpack(header)
        if slot >= slots or length > size:
            sys.exit(f"bad header: slot {slot}, {length} bytes")
        if not recv_exact(conn, views[slot][:length]):
            sys.exit("the sender closed mid-message")


def send(port, size, slots, secs):
    views = buffers(size, slots)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent, k = 0, 0
    start = time.perf_counter()
    while True:
        slot = k % slots
        sock.sendall(HEADER.pack(slot, size))
        sock.sendall(views[slot])  # from the buffer itself
        sent += size
        k += 1
        elapsed = time.perf_counter() - start
        if elapsed >= secs:
            break
    sock.close()
    print(f"FLOOR {sent / elapsed / 1e6:.1f}", flush=True)


def main():
    if len(sys.argv) < 5 or sys.argv[1] not in ("recv", "send"):
        sys.exit(__doc__)
    port, size, slots = (int(v) for v in sys.argv[2:5])
    if sys.argv[1] == "recv":
        receive(port, size, slots)
    else:
        send(port, size, slots, float(sys.argv[5]))


if __name__ == "__main__":
    main()
