"""A P/D deployment of real vLLM on this host, as operators run one: N prefill and M decode
``vllm serve`` engines (vLLM's OpenAI server) with kvrail.vllm as their KV connector, behind
vLLM's own router (``vllm-router --vllm-pd-disaggregation``), with agent metadata through a
real etcd when N + M > 2 (each engine publishes; D loads P's ranks by engine name).

    python tools/pd/cluster.py --prefill 2 --decode 2 --mode pull      # start, serve until Ctrl-C
    python tools/pd/cluster.py --prefill 1 --decode 1 --check          # start, 8 requests, stop

Every engine runs ``kv_role`` ``kv_both`` (the router picks which one prefills and which one
decodes, as with vLLM's NixlConnector). The router speaks NIXL's protocol for both kvrail
modes: it sends the prompt to a P with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true}``, then to a D with what P answered. Pull (D READs P's blocks)
and push (P WRITEs into the blocks D registers when the request reaches it) both fit that
sequence: in push, P holds the prompt's KV under its lease until D's registration arrives.
``push_stream`` (P writes blocks while it still prefills) needs D's registration before P's
prefill ends, which a router that calls P and D one after the other never gives; there it
does what push does.

Standard library only, plus the processes it starts: the engines from the vLLM venv
(``python/tests/vllm/run.sh`` makes ``target/vllm-venv``), the router from
``target/router-venv`` (``pip install vllm-router``), etcd from Debian's ``etcd-server``.
Logs in ``--logs`` (``target/pd-cluster``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONNECTORS = {"pull": "KvrailPullConnector", "push": "KvrailPushConnector", "push_stream": "KvrailPushConnector"}
# vLLM's own NixlConnector, unchanged: on the real NIXL 1.5.1 (UCX; from target/vllm-nixl,
# put first on the engine's PYTHONPATH; python/tests/vllm/run.sh installs it there), or on
# kvrail's NIXL compat package (the vLLM venv's own ``nixl``; kvrail's TCP transport)
NIXL_MODES = ("nixl", "nixl-on-kvrail")
NIXL_DIR = os.path.join(ROOT, "target", "vllm-nixl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def post(url: str, body: dict, timeout: float = 300):
    """(status, JSON answer); an HTTP error's body as ``{"error": ...}``."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:2000]}


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.split()[-1])
    return total


class Proc:
    """A child process in its own session, its output in a log file; ``url`` is where it
    answers ``/health`` once up."""

    def __init__(self, cmd: List[str], log_path: str, env: Optional[Dict[str, str]] = None, name: str = "",
                 url: str = ""):
        self.cmd, self.log_path = cmd, log_path
        self.env = env
        self.name, self.url = name or os.path.basename(cmd[0]), url
        self.p: Optional[subprocess.Popen] = None

    def start(self) -> "Proc":
        self.log = open(self.log_path, "a")
        self.p = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                  start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def wait(self, limit: float = 300) -> "Proc":
        """Until ``url/health`` answers; an error naming the log when the process exits first
        or ``limit`` seconds pass."""
        t = time.time()
        while time.time() - t < limit:
            if self.p is not None and not self.alive():
                raise RuntimeError(f"{self.name} exited {self.p.returncode}; see {self.log_path}")
            try:
                get(self.url + "/health")
                return self
            except Exception:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} not up in {limit} s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to the whole process group (vLLM's engine core is a child)."""
        if self.alive():
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


class Etcd(Proc):
    """A real etcd (Debian's ``etcd-server``) on free loopback ports, data in a temp dir."""

    def __init__(self, logs: str):
        exe = shutil.which("etcd") or "/usr/bin/etcd"
        self.dir = tempfile.mkdtemp(prefix="kvrail-pd-etcd-")
        self.port, peer = free_port(), free_port()
        url = f"http://127.0.0.1:{self.port}"
        super().__init__([exe, "--data-dir", self.dir, "--listen-client-urls", url, "--advertise-client-urls",
                          url, "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
                          f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                         os.path.join(logs, "etcd.log"), name="etcd", url=url)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        super().kill(sig)
        shutil.rmtree(self.dir, ignore_errors=True)


class Engine(Proc):
    """One ``vllm serve`` engine (``kv_both``) with kvrail.vllm (``mode`` pull or push) or vLLM's
    NixlConnector (``mode`` in ``NIXL_MODES``)."""

    def __init__(self, python: str, model: str, name: str, mode: str, logs: str, store: Optional[str] = None,
                 extra: Optional[dict] = None, args: Optional[List[str]] = None, port: Optional[int] = None,
                 env_extra: Optional[Dict[str, str]] = None):
        self.port = port or free_port()
        self.metrics_port = free_port()
        # vLLM's CPU worker pins itself to cores it picks alone: engines sharing a small
        # host would starve each other's steps; a deployment gives each its own cores
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
        env.update(env_extra or {})
        ex = dict(extra or {})
        policy = ex.pop("kv_load_failure_policy", "fail")
        if mode in NIXL_MODES:
            kv = nixl_config(name, mode, env)
        else:
            agent = {"listen": "127.0.0.1:0", "metrics_listen": f"127.0.0.1:{self.metrics_port}"}
            ex = {"kvrail_agent_config": agent, **ex}
            if mode == "push_stream":
                ex["push_stream"] = True
            if store:
                ex.update(metadata_store=store, metadata_namespace="kvrail-pd", metadata_lease_ttl_s=3)
            kv = {"kv_connector": CONNECTORS[mode], "kv_connector_module_path": "kvrail.vllm",
                  "kv_connector_extra_config": ex}
        kv.update(kv_role="kv_both", kv_buffer_device="cpu", engine_id=name, kv_load_failure_policy=policy)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "m",
               "--enforce-eager", "--max-model-len", "2048", "--port", str(self.port),
               "--kv-transfer-config", json.dumps(kv)] + list(args or [])
        super().__init__(cmd, os.path.join(logs, f"{name}.log"), env, name, f"http://127.0.0.1:{self.port}")

    def metrics(self) -> str:
        return get(self.url + "/metrics")

    def kvrail_metrics(self) -> str:
        return get(f"http://127.0.0.1:{self.metrics_port}/metrics")


def nixl_config(name: str, mode: str, env: Dict[str, str]) -> dict:
    """vLLM's NixlConnector for one engine; ``env`` gets its handshake port (each engine on a
    host needs its own) and which ``nixl`` it imports."""
    env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
    if mode == "nixl":
        if not os.path.isdir(NIXL_DIR):
            raise RuntimeError(f"no real NIXL at {NIXL_DIR}: run python/tests/vllm/run.sh first")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [amx_site(), NIXL_DIR, env.get("PYTHONPATH")]))
    else:
        env.setdefault("KVRAIL_AGENT_CONFIG", '{"backend": "tcp", "listen": "127.0.0.1:0"}')
    return {"kv_connector": "NixlConnector"}


