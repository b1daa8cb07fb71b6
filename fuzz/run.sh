#!/bin/bash
# fuzz/run.sh — run kvrail's fuzz targets under AFL++ (cargo-afl, stable Rust).
#   fuzz/run.sh [--secs S | --execs N] [--keep] [TARGET...]  (default: every target, 60 s each)
# Builds the targets instrumented, seeds fuzz/corpus/<target> (committed) from the real
# encoders, runs afl-fuzz per target (memory limited to 1 GiB: more is a finding), with
# --keep makes what found new coverage the target's corpus, and fails when any target
# crashed or hung.
# Needs: cargo install cargo-afl (it builds AFL++ on first use; tools/lab/setup.sh does).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
LIMIT=(-V 60)
KEEP=0
TARGETS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --secs) LIMIT=(-V "$2"); shift 2 ;;
        --execs) LIMIT=(-E "$2"); shift 2 ;;
        --keep) KEEP=1; shift ;;
        *) TARGETS+=("$1"); shift ;;
    esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(side_channel metadata notif kvmsg bounce json)
command -v cargo-afl > /dev/null || cargo install cargo-afl --locked -q   # builds AFL++ too
cargo afl build --release -q
./target/release/seeds corpus
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 \
    AFL_NO_AFFINITY=1 AFL_QUIET=1
# Keep what found new coverage (AFL's "+cov" queue entries, at most 600, spread over the
# run) as the target's corpus for the next run, beside the seeds. (afl-cmin would minimise
# further, but its afl-showmap sees no coverage from these persistent-mode targets here.)
keep() {
    local q="out/$1/default/queue" n
    n=$(ls "$q" | grep -c '+cov' || true)
    [ "$n" -gt 0 ] || return 0
    rm -rf "corpus/$1"; mkdir -p "corpus/$1"
    ls "$q" | grep '+cov' | awk -v n="$n" 'NR % int((n + 599) / 600) == 0' |
        while read -r f; do cp "$q/$f" "corpus/$1/cov-${f:3:6}"; done
    ./target/release/seeds corpus
}
status=0
for t in "${TARGETS[@]}"; do
    out="out/$t"
    rm -rf "$out"; mkdir -p out
    cargo afl fuzz -i "corpus/$t" -o "$out" -m 1024 "${LIMIT[@]}" "./target/release/$t" \
        > "out-$t.log" 2>&1 || true
    s="$out/default/fuzzer_stats"
    if [ ! -f "$s" ]; then
        echo "fuzz $t: afl-fuzz did not run; see fuzz/out-$t.log"; tail -20 "out-$t.log"; status=1; continue
    fi
    get() { awk -F: -v k="$1" '$1 ~ "^"k" *$" {gsub(/ /,"",$2); print $2}' "$s"; }
    execs=$(get execs_done); crashes=$(get saved_crashes); hangs=$(get saved_hangs)
    echo "fuzz $t: $execs inputs in $(get run_time) s ($(get execs_per_sec)/s), $(get corpus_count) in the queue, edges $(get edges_found)/$(get total_edges), $crashes crashes, $hangs hangs, peak RSS $(get peak_rss_mb) MiB"
    if [ "$crashes" != 0 ] || [ "$hangs" != 0 ]; then
        echo "fuzz $t: FINDINGS in fuzz/$out/default/{crashes,hangs}"; status=1
    fi
    [ "$KEEP" = 0 ] || keep "$t"
done
exit $status
