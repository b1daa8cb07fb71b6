"""The README's Python example runs on kvrail.nixl (python/run-tests.sh runs it against the
real NIXL too)."""

import os
import subprocess
import sys


def test_the_readmes_example_runs():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, KVRAIL_AGENT_CONFIG=os.environ.get("KVRAIL_AGENT_CONFIG", '{"backend": "tcp"}'))
    r = subprocess.run([sys.executable, os.path.join(here, "readme_example.py")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "README example: 1 MiB written, the notification after it" in r.stdout
