"""The native agent through the package: configuration errors name the key, exceptions
follow the fault groups, Python-owned memory (numpy, bytearray) moves in place byte-exact."""

import json
import time

import numpy as np
import pytest

import kvrail
from kvrail import nixl


def tcp_agent(name, **extra):
    return kvrail.Agent(name, {"backend": "tcp", "listen": "127.0.0.1:0", **extra})


def pattern(seed, n):
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed * 40503)) >> np.uint64(7)).astype(np.uint8)


def test_config_errors_name_the_key():
    for cfg, key in [({"bakend": "tcp"}, "bakend"), ({"backend": "ucx"}, "backend"),
                     ({"listen": "nowhere"}, "listen"), ({"block_size": 0}, "block_size")]:
        with pytest.raises(kvrail.ConfigError) as e:
            kvrail.Agent("x", cfg)
        assert str(e.value).startswith(key + ":"), str(e.value)
    assert issubclass(kvrail.ConfigError, kvrail.MisuseError)
    assert issubclass(kvrail.MisuseError, kvrail.KvrailError)


def test_numpy_and_bytearray_move_in_place_byte_exact():
    p, d = tcp_agent("p"), tcp_agent("d")
    src = pattern(1, 1 << 20)
    dst = bytearray(1 << 20)
    sa, n, kind, _ = kvrail.buffer_span(src)
    da, _, _, _ = kvrail.buffer_span(dst)
    assert (n, kind) == (1 << 20, "DRAM")
    p.register(sa, n)
    d.register(da, n)
    peer = p.load_remote(d.metadata())
    assert peer == "d"
    descs = [(0, 4096), (8192, 100_000), (200_000, 500_000)]
    x = p.create_xfer("WRITE", [(sa + o, l) for o, l in descs], "d",
                      [(da + o, l) for o, l in descs], b"landed")
    p.post(x)
    assert p.wait(x, 60) == "DONE"
    assert d.wait_notifs(30) == [("p", b"landed")]
    got = np.frombuffer(dst, dtype=np.uint8)
    want = np.zeros(1 << 20, dtype=np.uint8)
    for o, l in descs:
        want[o:o + l] = src[o:o + l]
    assert np.array_equal(got, want), "every byte, gaps untouched"
    # READ back into another part of P's memory
    x2 = p.create_xfer("READ", [(sa + 900_000, 4096)], "d", [(da, 4096)])
    src[900_000:904_096] = 0
    p.post(x2)
    assert p.wait(x2, 60) == "DONE"
    assert np.array_equal(src[900_000:904_096], src[:4096])
    # the counters moved with the two transfers (JSON snapshot and Prometheus text)
    m = json.loads(p.metrics_json())
    done = {(x["labels"]["op"]): x["value"] for x in m
            if x["name"] == "kvrail_transfers_total" and x["labels"]["outcome"] == "done"}
    assert done == {"read": 1.0, "write": 1.0}, m
    tcp = {x["labels"]["op"]: x["value"] for x in m if x["name"] == "kvrail_tcp_bytes_total"}
    assert tcp == {"read": 4096.0, "write": float(sum(l for _, l in descs))}, tcp
    text = p.metrics_prometheus()
    assert '# TYPE kvrail_transfers_total counter\n' in text
    assert 'kvrail_transfers_total{agent="p",op="write",outcome="done"} 1\n' in text


def test_errors_by_fault_group():
    p, d = tcp_agent("p2"), tcp_agent("d2")
    buf = np.zeros(8192, dtype=np.uint8)
    a = buf.ctypes.data
    rid = p.register(a, 8192)
    with pytest.raises(kvrail.MemoryRegionError, match="overlaps"):
        p.register(a + 4096, 16)
    with pytest.raises(kvrail.MisuseError, match="addr"):
        p.register(0, 16)
    with pytest.raises(kvrail.MisuseError, match="mem_type"):
        p.register(a, 16, "FILE")
    with pytest.raises(kvrail.MisuseError, match="unknown peer"):
        p.create_xfer("WRITE", [(a, 16)], "nobody", [(a, 16)])
    p.load_remote(d.metadata())
    with pytest.raises(kvrail.MisuseError, match="local: descriptor #0"):
        p.create_xfer("WRITE", [(a + 8190, 16)], "d2", [(a, 16)])
    with pytest.raises(kvrail.MisuseError, match="op"):
        p.create_xfer("SEND", [(a, 16)], "d2", [(a, 16)])
    with pytest.raises(kvrail.PeerConnectionError):
        p.load_remote_addr("127.0.0.1:1")
    p.deregister(rid)
    with pytest.raises(kvrail.MisuseError, match="no registered region"):
        p.deregister(rid)


