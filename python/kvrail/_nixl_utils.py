"""The helpers NIXL's examples and tests take from ``nixl._utils``, on kvrail: raw host
memory by address (``malloc_passthru``/``free_passthru``), NIXL's fill pattern
(``ba_buf``) and a byte compare (``verify_transfer``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("kvrail.nixl")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size: int) -> int:
    """``size`` bytes of host memory from malloc; its address (free with ``free_passthru``)."""
    if size < 0:
        raise ValueError(f"size: {size} (not a byte count)")
    addr = _libc.malloc(int(size))
    if not addr:
        raise MemoryError(f"malloc({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    """Give back memory from ``malloc_passthru``."""
    _libc.free(ctypes.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> None:
    """Fill ``size`` bytes at ``addr`` with NIXL's pattern, 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Compare ``size`` bytes at two addresses; a difference is logged as an error (as in
    NIXL, nothing is raised)."""
    a, b = ctypes.string_at(int(addr1), int(size)), ctypes.string_at(int(addr2), int(size))
    if a != b:
        at = next(i for i in range(len(a)) if a[i] != b[i])
        logger.error("verify_transfer: %d bytes differ, the first at offset %d", sum(x != y for x, y in zip(a, b)), at)


__all__ = ["malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"]
