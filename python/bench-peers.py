#!/usr/bin/env python3
"""kvrail next to the tools people compare it with, in one run, on TCP loopback, interleaved
rounds, medians: kvrail-perf (the Rust agent, TCP backend, two processes), kvrail.nixl and
the real NIXL running the NIXL-API program's benchmark (UCX with UCX_TLS=tcp), Mooncake's
Transfer Engine (protocol tcp, P2PHANDSHAKE, two processes: tests/mooncake_bench.py) and
iperf3 (one stream, its largest writes: 1 MiB). WRITE and READ at 64 KiB, 1 MiB and 8 MiB, 8 in flight;
then small transfers (4 KiB, 32 in flight) per second. Prints each round, then a table with
the medians and the ratios kvrail / Mooncake, kvrail / iperf3 and kvrail.nixl / NIXL, and the
socket floor at 8 MiB (socket_floor.py: a plain loop, no engine, 8 MiB messages between
distinct buffers: kvrail-perf's 8 of them a side, and one) next to iperf3 and kvrail, and
the small transfers' floor (kvrail-tcp-floor: one thread a side, each burst in one writev,
answered with one write) next to kvrail's rate.

    python/bench-peers.py [--rounds 3] [--secs 2]

Needs the release kvrail-perf (cargo build --release -p kvrail-tools), the venvs of
python/run-tests.sh (target/py, target/nixl-venv) and a Mooncake venv (made here on first
use: target/mooncake-venv, `mooncake-transfer-engine-non-cuda` and numpy from PyPI).
About 1.5 min per round at --secs 1.
"""

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PERF = os.path.join(ROOT, "target", "release", "kvrail-perf")
MC = os.path.join(HERE, "tests", "mooncake_bench.py")
FLOOR = os.path.join(HERE, "socket_floor.py")
SMALL_FLOOR = os.path.join(ROOT, "target", "release", "kvrail-tcp-floor")
SIZES = [64 << 10, 1 << 20, 8 << 20]
DEPTH = 8

_spec = importlib.util.spec_from_file_location("bench_nixl", os.path.join(HERE, "bench-nixl.py"))
bench_nixl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_nixl)


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reap(proc):
    """Wait for a server process to end on its own (30 s), else kill it."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def kvrail_perf(op, size, depth, secs, extra=()):
    """kvrail-perf client against its own server (TCP), `extra` client arguments; (MB/s,
    transfers/s)."""
    port = free_port()
    srv = subprocess.Popen([PERF, "--server", "-p", str(port), "--listen", f"127.0.0.1:{port}",
                            "--transport", "tcp", "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            for _ in range(50):  # the server may not listen yet
                r = subprocess.run([PERF, "127.0.0.1", "-p", str(port), "--transport", "tcp",
                                    "--op", op.lower(), "-s", str(size), "-t", str(depth),
                                    "-D", str(secs), "--quiet", "--out_json_file", f.name, *extra],
                                   capture_output=True, text=True, timeout=600)
                if r.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                sys.exit(f"kvrail-perf {op} {size} failed:\n{r.stdout}\n{r.stderr}")
            res = json.load(open(f.name))["results"]
    finally:
        reap(srv)
    rate = res["MsgRate"] * 1e6
    return rate * size / 1e6, rate


def mooncake(python, op, size, secs):
    t = subprocess.Popen([python, MC, "target", str(size), str(DEPTH)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = t.stdout.readline().split()
        if not line or line[0] != "READY":
            sys.exit(f"mooncake target did not start: {line}")
        out = run([python, MC, "initiator", str(size), str(DEPTH), str(secs), op, f"127.0.0.1:{line[1]}", line[2]])
    finally:
        t.stdin.close()
        t.wait(timeout=60)
    for l in out.splitlines():
        if l.startswith("BENCH "):
            return float(l.split()[3])
    sys.exit(f"mooncake printed no result:\n{out}")


def iperf3_rate(r):
    """MB/s the receiver counted, or None when this try gave no result.

    iperf3 exits 0 with an "error" in its report when the server ends mid-test,
    and a CI run met a report with no receiver sum: such a try counts as failed.
    """
    if r.returncode != 0:
        return None
    try:
        report = json.loads(r.stdout)
        if report.get("error"):
            return None
        return report["end"]["sum_received"]["bits_per_second"] / 8e6
    except (ValueError, KeyError, TypeError):
        return None


def listening(port):
    """Whether something listens on 127.0.0.1:port (read from /proc/net/tcp, no connection made:
    a connection would use up iperf3's one-off server)."""
    want = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(l.split()[1] == want and l.split()[3] == "0A" for l in list(f)[1:])


def iperf3(secs):
    """One iperf3 stream on loopback, MB/s, or None when three tries gave no result.

    Each try starts a one-off server (`-1`), waits until it listens and runs one client: the
    server exits after its first client, so a client retried against it only meets "connection
    refused" (a CI run printed just that, hiding the first try's error). A reference tool that
    fails is reported with what each try printed, and the other peers' figures still count.
    """
    errors = []
    for _ in range(3):
        port = free_port()
        s = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port), "-B", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 10
            while not listening(port) and s.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            r = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-l", "1M",
                                "-t", str(max(1, int(secs))), "-J"], capture_output=True, text=True,
                               timeout=60 + secs)
            rate = iperf3_rate(r)
            why = f"client rc {r.returncode}: {r.stdout.strip()} {r.stderr.strip()}"
        except subprocess.TimeoutExpired:
            rate, why = None, "the client ran past its time limit"
        finally:
            s.kill()
            _, server_err = s.communicate()
        if rate is not None:
            return rate
        errors.append(f"{why}\n  server printed: {server_err.strip() or '(nothing)'}")
    print("iperf3 gave no result in 3 tries:\n" + "\n".join(errors), file=sys.stderr, flush=True)
    return None


