#!/bin/bash
# tools/callgrind-cost.sh — instructions per descriptor of kvrail's descriptor paths, counted
# by valgrind's callgrind (stable where wall-clock timings are not): runs
# examples/desc_cost.rs with 0 and N rounds of 1,000 descriptors and divides the difference.
# The caller's copies of its lists are measured alone and taken out of kvrail's figure
# (valgrind counts a `rep movsb` copy per byte, so they weigh more here than on a CPU).
# Needs valgrind (apt install valgrind). N defaults to 50.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N=${N:-50}
command -v valgrind > /dev/null || { echo "callgrind-cost: valgrind missing (apt install valgrind)" >&2; exit 1; }
cargo build -q --release --example desc_cost
BIN=target/release/examples/desc_cost
T=$(mktemp -d)
count() {   # mode rounds → total instructions (Ir) of the run
    valgrind --tool=callgrind --callgrind-out-file="$T/out" "$BIN" "$1" "$2" > /dev/null 2> "$T/err" \
        || { cat "$T/err" >&2; exit 1; }
    grep -E '^(summary|totals):' "$T/out" | head -n 1 | awk '{print $2}'
}
per() {     # mode → instructions per descriptor of N rounds, setup subtracted
    local base full
    base=$(count "$1" 0)
    full=$(count "$1" "$N")
    awk -v a="$base" -v b="$full" -v n="$N" 'BEGIN{printf "%.0f", (b-a)/(n*1000)}'
}
v=$(per validate); l=$(per lists); p=$(per plan)
echo "instructions per descriptor (callgrind Ir; $N rounds x 1000 descriptors, setup subtracted)"
printf 'validate            %s   (create_xfer + release, with the caller copying its two lists)\n' "$v"
printf 'caller list copies  %s   (the copies alone: the caller'"'"'s cost, not kvrail'"'"'s)\n' "$l"
printf 'validate, kvrail    %s\n' "$((v - l))"
printf 'plan                %s   (striped over two rails)\n' "$p"
printf 'kvrail per request  %s   (validate + plan, kvrail'"'"'s own)\n' "$((v - l + p))"
rm -rf "$T"
