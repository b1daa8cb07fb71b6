#!/bin/bash
# tools/lab/bench-spin.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench-spin.sh
# Adaptive progress (`progress_spin_us`, kvrail-perf --spin-us) against sleeping, next to
# perftest, interleaved in one VM boot on rail 0: the 64 B notification round trip / 2
# (t_typical) vs ib_send_lat, and 64 KiB WRITE with one transfer in flight vs
# ib_write_bw -t 1. Prints one line per round. Timings under TCG are noisy: compare only
# these runs. ~3 min.
#   ROUNDS (3)  SPIN_US (2000)  KVRAIL_PERF (target/release/kvrail-perf)
set -u
BENCH_NAME=bench-spin
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
need_perf
ROUNDS=${ROUNDS:-3}
SPIN=${SPIN_US:-2000}
# kvrail-perf server/client on rail 0 with spin $1: op $2, size $3, depth $4 → the column
# perftest reports (t_typical for lat, BW average otherwise)
kv() {
    local port; port=$(next_port)
    timeout 300 "$PERF" --transport verbs -d "${B[0]}" -p "$port" --spin-us "$1" > "$T/s.out" 2>&1 &
    local spid=$!
    wait_listen "$port" || die "kvrail-perf server did not start"
    timeout 300 "$PERF" --transport verbs -d "${A[0]}" -p "$port" --spin-us "$1" --op "$2" \
        -s "$3" -t "$4" -n 2000 127.0.0.1 > "$T/c.out" 2>&1 || { cat "$T/c.out" >&2; die "kvrail-perf failed"; }
    wait $spid
    if [ "$2" = lat ]; then grep -E "^ +$3 " "$T/c.out" | awk '{print $5}'; else avg_of "$T/c.out"; fi
}
pt() {  # perftest tool $1, size $2, extra args → the same column
    local port; port=$(next_port)
    timeout 120 "$1" -d "${B[0]}" -x "$LAB_GID_INDEX" -p "$port" -s "$2" -n 2000 "${@:3}" > "$T/p.s" 2>&1 &
    wait_listen "$port" || die "$1 server did not start"
    timeout 120 "$1" -d "${A[0]}" -x "$LAB_GID_INDEX" -p "$port" -s "$2" -n 2000 "${@:3}" 127.0.0.1 > "$T/p.c" 2>&1
    wait
    if [ "$1" = ib_send_lat ]; then grep -E "^ +$2 " "$T/p.c" | awk '{print $5}'; else avg_of "$T/p.c"; fi
}
echo "== adaptive progress: spin 0 vs $SPIN us, rail 0; $ROUNDS interleaved rounds"
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    pl=$(pt ib_send_lat 64); pb=$(pt ib_write_bw 65536 -t 1)
    l0=$(kv 0 lat 64 1); l1=$(kv "$SPIN" lat 64 1)
    b0=$(kv 0 write 65536 1); b1=$(kv "$SPIN" write 65536 1)
    printf '  round %d  64 B t_typical us: ib_send_lat %s, kvrail sleep %s, spin %s | 64 KiB -t 1 MiB/s: ib_write_bw %s, kvrail sleep %s, spin %s\n' \
        "$ROUND" "$pl" "$l0" "$l1" "$pb" "$b0" "$b1"
done
