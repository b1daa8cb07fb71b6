# tools/lab/bench-lib.sh — helpers the lab benches source (bench-agent.sh, bench.sh): start
# perftest / ucx_perftest / kvrail-perf server-client pairs across the lab's rails and read
# the average bandwidth (MB/s, 2^20 bytes) each prints. Runs inside the lab only.
die() { echo "${BENCH_NAME:-bench}: FAIL: $*" >&2; exit 1; }
[ -n "${LAB_GUEST:-}" ] || die "run me inside the lab: tools/lab/run.sh $0"
PERF=${KVRAIL_PERF:-target/release/kvrail-perf}
need_perf() { [ -x "$PERF" ] || die "$PERF missing: cargo build --release -p kvrail-tools"; }
G=$LAB_GID_INDEX
A=($LAB_A_DEVS); B=($LAB_B_DEVS); BIPS=($LAB_B_IPS)
T=$(mktemp -d /run/bench.XXXXXX)
echo "${BENCH_PORT:-18700}" > "$T/port"

next_port() {   # a fresh TCP port per run (a file, so command substitutions share it)
    local p; p=$(( $(cat "$T/port") + 1 ))
    echo "$p" > "$T/port"
    echo "$p"
}

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

avg_of() {   # the BW average column (4th) of the last perftest-style result line of file $1
    local line; line=$(grep -E '^ *[0-9]+ +[0-9]+ +[0-9.]+' "$1" | tail -n 1)
    set -- $line
    echo "${4:-0}"
}

ok() { awk -v v="$1" 'BEGIN{exit !(v > 0)}'; }

# ib_<op>_bw on rail $2 with size $3, depth $4, iterations $5, output file $6 (server B,
# client A), started in the background; PT_EXTRA: more perftest flags for both ends (`-q 2`)
perftest_start() {
    local op=$1 r=$2 size=$3 depth=$4 n=$5 out=$6 port; port=$(next_port)
    # shellcheck disable=SC2086 # PT_EXTRA is a list of flags
    timeout 300 "ib_${op}_bw" -d "${B[$r]}" -p $port -x "$G" -t "$depth" -F -s "$size" -n "$n" ${PT_EXTRA:-} > "$out.srv" 2>&1 &
    wait_listen $port || die "ib_${op}_bw server did not start"
    # shellcheck disable=SC2086
    timeout 300 "ib_${op}_bw" -d "${A[$r]}" -p $port -x "$G" -t "$depth" -F -s "$size" -n "$n" ${PT_EXTRA:-} "${BIPS[$r]}" > "$out" 2>&1 &
}

perftest_one() {   # op rail size depth iters → MB/s (a failed run is retried once)
    local try v
    for try in 1 2; do
        perftest_start "$@" "$T/pt"
        wait || true
        v=$(avg_of "$T/pt")
        ok "$v" && { echo "$v"; return; }
        echo "ib_$1_bw gave no result (try $try):" >&2; tail -n 3 "$T/pt" "$T/pt.srv" >&2
    done
    die "ib_$1_bw failed twice"
}

perftest_two() {   # op size depth iters → MB/s, both rails at once, summed
    local try a b
    for try in 1 2; do
        perftest_start "$1" 0 "$2" "$3" "$4" "$T/pt0"
        perftest_start "$1" 1 "$2" "$3" "$4" "$T/pt1"
        wait || true
        a=$(avg_of "$T/pt0"); b=$(avg_of "$T/pt1")
        ok "$a" && ok "$b" && { awk -v a="$a" -v b="$b" 'BEGIN{print a+b}'; return; }
        echo "a concurrent ib_$1_bw gave no result (try $try)" >&2
    done
    die "concurrent ib_$1_bw failed twice"
}