def amx_site() -> str:
    """A directory whose ``sitecustomize`` asks Linux for AMX tile data in every Python process
    started with it on PYTHONPATH (python/kvrail/_amx.py, loaded by path: nothing else of
    kvrail). vLLM 0.32's CPU attention uses AMX without asking; on an AMX host D's worker then
    dies with SIGILL on its first step over loaded KV, with the real NIXL too (seen: vLLM's
    NixlConnector on NIXL 1.5.1, "Worker proc VllmWorker-0 died unexpectedly"). kvrail's
    modules ask when imported; engines on the real NIXL get the same from here."""
    site = os.path.join(ROOT, "target", "pd-amx-site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import importlib.util as u\n"
                f"s = u.spec_from_file_location('_amx', {os.path.join(ROOT, 'python', 'kvrail', '_amx.py')!r})\n"
                "m = u.module_from_spec(s)\ns.loader.exec_module(m)\nm.request_amx_permission()\n")
    return site


class Router(Proc):
    """vLLM's router in P/D mode in front of the engines."""

    def __init__(self, exe: str, prefill: List[Engine], decode: List[Engine], logs: str, port: Optional[int] = None,
                 timeout_s: int = 120):
        self.port = port or free_port()
        self.prometheus_port = free_port()
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--vllm-pd-disaggregation",
               "--kv-connector", "nixl", "--policy", "round_robin", "--request-timeout-secs", str(timeout_s),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
               "--worker-startup-timeout-secs", "600", "--log-level", "info",
               # a dead engine is out of the rotation within ~2 s (the default checks every 60 s:
               # every request round robin gave a killed P failed until the load ended)
               "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
               "--health-failure-threshold", "1", "--health-success-threshold", "1"]
        for e in prefill:
            cmd += ["--prefill", e.url]
        for e in decode:
            cmd += ["--decode", e.url]
        super().__init__(cmd, os.path.join(logs, "router.log"), name="vllm-router",
                         url=f"http://127.0.0.1:{self.port}")


