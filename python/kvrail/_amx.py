"""Linux's permission for AMX tile data, asked for once per process (``arch_prctl``).

Linux (5.16 on) keeps the AMX tile registers off for a process until it asks for them with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; the first tile instruction of a
process that did not ask dies with SIGILL. vLLM 0.32's CPU attention picks its AMX kernels
(``cpu_attn_amx``) on any CPU whose flags say ``amx_tile`` and never asks: on such a host
(found on this project's CI machine, kernel 6.18) a decode over KV that was not computed in
the same step — every step of a D whose prompt came from P, or a prefix-cache hit — killed
the engine's worker with SIGILL. kvrail.vllm and kvrail.nixl (which vLLM's own NixlConnector
runs on, through the compat package) ask when they are imported, in every process that
builds a connector (vLLM's workers among them), before the model runs. Real NIXL inside
vLLM on such a host meets the same SIGILL; that is vLLM's to fix.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("kvrail.vllm")

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_asked: "bool | None" = None


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile data for this process (once); True when the process has it
    now, False where the CPU or the OS has none, or the kernel said no (logged once)."""
    global _asked
    if _asked is not None:
        return _asked
    _asked = False
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not _cpu_has_amx():
        return False
    if os.environ.get("KVRAIL_NO_AMX_REQUEST"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    perm = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(perm)) == 0 and perm.value >> _XFEATURE_XTILEDATA & 1:
        _asked = True
        return True
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        logger.warning("kvrail: Linux refused AMX tile data to this process (arch_prctl: %s); vLLM's AMX "
                       "attention kernels will fail here", os.strerror(err))
        return False
    _asked = True
    return True
