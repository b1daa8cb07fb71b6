#!/bin/bash
# tools/lab/bench-agent.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench-agent.sh
# kvrail's agent (kvrail-perf --server / --client, two processes, the public API an engine
# uses; its completions polled by the waiting thread, kvrail-perf's default, as perftest
# polls) next to ib_write_bw on the same rails, interleaved in one VM boot:
#   one rail  — sizes 256 KiB and 1 MiB, many transfers in flight (-t 32) and one (-t 1);
#   two rails — ib_write_bw on both rails at once (sum) vs kvrail striped (--stripe-width 0)
#               with -t 32 and -t 1, and one rail per transfer (stripe unset) with -t 32.
# Prints one table of MB/s and ratios and writes it as JSON to $BENCH_JSON
# (default target/bench-agent.json). Timings under TCG are noisy: compare only runs made
# here, together.
#   ROUNDS (2)  BENCH_ITERS_1M (200)  BENCH_ITERS_256K (600)  BENCH_SIZES ("262144 1048576")
#   KVRAIL_PERF (target/release/kvrail-perf)
set -u
BENCH_NAME=bench-agent
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
need_perf
SIZES=${BENCH_SIZES:-"262144 1048576"}
JSON=${BENCH_JSON:-target/bench-agent.json}
iters() { if [ "$1" -ge 1048576 ]; then echo "${BENCH_ITERS_1M:-200}"; else echo "${BENCH_ITERS_256K:-600}"; fi; }

declare -A PSUM KSUM
KEYS=()
add() {   # label size perftest kvrail — accumulate one round
    local key="$1|$2"
    [ -n "${PSUM[$key]+x}" ] || { KEYS+=("$key"); PSUM[$key]=0; KSUM[$key]=0; }
    PSUM[$key]=$(awk -v a="${PSUM[$key]}" -v b="$3" 'BEGIN{print a+b}')
    KSUM[$key]=$(awk -v a="${KSUM[$key]}" -v b="$4" 'BEGIN{print a+b}')
    printf '  round %d  %-46s %8s  perftest %8s  kvrail %8s\n' "$ROUND" "$1" "$2" "$3" "$4"
}

ROUNDS=${ROUNDS:-2}
echo "== kvrail-perf (agent API, 2 processes) vs ib_write_bw; WRITE; MB/s as perftest prints it; $ROUNDS interleaved rounds"
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    for size in $SIZES; do
        n=$(iters "$size")
        p=$(perftest_one write 0 "$size" 32 "$n"); k=$(kvrail "${A[0]}" "${B[0]}" write "$size" 32 "$n")
        add "one rail, 32 in flight" "$size" "$p" "$k"
        p=$(perftest_one write 0 "$size" 1 "$n"); k=$(kvrail "${A[0]}" "${B[0]}" write "$size" 1 "$n")
        add "one rail, 1 in flight" "$size" "$p" "$k"
        p=$(perftest_two write "$size" 32 "$n")
        k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" write "$size" 32 "$n" --stripe-width 0)
        add "two rails striped, 32 in flight" "$size" "$p" "$k"
        k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" write "$size" 1 "$n" --stripe-width 0)
        add "two rails striped, 1 in flight" "$size" "$p" "$k"
        k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" write "$size" 32 "$n")
        add "two rails, one rail per transfer, 32 in flight" "$size" "$p" "$k"
    done
done

echo
printf '%-46s %8s  %10s  %10s  %6s\n' "case (averages of $ROUNDS rounds)" "bytes" "perftest" "kvrail" "ratio"
ROWS=()
for key in "${KEYS[@]}"; do
    label=${key%|*}; size=${key#*|}
    p=$(awk -v s="${PSUM[$key]}" -v n="$ROUNDS" 'BEGIN{printf "%.2f", s/n}')
    k=$(awk -v s="${KSUM[$key]}" -v n="$ROUNDS" 'BEGIN{printf "%.2f", s/n}')
    r=$(ratio "$k" "$p")
    printf '%-46s %8s  %10s  %10s  %6s\n' "$label" "$size" "$p" "$k" "$r"
    ROWS+=("{\"case\":\"$label\",\"bytes\":$size,\"perftest_mbps\":$p,\"kvrail_mbps\":$k,\"ratio\":$r}")
done
mkdir -p "$(dirname "$JSON")"
( IFS=,; echo "{\"tool\":\"bench-agent\",\"op\":\"write\",\"rounds\":$ROUNDS,\"rows\":[${ROWS[*]}]}" ) > "$JSON"
echo "# written to $JSON. Two-rail rows compare with two ib_write_bw running at once (summed);"
echo "# the '1 in flight' rows compare with ib_write_bw -t 1."
