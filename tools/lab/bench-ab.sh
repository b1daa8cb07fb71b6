#!/bin/bash
# tools/lab/bench-ab.sh — runs INSIDE the lab:  tools/lab/run.sh bash tools/lab/bench-ab.sh
# Two builds of kvrail-perf side by side in one boot (an A/B of a change: KVRAIL_PERF_A the
# build before, KVRAIL_PERF_B after), interleaved rounds on rail 0, every byte checked:
# WRITE 64 KiB and 1 MiB and READ 64 KiB with 32 in flight, and the 64 B notification round
# trip / 2. Prints each round and the medians with B/A (bandwidth: above 1 is B faster;
# latency: below 1 is B faster). Timings under TCG are noisy (±30 % between hours): only the
# rounds of one run compare.
#   ROUNDS (5)  BENCH_ITERS (400)  LAT_ITERS (2000)
set -u
BENCH_NAME=bench-ab
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
PA=${KVRAIL_PERF_A:?the build before (KVRAIL_PERF_A)}
PB=${KVRAIL_PERF_B:-target/release/kvrail-perf}
[ -x "$PA" ] && [ -x "$PB" ] || die "need both builds: $PA, $PB"
ROUNDS=${ROUNDS:-5}
N=${BENCH_ITERS:-400}
NL=${LAT_ITERS:-2000}
CASES=("write 65536" "write 1048576" "read 65536" "lat 64")
declare -A VALS
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    # alternate which build goes first in a round
    if ((ROUND % 2)); then ORDER=(A B); else ORDER=(B A); fi
    for c in "${CASES[@]}"; do
        set -- $c
        for arm in "${ORDER[@]}"; do
            if [ "$arm" = A ]; then PERF=$PA; else PERF=$PB; fi
            if [ "$1" = lat ]; then v=$(kvrail_lat "$NL"); else v=$(kvrail "${A[0]}" "${B[0]}" "$1" "$2" 32 "$N"); fi
            VALS["$c|$arm"]+="$v "
            printf '  round %d  %-14s %s %10s\n' "$ROUND" "$c" "$arm" "$v"
        done
    done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END{ if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }
echo "== medians of $ROUNDS rounds (MB/s; lat: us, round trip / 2)"
printf '%-16s %10s %10s %8s\n' case A B B/A
for c in "${CASES[@]}"; do
    a=$(echo "${VALS["$c|A"]}" | median); b=$(echo "${VALS["$c|B"]}" | median)
    printf '%-16s %10s %10s %8s\n' "$c" "$a" "$b" "$(ratio "$b" "$a")"
done
