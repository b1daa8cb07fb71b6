#!/bin/bash
# tools/lab/bench-smoke.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench-smoke.sh
# kvrail's verbs layer (kvrail-verbs-bw) next to perftest (ib_write_bw / ib_read_bw) on the
# same rail, same size and queue depth, interleaved ROUNDS times in one VM boot; prints
# every run and the ratio of the averages. Timings under TCG are noisy: compare only runs
# made here, together.
#   BENCH_SIZE (1048576)  BENCH_ITERS (200)  BENCH_DEPTH (32)  BENCH_RAIL (0)  ROUNDS (2)
#   KVRAIL_BW (target/release/kvrail-verbs-bw)
set -u
BENCH_NAME=bench-smoke
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
SIZE=${BENCH_SIZE:-1048576}; ITERS=${BENCH_ITERS:-200}; DEPTH=${BENCH_DEPTH:-32}
R=${BENCH_RAIL:-0}; ROUNDS=${ROUNDS:-2}
BW=${KVRAIL_BW:-target/release/kvrail-verbs-bw}
[ -x "$BW" ] || die "$BW missing: cargo build --release -p kvrail-tools"

# perftest TOOL: server on host B, client on host A; prints the average MB/s
perftest() {
    local tool=$1
    local PORT; PORT=$(next_port)
    timeout 300 "$tool" -d "${B[$R]}" -p $PORT -x "$G" -u 20 -t "$DEPTH" -F -s "$SIZE" -n "$ITERS" > "$T/srv" 2>&1 &
    local spid=$!
    wait_listen $PORT || { kill $spid; die "$tool server did not start"; }
    timeout 300 "$tool" -d "${A[$R]}" -p $PORT -x "$G" -u 20 -t "$DEPTH" -F -s "$SIZE" -n "$ITERS" "${BIPS[$R]}" > "$T/cli" 2>&1 \
        || { cat "$T/cli" "$T/srv" >&2; die "$tool failed"; }
    wait $spid
    avg_of "$T/cli"
}

kvrail() {
    "$BW" --rail "$R" --op "$1" -s "$SIZE" -n "$ITERS" -t "$DEPTH" > "$T/kv" 2> "$T/kv.err" \
        || { cat "$T/kv" "$T/kv.err" >&2; die "kvrail-verbs-bw --op $1 failed"; }
    grep -q '^# data check' "$T/kv" || die "kvrail-verbs-bw did not check its data"
    avg_of "$T/kv"
}

# (kvrail here is the verbs layer's tool, not kvrail-perf: it replaces bench-lib's kvrail)

echo "== rail $R (${A[$R]} -> ${B[$R]}), ${SIZE} B x ${ITERS}, depth $DEPTH, ${ROUNDS} interleaved rounds"
for op in write read; do
    p_sum=0; k_sum=0
    for ((i = 1; i <= ROUNDS; i++)); do
        p=$(perftest "ib_${op}_bw") || exit 1
        k=$(kvrail "$op") || exit 1
        printf 'round %d  %-5s  ib_%s_bw %8s MB/s   kvrail-verbs-bw %8s MB/s\n' "$i" "$op" "$op" "$p" "$k"
        p_sum=$(awk -v a="$p_sum" -v b="$p" 'BEGIN{print a+b}')
        k_sum=$(awk -v a="$k_sum" -v b="$k" 'BEGIN{print a+b}')
    done
    awk -v p="$p_sum" -v k="$k_sum" -v n="$ROUNDS" -v op="$op" \
        'BEGIN{printf "RESULT %-5s  ib_%s_bw avg %.2f MB/s  kvrail avg %.2f MB/s  ratio %.3f\n", op, op, p/n, k/n, (p>0)?k/p:0}'
done
