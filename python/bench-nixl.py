#!/usr/bin/env python3
"""The NIXL-API program's benchmark (tests/nixl_api_program.py --bench) run for the real NIXL
and for kvrail.nixl in one run, interleaved rounds, two processes on one host: NIXL twice, as
users run it (UCX's defaults: shared memory or cross-memory attach between two processes of
one host) and held to TCP (UCX_TLS=tcp, UCX_NET_DEVICES=lo, labelled so); kvrail.nixl on its
TCP backend. WRITE and READ at 64 KiB, 1 MiB and 8 MiB, 8 in flight. Prints every round,
then the medians and kvrail / NIXL against each.

    python/bench-nixl.py [--rounds 3] [--secs 2] [--nixl-python target/nixl-venv/bin/python]
                         [--kvrail-python target/py/bin/python]

Both venvs come from python/run-tests.sh. ~1.5 min per round.
"""

import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAM = os.path.join(HERE, "tests", "nixl_api_program.py")


def once(python, impl, secs):
    """One run: ``impl`` "nixl" (UCX held to TCP on lo), "nixl-defaults" (UCX as it comes)
    or "kvrail" (TCP)."""
    env = dict(os.environ)
    if impl == "nixl-defaults":
        impl = "nixl"
        for k in ("UCX_TLS", "UCX_NET_DEVICES"):
            env.pop(k, None)
    elif impl == "nixl":
        env.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    else:
        env["KVRAIL_AGENT_CONFIG"] = '{"backend": "tcp", "listen": "127.0.0.1:0"}'
    r = subprocess.run([python, PROGRAM, "--impl", impl, "--bench", "--secs", str(secs)],
                       env=env, capture_output=True, text=True, timeout=600)
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("BENCH "):
            _, _, op, size, mbs = line.split()
            out[(op, int(size))] = float(mbs)
    if r.returncode != 0 or not out:
        sys.exit(f"{impl} bench failed:\n{r.stdout}\n{r.stderr}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--secs", type=float, default=2.0)
    ap.add_argument("--nixl-python", default=os.path.join(ROOT, "target", "nixl-venv", "bin", "python"))
    ap.add_argument("--kvrail-python", default=os.path.join(ROOT, "target", "py", "bin", "python"))
    a = ap.parse_args()
    impls = (("nixl-defaults", a.nixl_python), ("nixl", a.nixl_python), ("kvrail", a.kvrail_python))
    runs = {impl: [] for impl, _ in impls}
    for k in range(a.rounds):
        for impl, py in impls:
            runs[impl].append(once(py, impl, a.secs))
        line = "  ".join(f"{op} {s >> 10:>4} KiB {runs['kvrail'][-1][(op, s)] / runs['nixl-defaults'][-1][(op, s)]:.2f}x"
                         f" ({runs['kvrail'][-1][(op, s)] / runs['nixl'][-1][(op, s)]:.2f}x tcp)"
                         for op, s in sorted(runs["nixl"][-1]))
        print(f"round {k + 1}: kvrail/NIXL (UCX defaults; UCX_TLS=tcp) {line}", flush=True)
    print("\n| op | size | NIXL, UCX defaults, MB/s | NIXL, UCX_TLS=tcp, MB/s | kvrail (TCP) MB/s "
          "| kvrail / NIXL defaults | kvrail / NIXL tcp |\n|---|---|---|---|---|---|---|")
    worst = {"nixl-defaults": None, "nixl": None}
    for op, s in sorted(runs["nixl"][0], key=lambda k: (k[0] != "WRITE", k[1])):
        med = {impl: statistics.median(r[(op, s)] for r in runs[impl]) for impl in runs}
        ratios = {impl: med["kvrail"] / med[impl] for impl in worst}
        for impl, r in ratios.items():
            worst[impl] = r if worst[impl] is None else min(worst[impl], r)
        size = f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
        print(f"| {op} | {size} | {med['nixl-defaults']:.0f} | {med['nixl']:.0f} | {med['kvrail']:.0f} "
              f"| {ratios['nixl-defaults']:.2f} | {ratios['nixl']:.2f} |")
    print(f"\nmedians of {a.rounds} interleaved rounds, {a.secs:g} s per case, 8 in flight; lowest ratio "
          f"{worst['nixl-defaults']:.2f} against NIXL with UCX's defaults, {worst['nixl']:.2f} against it held to TCP")


if __name__ == "__main__":
    main()
