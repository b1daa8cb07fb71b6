#!/bin/bash
# tools/lab/callgrind-agent.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/callgrind-agent.sh
# Instructions the agent spends per transfer and per notification round trip on verbs,
# counted by valgrind's callgrind (stable where the lab's timings move ±30 %): kvrail-perf
# --server / --client on rail 0, the client under callgrind, each case run twice with a
# different count so that the difference leaves set-up and tear-down out.
#   bw   64 KiB WRITE, 32 in flight, --spin-us 2000: per transfer, the client process in all
#        (its progress thread included) and Agent::post inclusive
#   lat  64 B notification round trips, --spin-us 200000 (the client, slowed down by
#        valgrind, never runs out of budget and sleeps): per round trip, the latency loop
#        and Agent::send_notif inclusive (the waiting side's count includes whatever polling
#        the wait did, which depends on timing: compare the send side's for code changes)
# Prints one line per figure. ~3 min. KVRAIL_PERF (target/release/kvrail-perf) picks the build.
set -u
BENCH_NAME=callgrind-agent
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
need_perf
command -v valgrind > /dev/null || die "valgrind missing (tools/lab/setup.sh installs it)"
command -v callgrind_annotate > /dev/null || die "callgrind_annotate missing (valgrind's package)"

# run_cg OUT ARGS...: the server, then the client under callgrind writing OUT
run_cg() {
    local out=$1 port; shift
    port=$(next_port)
    timeout 300 "$PERF" --server --listen 127.0.0.1:$port --transport verbs --rails "${B[0]}" "$@" > "$T/cg.srv" 2>&1 &
    local spid=$!
    wait_listen $port || die "kvrail-perf server did not start"
    timeout 600 valgrind --tool=callgrind --callgrind-out-file="$out" "$PERF" --client 127.0.0.1:$port \
        --transport verbs --rails "${A[0]}" "$@" > "$T/cg.cli" 2> "$T/cg.err" \
        || { cat "$T/cg.cli" "$T/cg.err" "$T/cg.srv" >&2; die "kvrail-perf under callgrind failed"; }
    kill $spid 2> /dev/null; wait $spid 2> /dev/null
}

# incl FILE PATTERN: the inclusive count of the first function whose name matches
incl() {
    callgrind_annotate --inclusive=yes --threshold=100 "$1" 2> /dev/null \
        | awk -v p="$2" 'index($0, p) && $0 !~ /=>/ {gsub(",", "", $1); print $1; exit}'
}
total() { incl "$1" "PROGRAM TOTALS"; }
per() { awk -v a="${1:-0}" -v b="${2:-0}" -v n="$3" 'BEGIN{printf "%.0f", (b - a) / n}'; }

C=$T/cg
run_cg "$C.bw1" --op write -s 65536 -t 32 -n 500 --spin-us 2000
run_cg "$C.bw2" --op write -s 65536 -t 32 -n 2500 --spin-us 2000
echo "bw  64 KiB WRITE x 32: $(per "$(total "$C.bw1")" "$(total "$C.bw2")" 2000) instructions a transfer" \
     "(Agent::post $(per "$(incl "$C.bw1" "kvrail::agent::Agent::post")" "$(incl "$C.bw2" "kvrail::agent::Agent::post")" 2000))"
run_cg "$C.lat1" --op lat -s 64 -n 200 --spin-us 200000
run_cg "$C.lat2" --op lat -s 64 -n 1200 --spin-us 200000
echo "lat 64 B notification: $(per "$(incl "$C.lat1" "kvrail_perf::bench::latency")" "$(incl "$C.lat2" "kvrail_perf::bench::latency")" 1000) instructions a round trip" \
     "(Agent::send_notif $(per "$(incl "$C.lat1" "kvrail::agent::Agent::send_notif")" "$(incl "$C.lat2" "kvrail::agent::Agent::send_notif")" 1000))"