def test_busy_memory_cannot_be_deregistered():
    p, d = tcp_agent("p3"), tcp_agent("d3")
    src, dst = np.ones(64 << 20, np.uint8), np.zeros(64 << 20, np.uint8)
    rid = p.register(src.ctypes.data, src.nbytes)
    d.register(dst.ctypes.data, dst.nbytes)
    p.load_remote(d.metadata())
    x = p.create_xfer("WRITE", [(src.ctypes.data, src.nbytes)], "d3", [(dst.ctypes.data, dst.nbytes)])
    p.post(x)
    refused = False
    try:
        p.deregister(rid)
    except kvrail.MisuseError as e:
        refused = "active transfer" in str(e)
    assert refused or p.status(x) == "DONE"
    assert p.wait(x, 60) == "DONE"
    assert dst.all()


def test_nixl_memory_objects_and_bad_input():
    a = nixl.nixl_agent("obj", nixl.nixl_agent_config(kvrail_config={"backend": "tcp", "listen": "127.0.0.1:0"}))
    arr, ba = np.zeros(4096, np.uint8), bytearray(4096)
    reg = a.register_memory([arr, ba])
    assert reg.descCount() == 2 and reg.mem_type == "DRAM"
    with pytest.raises(kvrail.MisuseError, match="read-only"):
        a.register_memory(b"bytes are read-only")
    with pytest.raises(kvrail.MisuseError, match="not C-contiguous"):
        a.register_memory(np.zeros((64, 64), np.uint8)[:, ::2])
    with pytest.raises(nixl.nixlNotFoundError):
        a.create_backend("NOPE")
    with pytest.raises(nixl.nixlInvalidParamError, match="mem_type"):
        a.get_xfer_descs([(1, 2, 0)], "FILE")
    a.deregister_memory(reg)
    with pytest.raises(nixl.nixlNotFoundError):
        a.deregister_memory(reg)
    with pytest.raises(kvrail.ConfigError, match="bogus"):
        nixl.nixl_agent("bad", nixl.nixl_agent_config(kvrail_config={"bogus": 1}))


def test_stubs_name_every_native_method():
    import os
    import re

    stub = open(os.path.join(os.path.dirname(kvrail.__file__), "_kvrail.pyi")).read()
    for cls in (kvrail._kvrail.Agent, kvrail._kvrail.Scheduler, kvrail._kvrail.Worker):
        for name in dir(cls):
            if not name.startswith("_"):
                assert re.search(rf"def {name}\(", stub), f"{cls.__name__}.{name} is missing from _kvrail.pyi"
    for exc in ("KvrailError", "MisuseError", "ConfigError", "PeerError", "PeerConnectionError",
                "RdmaError", "MemoryRegionError", "UnavailableError", "DeadlineError"):
        assert f"class {exc}(" in stub


def test_imports_and_runs_on_tcp_where_libibverbs_is_absent():
    """A private mount namespace with every libibverbs.so* bind-mounted over by an empty file
    (dlopen fails as on a host without rdma-core): the package imports and its agent comes up
    on TCP (backend "auto")."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = (
        "import ctypes, kvrail, kvrail.nixl, kvrail.vllm\n"
        "try:\n    ctypes.CDLL('libibverbs.so.1'); print('libibverbs still loadable')\n"
        "except OSError:\n    print('libibverbs hidden')\n"
        "print('backend', kvrail.Agent('x', {'listen': '127.0.0.1:0'}).backend)\n"
    )
    script = (
        "set -e; for f in $(ls /usr/lib/*/libibverbs.so* /lib/*/libibverbs.so* 2>/dev/null); do "
        'mount --bind /dev/null "$f"; done; exec "$0" -c "$1"'
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable, probe],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    if r.returncode != 0 and ("unshare failed" in out or "Operation not permitted" in out):
        pytest.skip(f"cannot make a mount namespace here: {out}")
    assert r.returncode == 0, out
    assert "libibverbs hidden" in out and "backend tcp" in out, out


def test_nixl_listen_thread_and_fetch_remote_metadata():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    tcp = {"backend": "tcp", "side_channel_host": "127.0.0.1"}
    target = nixl.nixl_agent("listener", nixl.nixl_agent_config(enable_listen_thread=True, listen_port=port, kvrail_config=tcp))
    other = nixl.nixl_agent("fetcher", nixl.nixl_agent_config(kvrail_config=dict(tcp, listen="127.0.0.1:0")))
    assert not other.check_remote_metadata("listener")
    other.fetch_remote_metadata("listener", "127.0.0.1", port)
    assert other.check_remote_metadata(b"listener")
    buf = np.zeros(4096, np.uint8)
    target.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    other.send_notif("listener", b"hello")
    t0 = time.time()
    got = {}
    while not got and time.time() - t0 < 10:
        got = target.get_new_notifs()
    assert got == {"fetcher": [b"hello"]}
    # the listener takes the metadata sent to it, as NIXL's listener thread does
    assert not target.check_remote_metadata("fetcher")
    other.send_local_metadata("127.0.0.1", port)
    assert target.check_remote_metadata("fetcher")
    other.remove_remote_agent("listener")
    assert not other.check_remote_metadata("listener")
    other.remove_remote_agent("listener")  # unknown now: ignored, as NIXL does


def test_kvrail_logs_reach_python_logging():
    import logging

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.levelno, record.getMessage()))

    h = Catch()
    log = logging.getLogger("kvrail")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    kvrail.set_log_level()
    try:
        a = tcp_agent("logged")
        t0 = time.time()
        while not any("backend" in m for _, _, m in seen) and time.time() - t0 < 10:
            time.sleep(0.01)
        assert any(n.startswith("kvrail.agent") and lvl == logging.INFO and "tcp" in m for n, lvl, m in seen), seen
        # below the level: not made at all
        seen.clear()
        log.setLevel(logging.ERROR)
        kvrail.set_log_level()
        b = tcp_agent("quiet")
        a.load_remote(b.metadata())
        time.sleep(0.3)
        assert not any(lvl < logging.ERROR for _, lvl, _ in seen), seen
    finally:
        log.removeHandler(h)
        log.setLevel(logging.NOTSET)
        kvrail.set_log_level(logging.WARNING)


def test_exit_with_live_agents_logging_does_not_abort():
    """A program that exits with agents alive and DEBUG logging on: the agents log as they
    are dropped, which woke the package's log-draining thread while the interpreter
    finalized, and Python ending that thread mid-call aborted the process ("FATAL: exception
    not rethrown", 6 of 10 exits). Five exits, each must end with status 0."""
    import subprocess
    import sys

    program = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        "import kvrail\n"
        "kvrail.set_log_level(logging.DEBUG)\n"
        "agents = []\n"
        "for i in range(4):\n"
        "    p = kvrail.Agent(f'p{i}', {'backend': 'tcp', 'listen': '127.0.0.1:0'})\n"
        "    d = kvrail.Agent(f'd{i}', {'backend': 'tcp', 'listen': '127.0.0.1:0'})\n"
        "    p.load_remote(d.metadata())\n"
        "    agents += [p, d]\n"
        "print('exiting', flush=True)\n"
    )
    for i in range(5):
        o = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
        assert o.returncode == 0 and "exiting" in o.stdout, (i, o.returncode, o.stderr[-2000:])
        assert "FATAL" not in o.stderr, (i, o.stderr[-2000:])