class Cluster:
    """etcd (when N + M > 2 or asked), N P and M D engines, the router; ``stop()`` ends all.
    ``env``: more environment for the engines (``UCX_TLS`` for NIXL, say)."""

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, mode: str = "pull", model: Optional[str] = None,
                 python: Optional[str] = None, router: Optional[str] = None, logs: Optional[str] = None,
                 etcd: Optional[bool] = None, extra: Optional[dict] = None, args: Optional[List[str]] = None,
                 router_port: Optional[int] = None, env: Optional[Dict[str, str]] = None):
        self.mode, self.env = mode, dict(env or {})
        self.python = python or os.path.join(ROOT, "target", "vllm-venv", "bin", "python")
        self.router_exe = router or os.path.join(ROOT, "target", "router-venv", "bin", "vllm-router")
        self.model = model or os.path.join(ROOT, "target", "vllm-model")
        self.logs = logs or os.path.join(ROOT, "target", "pd-cluster")
        os.makedirs(self.logs, exist_ok=True)
        self.extra, self.args = dict(extra or {}), list(args or [])
        self.etcd = Etcd(self.logs) if (etcd if etcd is not None else n_prefill + n_decode > 2) else None
        self.prefill = [self._engine(f"prefill-{i}") for i in range(n_prefill)]
        self.decode = [self._engine(f"decode-{i}") for i in range(n_decode)]
        self.router: Optional[Router] = None
        self.router_port = router_port

    def _engine(self, name: str, port: Optional[int] = None) -> Engine:
        store = f"etcd://127.0.0.1:{self.etcd.port}" if self.etcd else None
        return Engine(self.python, self.model, name, self.mode, self.logs, store, self.extra, self.args, port,
                      self.env)

    def engines(self) -> List[Engine]:
        return self.prefill + self.decode

    def start(self) -> "Cluster":
        if self.etcd:
            self.etcd.start().wait()
        for e in self.engines():
            e.start()
        for e in self.engines():
            e.wait()
        self.router = Router(self.router_exe, self.prefill, self.decode, self.logs,
                             self.router_port).start().wait()
        return self

    def restart(self, engine: Engine) -> Engine:
        """A killed engine again, under its name and port (the router keeps its URL)."""
        engine.kill()
        fresh = self._engine(engine.name, engine.port)
        group = self.prefill if engine in self.prefill else self.decode
        group[group.index(engine)] = fresh
        fresh.start()
        return fresh

    def complete(self, prompt, max_tokens: int = 8, timeout: float = 300):
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        return post(self.router.url + "/v1/completions", body, timeout)

    def stop(self) -> None:
        for p in ([self.router] if self.router else []) + self.engines() + ([self.etcd] if self.etcd else []):
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=1, help="prefill engines (1)")
    ap.add_argument("--decode", type=int, default=1, help="decode engines (1)")
    ap.add_argument("--mode", choices=sorted(CONNECTORS) + list(NIXL_MODES), default="pull",
                    help="kvrail.vllm pull or push, or vLLM's NixlConnector on NIXL or on kvrail's compat package")
    ap.add_argument("--model", help="model directory (target/vllm-model, made if missing)")
    ap.add_argument("--etcd", action="store_true", help="metadata through etcd even for 1 P + 1 D")
    ap.add_argument("--port", type=int, default=0, help="the router's port (a free one)")
    ap.add_argument("--logs", help="log directory (target/pd-cluster)")
    ap.add_argument("--check", action="store_true", help="send 8 requests through the router and stop")
    a = ap.parse_args()
    c = Cluster(a.prefill, a.decode, a.mode, a.model, logs=a.logs, etcd=True if a.etcd else None,
                router_port=a.port or None)
    # (a model made before the tokenizer was: tiny_model.py adds it and keeps the weights)
    if not os.path.exists(os.path.join(c.model, "tokenizer.json")):
        subprocess.run([c.python, os.path.join(ROOT, "python", "tests", "vllm", "tiny_model.py"), c.model], check=True,
                       stdout=subprocess.DEVNULL)
    try:
        c.start()
        print(f"P/D up ({a.mode}): router {c.router.url}; P {[e.url for e in c.prefill]}; D {[e.url for e in c.decode]}"
              f"{'; etcd ' + c.etcd.url if c.etcd else ''}; logs in {c.logs}", flush=True)
        if a.check:
            bad = 0
            for i in range(8):
                ids = [(k * 37 + i * 101) % 499 + 3 for k in range(40 + 90 * i)]
                status, r = c.complete(ids)
                ok = status == 200
                bad += not ok
                print(f"request {i}: {len(ids)} prompt tokens -> {r['choices'][0]['token_ids'] if ok else r}")
            external = sum(metric(e.metrics(), "vllm:external_prefix_cache_hits_total") for e in c.decode)
            print(f"D's prompt tokens loaded from P (vLLM's metric): {external:.0f}")
            return 1 if bad else 0
        print("serving; Ctrl-C stops", flush=True)
        while all(p.alive() for p in c.engines() + [c.router]):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        c.stop()


if __name__ == "__main__":
    sys.exit(main())
