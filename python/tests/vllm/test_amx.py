"""kvrail.vllm asks Linux for AMX tile data when it is imported (kvrail._amx): vLLM 0.32's CPU
attention runs AMX kernels on any CPU whose flags say amx_tile without asking, and the
first tile instruction of a process that did not ask dies with SIGILL (every D step over
KV loaded from P did, on this project's CI machine)."""

import subprocess
import sys

import pytest

CHECK = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def perm():
    v = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(v)) == 0
    return bool(v.value >> 18 & 1)
before = perm()
if sys.argv[1] != "no":
    __import__(sys.argv[1])
print(before, perm())
"""


def amx_host():
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "amx_tile" in flags and sys.platform == "linux"


@pytest.mark.skipif(not amx_host(), reason="no AMX on this CPU: nothing to ask for")
@pytest.mark.parametrize("module", ["kvrail.vllm", "nixl._api"])
def test_importing_kvrails_connectors_gives_the_process_amx_tile_data(module):
    """kvrail.vllm, and kvrail.nixl through the compat package vLLM's NixlConnector imports."""
    plain = subprocess.run([sys.executable, "-c", CHECK, "no"], capture_output=True, text=True, check=True)
    assert plain.stdout.split() == ["False", "False"], "a fresh process had AMX already: the test shows nothing"
    out = subprocess.run([sys.executable, "-c", CHECK, module], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
