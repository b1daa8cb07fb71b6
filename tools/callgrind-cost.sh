#!/bin/bash
# tools/callgrind-cost.sh — instructions per descriptor of kvrail's descriptor paths, counted
# by valgrind's callgrind (stable where wall-clock timings are not): runs
# examples/desc_cost.rs with 0 and N rounds of 1,000 descriptors and divides the difference.
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
echo "mode      instructions per descriptor (callgrind Ir; $N rounds x 1000 descriptors, minus setup)"
for mode in validate plan; do
    base=$(count "$mode" 0)
    full=$(count "$mode" "$N")
    awk -v m="$mode" -v a="$base" -v b="$full" -v n="$N" 'BEGIN{printf "%-9s %.0f\n", m, (b-a)/(n*1000)}'
done
rm -rf "$T"
