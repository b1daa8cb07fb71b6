"""Start engines (python/tests/vllm/engine.py) as processes and talk to them."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class Engine:
    """One engine process; ``call`` sends a command and returns its reply."""

    def __init__(self, python, model, role, connector="kvrail", mode="pull", engine_id=None, env=None, extra=None, log=None, prefix_caching=False, top=None, tp=1):
        cmd = [python, os.path.join(HERE, "engine.py"), "--model", model, "--role", role, "--connector", connector, "--mode", mode]
        if prefix_caching:
            cmd.append("--prefix-caching")
        if tp > 1:
            cmd += ["--tp", str(tp)]
        if engine_id:
            cmd += ["--engine-id", engine_id]
        if extra:
            cmd += ["--extra", json.dumps(extra)]
        if top:
            cmd += ["--top", json.dumps(top)]
        e = dict(os.environ)
        e.update(env or {})
        self.name = engine_id or role
        if log:
            os.makedirs(os.path.dirname(log), exist_ok=True)
        self.log = open(log or os.devnull, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=e)

    def ready(self, timeout=300):
        return self._read(timeout)

    def _read(self, timeout):
        box = {}

        def rd():
            box["line"] = self.p.stdout.readline()

        t = threading.Thread(target=rd, daemon=True)
        t.start()
        t.join(timeout)
        line = box.get("line")
        if not line:
            raise RuntimeError(f"{self.name}: no answer within {timeout} s (exit {self.p.poll()})")
        return json.loads(line)

    def call(self, timeout=300, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read(timeout)

    def pause(self):
        """Stop the process (SIGSTOP): an idle engine of the other pair takes no CPU while
        this pair is measured (NIXL's UCX progress threads spin a core each when idle)."""
        os.kill(self.p.pid, signal.SIGSTOP)

    def resume(self):
        os.kill(self.p.pid, signal.SIGCONT)

    def close(self):
        try:
            self.p.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.p.stdin.flush()
            self.p.wait(30)
        except Exception:
            self.p.kill()
            self.p.wait()
        self.log.close()


def prompt(n, seed):
    return [(i * 37 + seed * 101 + 5) % 500 + 3 for i in range(n)]
