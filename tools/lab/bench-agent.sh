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
#   ROUNDS (2)  BENCH_ITERS_1M (200)  BENCH_ITERS_256K (600)  BENCH_SIZES ("262144 1048576")
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

ok() { awk -v v="$1" 'BEGIN{exit !(v > 0)}'; }

perftest_one() {   # rail size depth → MB/s (a failed perftest run is retried once)
    local try v
    for try in 1 2; do
        perftest_start "$1" "$2" "$3" "$T/pt"
        wait || true
        v=$(avg_of "$T/pt")
        ok "$v" && { echo "$v"; return; }
        echo "bench-agent: ib_write_bw gave no result (try $try):" >&2; tail -n 3 "$T/pt" "$T/pt.srv" >&2
    done
    die "ib_write_bw failed twice"
}

perftest_two() {   # size depth → MB/s, both rails at once, summed
    local try a b
    for try in 1 2; do
        perftest_start 0 "$1" "$2" "$T/pt0"
        perftest_start 1 "$1" "$2" "$T/pt1"
        wait || true
        a=$(avg_of "$T/pt0"); b=$(avg_of "$T/pt1")
        ok "$a" && ok "$b" && { awk -v a="$a" -v b="$b" 'BEGIN{print a+b}'; return; }
        echo "bench-agent: a concurrent ib_write_bw gave no result (try $try)" >&2
    done
    die "concurrent ib_write_bw failed twice"
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
        p=$(perftest_one 0 "$size" 32); k=$(kvrail "${A[0]}" "${B[0]}" "$size" 32)
        add "one rail, 32 in flight" "$size" "$p" "$k"
        p=$(perftest_one 0 "$size" 1); k=$(kvrail "${A[0]}" "${B[0]}" "$size" 1)
        add "one rail, 1 in flight" "$size" "$p" "$k"
        p=$(perftest_two "$size" 32); k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" "$size" 32 --stripe-width 0)
        add "two rails striped, 32 in flight" "$size" "$p" "$k"
        k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" "$size" 1 --stripe-width 0)
        add "two rails striped, 1 in flight" "$size" "$p" "$k"
        k=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" "$size" 32)
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
