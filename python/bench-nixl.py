#!/usr/bin/env python3
"""The NIXL-API program's benchmark (tests/nixl_api_program.py --bench) run for the real NIXL
and for kvrail.nixl in one run, interleaved rounds, on TCP loopback (NIXL: UCX with
UCX_TLS=tcp, UCX_NET_DEVICES=lo; kvrail: its TCP backend): WRITE and READ at 64 KiB, 1 MiB
and 8 MiB, 8 in flight. Prints every round, then the medians and kvrail / NIXL.

    python/bench-nixl.py [--rounds 3] [--secs 2] [--nixl-python target/nixl-venv/bin/python]
                         [--kvrail-python target/py/bin/python]

Both venvs come from python/run-tests.sh. ~1 min per round.
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
    env = dict(os.environ)
    if impl == "nixl":
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
    runs = {"nixl": [], "kvrail": []}
    for k in range(a.rounds):
        for impl, py in (("nixl", a.nixl_python), ("kvrail", a.kvrail_python)):
            runs[impl].append(once(py, impl, a.secs))
        line = "  ".join(f"{op} {s >> 10:>4} KiB {runs['kvrail'][-1][(op, s)] / runs['nixl'][-1][(op, s)]:.2f}x"
                         for op, s in sorted(runs["nixl"][-1]))
        print(f"round {k + 1}: kvrail/NIXL {line}", flush=True)
    print(f"\n| op | size | NIXL MB/s | kvrail MB/s | kvrail / NIXL |\n|---|---|---|---|---|")
    worst = None
    for op, s in sorted(runs["nixl"][0], key=lambda k: (k[0] != "WRITE", k[1])):
        n = statistics.median(r[(op, s)] for r in runs["nixl"])
        k = statistics.median(r[(op, s)] for r in runs["kvrail"])
        ratio = k / n
        worst = ratio if worst is None else min(worst, ratio)
        size = f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
        print(f"| {op} | {size} | {n:.0f} | {k:.0f} | {ratio:.2f} |")
    print(f"\nmedians of {a.rounds} interleaved rounds, {a.secs:g} s per case, 8 in flight; lowest ratio {worst:.2f}")


if __name__ == "__main__":
    main()