# one ucx_perftest run over rc_verbs on rail 0 (server B, client A): test $1, size $2,
# iterations $3, extra args... → its "Final:" line (empty when it gave none); status 1 when
# the server did not start
ucx_final() {
    local t=$1 size=$2 n=$3 port; shift 3
    port=$(next_port)
    UCX_IB_GID_INDEX=$G UCX_RC_TIMEOUT=2s timeout 300 ucx_perftest -t "$t" -x rc_verbs -d "${B[0]}:1" \
        -s "$size" -n "$n" -p "$port" "$@" > "$T/ucx.srv" 2>&1 &
    wait_listen "$port" || { kill %% 2> /dev/null; wait; return 1; }
    UCX_IB_GID_INDEX=$G UCX_RC_TIMEOUT=2s timeout 300 ucx_perftest 127.0.0.1 -p "$port" -t "$t" -x rc_verbs \
        -d "${A[0]}:1" -s "$size" -n "$n" "$@" > "$T/ucx" 2>&1
    wait || true
    grep -E '^Final:' "$T/ucx" | tail -n 1
}

# ucx_perftest (UCT over rc_verbs, zcopy) on rail 0: op (write|read) size iters → MB/s
ucx() {
    local t=put_bw; [ "$1" = read ] && t=get
    local try v line
    for try in 1 2; do
        line=$(ucx_final "$t" "$2" "$3" -D zcopy) || die "ucx_perftest server did not start"
        set -- "$1" "$2" "$3" $line
        v=${10:-0}
        ok "$v" && { echo "$v"; return; }
        echo "ucx_perftest gave no result (try $try):" >&2; tail -n 5 "$T/ucx" "$T/ucx.srv" >&2
    done
    echo 0
}