@pytest.fixture
def etcd(tmp_path):
    """A real etcd (Debian's etcd-server) on free loopback ports: its etcd://HOST:PORT."""
    import os
    import shutil
    import socket
    import subprocess
    import urllib.request

    exe = shutil.which("etcd") or "/usr/bin/etcd"
    assert os.path.exists(exe), "no etcd: apt-get install etcd-server (tools/lab/setup.sh does)"

    def free():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    c, p = free(), free()
    proc = subprocess.Popen(
        [exe, "--name", "py", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
         "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
         "--initial-cluster", f"py=http://127.0.0.1:{p}", "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t = time.time()
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{c}/v3/kv/range", data=b'{"key":"AA=="}', method="POST")
                urllib.request.urlopen(req, timeout=1).read()
                break
            except OSError:
                assert time.time() - t < 30, "etcd did not come up"
                time.sleep(0.05)
        yield f"etcd://127.0.0.1:{c}"
    finally:
        proc.kill()
        proc.wait()


def test_metadata_store_load_by_name_and_nixl_etcd_env(etcd, monkeypatch):
    """Agents publish through etcd; a peer is loaded by name (the package's API, and NIXL's
    fetch_remote_metadata without an address under NIXL_ETCD_ENDPOINTS), bytes move."""
    store = {"metadata_store": etcd, "metadata_namespace": "py-test"}
    p, d = tcp_agent("p-store", **store), tcp_agent("d-store", **store)
    assert p.store_up() is True and tcp_agent("plain").store_up() is None
    src = pattern(3, 1 << 16)
    sa, n, _, _ = kvrail.buffer_span(src)
    p.register(sa, n)
    assert d.load_by_name("p-store") == "p-store"
    dst = bytearray(n)
    da, _, _, _ = kvrail.buffer_span(dst)
    d.register(da, n)
    x = d.create_xfer("READ", [(da, n)], "p-store", [(sa, n)])
    d.post(x)
    assert d.wait(x, 60) == "DONE"
    assert np.array_equal(np.frombuffer(dst, dtype=np.uint8), src)
    with pytest.raises(kvrail.MisuseError) as e:
        d.load_by_name("nobody")
    assert "nobody" in str(e.value)
    # NIXL's own etcd settings configure the store of a kvrail.nixl agent
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "http://" + etcd.split("://", 1)[1])
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", "/py-test/")
    a = nixl.nixl_agent("nixl-d", nixl.nixl_agent_config(kvrail_config={"backend": "tcp", "listen": "127.0.0.1:0"}))
    a.send_local_metadata()  # published already: nothing to do
    a.fetch_remote_metadata("p-store")
    assert a.check_remote_metadata("p-store")
    with pytest.raises(nixl.nixlNotFoundError):
        a.fetch_remote_metadata("nobody")