def socket_floor(size, slots, secs):
    """A plain socket loop's MB/s moving `size`-byte messages between `slots` distinct buffers a
    side (socket_floor.py, two processes): what one TCP stream gives before any engine."""
    port = free_port()
    rcv = subprocess.Popen([sys.executable, FLOOR, "recv", str(port), str(size), str(slots)],
                           stdout=subprocess.PIPE, text=True)
    try:
        if rcv.stdout.readline().strip() != "LISTEN":
            sys.exit("socket_floor.py recv did not start")
        out = run([sys.executable, FLOOR, "send", str(port), str(size), str(slots), str(secs)])
    finally:
        reap(rcv)
    return float(out.split()[1])


def small_floor(size, depth, secs):
    """Transfers a second of kvrail-tcp-floor (two processes, one thread each, no engine): the
    floor under kvrail-perf's small-transfer rate."""
    port = free_port()
    srv = subprocess.Popen([SMALL_FLOOR, "--server", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "READY":
            sys.exit("kvrail-tcp-floor --server did not start")
        out = run([SMALL_FLOOR, "--client", str(port), str(size), str(depth), str(max(1, round(secs)))])
    finally:
        reap(srv)
    return float(out.split()[0])


def mooncake_python(path):
    py = os.path.join(path, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
        subprocess.run([os.path.join(path, "bin", "pip"), "install", "-q", "--disable-pip-version-check",
                        "mooncake-transfer-engine-non-cuda==0.3.13.post1", "numpy"], check=True)
    return py


def fmt(v, digits=0):
    """A figure, or "n/a" where its tool gave none."""
    return "n/a" if v is None else f"{v:.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--secs", type=float, default=2.0)
    ap.add_argument("--nixl-python", default=os.path.join(ROOT, "target", "nixl-venv", "bin", "python"))
    ap.add_argument("--kvrail-python", default=os.path.join(ROOT, "target", "py", "bin", "python"))
    ap.add_argument("--mooncake-venv", default=os.path.join(ROOT, "target", "mooncake-venv"))
    a = ap.parse_args()
    for tool in (PERF, SMALL_FLOOR):
        if not os.path.exists(tool):
            sys.exit(f"{tool} missing: cargo build --release -p kvrail-tools")
    mc_py = mooncake_python(a.mooncake_venv)
    cases = [(op, s) for op in ("WRITE", "READ") for s in SIZES]
    runs = {k: [] for k in ("kvrail", "kvrail.nixl", "NIXL", "Mooncake", "iperf3", "small", "small_floor",
                            "floor", "floor1", "kv1")}
    for k in range(a.rounds):
        runs["kvrail"].append({c: kvrail_perf(c[0], c[1], DEPTH, a.secs)[0] for c in cases})
        runs["NIXL"].append(bench_nixl.once(a.nixl_python, "nixl", a.secs))
        runs["Mooncake"].append({c: mooncake(mc_py, c[0], c[1], a.secs) for c in cases})
        runs["kvrail.nixl"].append(bench_nixl.once(a.kvrail_python, "kvrail", a.secs))
        runs["iperf3"].append(iperf3(a.secs))
        runs["floor"].append(socket_floor(8 << 20, DEPTH, a.secs))  # kvrail-perf's slots
        runs["floor1"].append(socket_floor(8 << 20, 1, a.secs))
        runs["kv1"].append(kvrail_perf("WRITE", 8 << 20, DEPTH, a.secs, ["--slots", "1"])[0])
        runs["small"].append(kvrail_perf("WRITE", 4096, 32, a.secs)[1])
        runs["small_floor"].append(small_floor(4096, 32, a.secs))
        r = {n: runs[n][-1] for n in ("kvrail", "Mooncake")}
        print(f"round {k + 1}: kvrail/Mooncake " + "  ".join(
            f"{op} {s >> 10} KiB {r['kvrail'][(op, s)] / r['Mooncake'][(op, s)]:.2f}x" for op, s in cases)
            + f"; iperf3 {fmt(runs['iperf3'][-1])} MB/s; socket floor 8 MiB x{DEPTH} {runs['floor'][-1]:.0f}, "
            f"x1 {runs['floor1'][-1]:.0f} MB/s; 4 KiB x32: {runs['small'][-1]:.0f}/s "
            f"(floor {runs['small_floor'][-1]:.0f}/s)", flush=True)
    med = lambda name, c: statistics.median(r[c] for r in runs[name])
    print(f"\nTCP loopback, {DEPTH} in flight, medians of {a.rounds} interleaved round(s), MB/s:\n")
    print("| op | size | kvrail-perf | kvrail.nixl | NIXL (UCX tcp) | Mooncake (tcp) | iperf3 | kvrail / Mooncake | kvrail.nixl / NIXL | kvrail / iperf3 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ips = [v for v in runs["iperf3"] if v is not None]
    ip = statistics.median(ips) if ips else None  # None: iperf3 failed every round (printed above)
    for op, s in cases:
        kv, kn, nx, mc = (med(n, (op, s)) for n in ("kvrail", "kvrail.nixl", "NIXL", "Mooncake"))
        big = s == 8 << 20 and op == "WRITE"
        print(f"| {op} | {s >> 10} KiB | {kv:.0f} | {kn:.0f} | {nx:.0f} | {mc:.0f} | "
              f"{fmt(ip) if big else ''} | {kv / mc:.2f} | {kn / nx:.2f} | {fmt(ip and kv / ip, 2) if big else ''} |")
    fl, fl1 = statistics.median(runs["floor"]), statistics.median(runs["floor1"])
    kv8, kv1 = med("kvrail", ("WRITE", 8 << 20)), statistics.median(runs["kv1"])
    print(f"\nsocket floor at 8 MiB (python/socket_floor.py: a plain loop, no engine, medians): "
          f"{DEPTH} distinct buffers a side as kvrail-perf's slots {fl:.0f} MB/s ({fmt(ip and fl / ip, 2)}x iperf3), "
          f"one buffer a side {fl1:.0f} MB/s ({fmt(ip and fl1 / ip, 2)}x iperf3); "
          f"kvrail-perf WRITE 8 MiB / the floor of its footprint: {kv8 / fl:.2f}; with one buffer a side "
          f"(--slots 1) {kv1:.0f} MB/s, {kv1 / fl1:.2f} of that floor, {fmt(ip and kv1 / ip, 2)}x iperf3")
    sm, sf = statistics.median(runs["small"]), statistics.median(runs["small_floor"])
    print(f"\nsmall transfers (4 KiB WRITE, 32 in flight, kvrail-perf TCP): {sm:.0f} per second (median); "
          f"the floor (kvrail-tcp-floor: one thread a side, no engine) {sf:.0f} per second; kvrail / floor "
          f"{sm / sf:.2f}")


if __name__ == "__main__":
    main()
