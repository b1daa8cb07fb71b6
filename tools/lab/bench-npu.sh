#!/bin/bash
# tools/lab/bench-npu.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench-npu.sh
# The agent's host bounce against plain host memory on the same rail, interleaved in one VM
# boot: kvrail-perf (two processes) WRITEs 8 MiB, 32 in flight, on rail 0, once between
# host regions and once between NPU regions of kvrail's RBLN test runtime (every byte
# device → staging slot → RDMA → staging slot → device; rxe has no dma-buf). Prints MB/s per
# round, the medians and the ratio NPU/host, and writes them as JSON to $BENCH_JSON
# (default target/bench-npu.json). Timings under TCG are noisy: compare only these runs.
#   ROUNDS (3)  BENCH_ITERS (100)  BENCH_SIZE (8388608)  KVRAIL_PERF (target/release/kvrail-perf)
set -u
BENCH_NAME=bench-npu
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
need_perf
SIZE=${BENCH_SIZE:-8388608}
N=${BENCH_ITERS:-100}
ROUNDS=${ROUNDS:-3}
JSON=${BENCH_JSON:-target/bench-npu.json}
export RBLN_RUNTIME_LIB="$T/librbln_test.so"
cc -shared -fPIC -O2 -pthread -o "$RBLN_RUNTIME_LIB" rbln-sys/testlib/rbln_test_runtime.c \
    || die "building the RBLN test runtime"

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END{ if (NR%2) print a[(NR+1)/2]; else printf "%.2f\n", (a[NR/2]+a[NR/2+1])/2 }'; }
HOST=() NPU=()
echo "== kvrail-perf WRITE $SIZE B, 32 in flight, rail 0: host memory vs NPU memory (host bounce); $ROUNDS interleaved rounds"
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    h=$(kvrail "${A[0]}" "${B[0]}" write "$SIZE" 32 "$N" --mem host)
    d=$(kvrail "${A[0]}" "${B[0]}" write "$SIZE" 32 "$N" --mem npu)
    HOST+=("$h"); NPU+=("$d")
    printf '  round %d  host %8s  npu %8s MB/s\n' "$ROUND" "$h" "$d"
done
h=$(echo "${HOST[*]}" | median); d=$(echo "${NPU[*]}" | median)
r=$(ratio "$d" "$h")
printf '%-40s %10s  %10s  %6s\n' "median of $ROUNDS rounds (MB/s)" "host" "npu" "npu/host"
printf '%-40s %10s  %10s  %6s\n' "WRITE $SIZE B, 32 in flight, rail 0" "$h" "$d" "$r"
mkdir -p "$(dirname "$JSON")"
echo "{\"tool\":\"bench-npu\",\"op\":\"write\",\"bytes\":$SIZE,\"rounds\":$ROUNDS,\"host_mbps\":$h,\"npu_mbps\":$d,\"ratio\":$r}" > "$JSON"
echo "# written to $JSON"
