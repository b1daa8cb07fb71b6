#!/bin/bash
# tools/lab/bench-agent.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench-agent.sh
# kvrail's agent (kvrail-perf --server / --client, two processes, the public API an engine
# uses) next to ib_write_bw on the same rails, interleaved in one VM boot:
#   one rail  — sizes 256 KiB and 1 MiB, many transfers in flight (-t 32) and one (-t 1);
#   two rails — ib_write_bw on both rails at once (sum) vs kvrail striped (--stripe-width 0)
#               with -t 32 and -t 1, and one rail per transfer (stripe unset) with -t 32.
# Prints one table of MB/s and ratios and writes it as JSON to $BENCH_JSON
# (default target/bench-agent.json). Timings under TCG are noisy: compare only runs made
# here, together.
#   BENCH_ITERS_1M (200)  BENCH_ITERS_256K (600)  BENCH_SIZES ("262144 1048576")
#   KVRAIL_PERF (target/release/kvrail-perf)
set -u
die() { echo "bench-agent: FAIL: $*" >&2; exit 1; }
[ -n "${LAB_GUEST:-}" ] || die "run me inside the lab: tools/lab/run.sh $0"
PERF=${KVRAIL_PERF:-target/release/kvrail-perf}
[ -x "$PERF" ] || die "$PERF missing: cargo build --release -p kvrail-tools"
SIZES=${BENCH_SIZES:-"262144 1048576"}
JSON=${BENCH_JSON:-target/bench-agent.json}
G=$LAB_GID_INDEX
A=($LAB_A_DEVS); B=($LAB_B_DEVS); BIPS=($LAB_B_IPS)
T=$(mktemp -d /run/bench.XXXXXX)
PORT=18700

iters() { if [ "$1" -ge 1048576 ]; then echo "${BENCH_ITERS_1M:-200}"; else echo "${BENCH_ITERS_256K:-600}"; fi; }

wait_listen() {   # until something listens on TCP port $1
    local want i sl local rest
    printf -v want ':%04X' "$1"
    for ((i = 0; i < 300; i++)); do
        while read -r sl local rest; do
            [[ $local == *"$want" && $rest == *" 0A "* ]] && return 0
        done < /proc/net/tcp
        sleep 0.1
    done
    return 1
}

avg_of() {   # the BW average column of the last result line of file $1
    local line; line=$(grep -E '^ *[0-9]+ +[0-9]+ +[0-9.]+' "$1" | tail -n 1)
    set -- $line
    echo "${4:-0}"
}

# ib_write_bw on rail $1 with size $2, depth $3, output file $4 (server B, client A)
perftest_start() {
    local r=$1 size=$2 depth=$3 out=$4 port=$((PORT += 1))
    timeout 300 ib_write_bw -d "${B[$r]}" -p $port -x "$G" -t "$depth" -F -s "$size" -n "$(iters "$size")" > "$out.srv" 2>&1 &
    wait_listen $port || die "ib_write_bw server did not start"
    timeout 300 ib_write_bw -d "${A[$r]}" -p $port -x "$G" -t "$depth" -F -s "$size" -n "$(iters "$size")" "${BIPS[$r]}" > "$out" 2>&1 &
}

perftest_one() {   # rail size depth → MB/s
    perftest_start "$1" "$2" "$3" "$T/pt"
    wait || true
    avg_of "$T/pt"
}

perftest_two() {   # size depth → MB/s, both rails at once, summed
    perftest_start 0 "$1" "$2" "$T/pt0"
    perftest_start 1 "$1" "$2" "$T/pt1"
    wait || true
    awk -v a="$(avg_of "$T/pt0")" -v b="$(avg_of "$T/pt1")" 'BEGIN{print a+b}'
}

# kvrail-perf: client rails $1, server rails $2, size $3, depth $4, extra args... → MB/s
kvrail() {
    local cr=$1 sr=$2 size=$3 depth=$4; shift 4
    local port=$((PORT += 1))
    timeout 300 "$PERF" --server --listen 127.0.0.1:$port --transport verbs --rails "$sr" "$@" > "$T/kv.srv" 2>&1 &
    local spid=$!
    wait_listen $port || die "kvrail-perf server did not start"
    timeout 300 "$PERF" --client 127.0.0.1:$port --transport verbs --rails "$cr" -o write \
        -s "$size" -n "$(iters "$size")" -t "$depth" "$@" > "$T/kv" 2> "$T/kv.err" \
        || { cat "$T/kv" "$T/kv.err" "$T/kv.srv" >&2; die "kvrail-perf failed"; }
    wait $spid || { cat "$T/kv.srv" >&2; die "kvrail-perf server failed"; }
    grep -q '^# data check: every byte' "$T/kv" || die "kvrail-perf did not check its data"
    avg_of "$T/kv"
}

ratio() { awk -v k="$1" -v p="$2" 'BEGIN{ if (p > 0) printf "%.3f", k/p; else print "n/a" }'; }

ROWS=()
row() {   # label size perftest kvrail
    local r; r=$(ratio "$4" "$3")
    printf '%-44s %8s  %10s  %10s  %6s\n' "$1" "$2" "$3" "$4" "$r"
    ROWS+=("{\"case\":\"$1\",\"bytes\":$2,\"perftest_mbps\":$3,\"kvrail_mbps\":$4,\"ratio\":\"$r\"}")
}

echo "== kvrail-perf (agent API, 2 processes) vs ib_write_bw; WRITE; MB/s as perftest prints it"
printf '%-44s %8s  %10s  %10s  %6s\n' "case" "bytes" "perftest" "kvrail" "ratio"
for size in $SIZES; do
    p=$(perftest_one 0 "$size" 32); k=$(kvrail "${A[0]}" "${B[0]}" "$size" 32)
    row "one rail, 32 in flight" "$size" "$p" "$k"
    p=$(perftest_one 0 "$size" 1); k=$(kvrail "${A[0]}" "${B[0]}" "$size" 1)
    row "one rail, 1 in flight" "$size" "$p" "$k"
    p=$(perftest_two "$size" 32); k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" "$size" 32 --stripe-width 0)
    row "two rails striped, 32 in flight" "$size" "$p" "$k"
    k1=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" "$size" 1 --stripe-width 0)
    row "two rails striped, 1 in flight" "$size" "$p" "$k1"
    k2=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" "$size" 32)
    row "two rails, one rail per transfer, 32 in flight" "$size" "$p" "$k2"
done
mkdir -p "$(dirname "$JSON")"
( IFS=,; echo "{\"tool\":\"bench-agent\",\"op\":\"write\",\"rows\":[${ROWS[*]}]}" ) > "$JSON"
echo "# table written to $JSON (two-rail rows compare with two ib_write_bw running at once, summed)"