# Mooncake's Transfer Engine over rdma on rail 0 (target on B's device, initiator on A's;
# python/tests/mooncake_bench.py, 32 in flight — fewer at large sizes, at most 64 MiB of
# buffer a process in this 2 GiB VM — for 3 s): op $1, size $2 → MB/s (2^20), "-" when there
# is no Mooncake venv (python/bench-peers.py makes target/mooncake-venv), 0 when it failed
mooncake() {
    local py=${MOONCAKE_PYTHON:-target/mooncake-venv/bin/python} op=${1^^} size=$2 line v i
    [ -x "$py" ] || { echo "-"; return; }
    local AIPS=($LAB_A_IPS) depth=$(( (64 << 20) / $2 ))
    [ "$depth" -gt 32 ] && depth=32; [ "$depth" -lt 1 ] && depth=1
    MC_PROTOCOL=rdma MC_DEVICE="${B[0]}" MC_HOST="${BIPS[0]}" MC_GID_INDEX=$G PYTHONDONTWRITEBYTECODE=1 \
        MC_TARGET_SECS=110 timeout 120 "$py" python/tests/mooncake_bench.py target "$size" "$depth" > "$T/mc.srv" 2>&1 &
    local spid=$!
    for ((i = 0; i < 600; i++)); do grep -q '^READY' "$T/mc.srv" && break; sleep 0.1; done
    line=$(grep '^READY' "$T/mc.srv")
    set -- $line
    if [ $# -lt 3 ]; then
        echo "mooncake target did not start ($op $size):" >&2; tail -n 5 "$T/mc.srv" >&2
        kill $spid 2> /dev/null; wait $spid 2> /dev/null
        echo 0; return
    fi
    MC_PROTOCOL=rdma MC_DEVICE="${A[0]}" MC_HOST="${AIPS[0]}" MC_GID_INDEX=$G PYTHONDONTWRITEBYTECODE=1 \
        timeout 120 "$py" python/tests/mooncake_bench.py initiator "$size" "$depth" 3 "$op" "${BIPS[0]}:$2" "$3" > "$T/mc" 2>&1
    kill $spid 2> /dev/null; wait $spid 2> /dev/null
    v=$(awk '/^BENCH / {printf "%.2f", $4 * 1e6 / 1048576}' "$T/mc")
    if ok "${v:-0}"; then echo "$v"; else echo "mooncake gave no result ($op $size):" >&2; tail -n 5 "$T/mc" "$T/mc.srv" >&2; echo 0; fi
}

# kvrail-perf server/client: client rails $1, server rails $2, op $3, size $4, depth $5,
# iters $6, extra args... → MB/s; the run must have checked its data
kvrail() {
    local cr=$1 sr=$2 op=$3 size=$4 depth=$5 n=$6 port; shift 6
    need_perf
    port=$(next_port)
    timeout 300 "$PERF" --server --listen 127.0.0.1:$port --transport verbs --rails "$sr" "$@" > "$T/kv.srv" 2>&1 &
    local spid=$!
    wait_listen $port || die "kvrail-perf server did not start"
    timeout 300 "$PERF" --client 127.0.0.1:$port --transport verbs --rails "$cr" --op "$op" \
        -s "$size" -n "$n" -t "$depth" "$@" > "$T/kv" 2> "$T/kv.err" \
        || { cat "$T/kv" "$T/kv.err" "$T/kv.srv" >&2; die "kvrail-perf failed"; }
    wait $spid || { cat "$T/kv.srv" >&2; die "kvrail-perf server failed"; }
    grep -q '^# data check: every byte' "$T/kv" || die "kvrail-perf did not check its data"
    avg_of "$T/kv"
}

# kvrail's verbs layer alone (kvrail-verbs-bw: both queue pairs in one process, no agent) on
# rail 0: op $1, size $2, depth $3, iterations $4 → MB/s; the run must have checked its data
verbs_bw() {
    local bin=${PERF%/*}/kvrail-verbs-bw
    "$bin" --dev-a "${A[0]}" --dev-b "${B[0]}" --op "$1" -s "$2" -t "$3" -n "$4" > "$T/vb" 2> "$T/vb.err" \
        || { cat "$T/vb" "$T/vb.err" >&2; die "kvrail-verbs-bw failed"; }
    grep -q '^# data check' "$T/vb" || die "kvrail-verbs-bw did not check its data"
    avg_of "$T/vb"
}

# 64 B latency on rail 0, t_typical in us (perftest's column): ib_send_lat with $1 iterations
send_lat() {
    local port; port=$(next_port)
    timeout 120 ib_send_lat -d "${B[0]}" -p "$port" -x "$G" -s 64 -n "$1" > "$T/lat.srv" 2>&1 &
    wait_listen "$port" || die "ib_send_lat server did not start"
    timeout 120 ib_send_lat -d "${A[0]}" -p "$port" -x "$G" -s 64 -n "$1" "${BIPS[0]}" > "$T/lat" 2>&1 || true
    wait || true
    grep -E '^ *64 +[0-9]+' "$T/lat" | tail -n 1 | awk '{print $5}'
}

# the same for kvrail-perf --op lat (a notification round trip / 2) server/client on rail 0:
# iterations $1, extra args for both sides...
kvrail_lat() {
    local n=$1 port; shift
    need_perf
    port=$(next_port)
    timeout 300 "$PERF" --server --listen 127.0.0.1:$port --transport verbs --rails "${B[0]}" "$@" > "$T/kl.srv" 2>&1 &
    wait_listen "$port" || die "kvrail-perf server did not start"
    timeout 300 "$PERF" --client 127.0.0.1:$port --transport verbs --rails "${A[0]}" --op lat -s 64 -n "$n" "$@" > "$T/kl" 2>&1 \
        || { cat "$T/kl" "$T/kl.srv" >&2; die "kvrail-perf --op lat failed"; }
    wait || true
    grep -E '^ *64 +[0-9]+' "$T/kl" | tail -n 1 | awk '{print $5}'
}

# 64 B latency of kvrail's verbs layer alone on rail 0 (kvrail-verbs-lat, t_typical in us):
# mode $1 (send: plain SENDs; channel: the notification channel's framing), $2 round trips;
# 0 when it failed. Inline up to 256 B, as ib_send_lat posts its 64 B and as the agent's
# channel does (without it these rows compared non-inline SENDs with perftest's inline ones).
verbs_lat() {
    local bin=${PERF%/*}/kvrail-verbs-lat
    "$bin" --dev-a "${A[0]}" --dev-b "${B[0]}" --mode "$1" --inline 256 -s 64 -n "$2" 2> /dev/null \
        | awk '$1 == 64 {v = $5} END {print v + 0}'
}

# 64 B latency of UCT active messages over rc_verbs on rail 0 (ucx_perftest -t am_lat, the
# median one-way latency in us it prints as "50.0%ile"): iterations $1; 0 when it failed
ucx_lat() {
    local line; line=$(ucx_final am_lat 64 "$1") || { echo 0; return; }
    set -- $line
    echo "${3:-0}"
}

ratio() { awk -v k="$1" -v p="$2" 'BEGIN{ if (p > 0) printf "%.3f", k/p; else print "null" }'; }
