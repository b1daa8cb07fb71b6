"""The NIXL-API program (``nixl_api_program.py``) against kvrail.nixl: two processes, every
check passes, and on TCP nothing but the socket copies are counted."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_nixl_api_program_on_kvrail():
    env = dict(os.environ, KVRAIL_AGENT_CONFIG='{"backend": "tcp", "listen": "127.0.0.1:0"}')
    r = subprocess.run([sys.executable, os.path.join(HERE, "nixl_api_program.py"), "--impl", "kvrail"],
                       env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "[target] 20 ok, 0 failed" in out, out
    assert "[initiator] 27 ok, 0 failed" in out, out
    assert "kvrail backend tcp" in out, out
