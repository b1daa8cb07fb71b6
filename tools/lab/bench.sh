#!/bin/bash
# tools/lab/bench.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench.sh
# The side-by-side bench, one VM boot, everything on the same rail (rail 0) and sizes:
#   WRITE and READ at 64 KiB, 256 KiB, 1 MiB, 8 MiB: ib_write_bw / ib_read_bw (-t 32),
#   ucx_perftest (UCT over rc_verbs, zcopy put_bw / get — the transport NIXL uses; UCP does
#   not run on rxe in this VM, see ../shared/rdma-lab/README.md, so NIXL itself cannot),
#   Mooncake's Transfer Engine over rdma (python/tests/mooncake_bench.py, 32 in flight; "-"
#   without target/mooncake-venv, which python/bench-peers.py makes) and kvrail-perf (the
#   agent API, two processes) with 32 transfers in flight — polling as perftest does
#   (--spin-us $BENCH_SPIN_US: the waiting thread polls the completion queues) and sleeping
#   (the default: a progress thread woken by the completion channel) — and with one (polling);
#   one in flight at 64 KiB next to ib_write_bw -t 1;
#   rails: kvrail one rail vs striped over two (1 MiB WRITE), next to two ib_write_bw at once;
#   TCP: kvrail-perf --transport tcp --loopback vs iperf3 over loopback (inside the VM);
#   latency: ib_send_lat vs kvrail-perf --op lat (64 B; polling and sleeping); and a verbs
#   --loopback -a sweep.
# Prints one table of MB/s (2^20 bytes/s) and ratios and writes it as JSON to $BENCH_JSON
# (default target/bench.json). Under TCG timings vary ±30 %: compare only rows of one run.
#   BENCH_SIZES ("65536 262144 1048576 8388608")  BENCH_MB (200: MiB moved per run)
#   BENCH_MC_SIZES (BENCH_SIZES: the sizes Mooncake runs at; CI runs two)
#   BENCH_SPIN_US (2000: kvrail's polling budget in the polling columns)
set -u
BENCH_NAME=bench
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
need_perf
SIZES=${BENCH_SIZES:-"65536 262144 1048576 8388608"}
JSON=${BENCH_JSON:-target/bench.json}
MB=${BENCH_MB:-200}
SPIN=${BENCH_SPIN_US:-2000}
iters() { local n=$(( MB * 1048576 / $1 )); [ "$n" -gt 2000 ] && n=2000; [ "$n" -lt 10 ] && n=10; echo "$n"; }
ROWS=()

printf '%-5s %8s | %9s %9s %9s %9s %9s %9s | %7s %7s %7s %9s %8s | %s\n' op bytes perftest ucx mooncake kvrail kv-sleep kvrail-t1 "kv/pt" "sl/pt" "t1/pt" "kv/ucx" "kv/mc" "cs/xfer t1 (kvrail client)"
for op in write read; do
    for size in $SIZES; do
        n=$(iters "$size")
        p=$(perftest_one "$op" 0 "$size" 32 "$n")
        u=$(ucx "$op" "$size" "$n")
        mc=-; [[ " ${BENCH_MC_SIZES:-$SIZES} " == *" $size "* ]] && mc=$(mooncake "$op" "$size")
        k=$(kvrail "${A[0]}" "${B[0]}" "$op" "$size" 32 "$n" --spin-us "$SPIN")
        ks=$(kvrail "${A[0]}" "${B[0]}" "$op" "$size" 32 "$n" -e)
        k1=$(kvrail "${A[0]}" "${B[0]}" "$op" "$size" 1 "$n" --spin-us "$SPIN")
        cs=$(awk '/^# context switches per transfer/ {print $NF}' "$T/kv")
        r=$(ratio "$k" "$p"); rs=$(ratio "$ks" "$p"); r1=$(ratio "$k1" "$p"); ru=$(ratio "$k" "$u")
        mc=${mc:-0}; rm=-; [ "$mc" != - ] && rm=$(ratio "$k" "$mc")
        printf '%-5s %8s | %9s %9s %9s %9s %9s %9s | %7s %7s %7s %9s %8s | %s\n' "$op" "$size" "$p" "$u" "$mc" "$k" "$ks" "$k1" "$r" "$rs" "$r1" "$ru" "$rm" "${cs:-?}"
        mj=$mc; [ "$mc" = - ] || ! ok "$mc" && mj=null
        ROWS+=("{\"op\":\"$op\",\"bytes\":$size,\"perftest_mbps\":$p,\"ucx_mbps\":$u,\"mooncake_rdma_mbps\":$mj,\"kvrail_mbps\":$k,\"kvrail_sleeping_mbps\":$ks,\"kvrail_t1_mbps\":$k1,\"kvrail_vs_perftest\":$r,\"kvrail_sleeping_vs_perftest\":$rs,\"kvrail_t1_vs_perftest\":$r1,\"kvrail_vs_ucx\":$ru,\"kvrail_t1_ctx_switches_per_xfer\":${cs:-null}}")
    done
done

# one in flight at 64 KiB: ib_write_bw -t 1 vs kvrail-perf -t 1 (polling)
n=$(iters 65536)
q1=$(perftest_one write 0 65536 1 "$n")
kq1=$(kvrail "${A[0]}" "${B[0]}" write 65536 1 "$n" --spin-us "$SPIN")
printf 'one in flight, 64 KiB WRITE: ib_write_bw -t 1 %s, kvrail-perf -t 1 (polling) %s (x%s)\n' "$q1" "$kq1" "$(ratio "$kq1" "$q1")"
T1="{\"perftest_t1_mbps\":$q1,\"kvrail_t1_mbps\":$kq1,\"ratio\":$(ratio "$kq1" "$q1")}"

echo
size=1048576; n=$(iters $size)
one=$(kvrail "${A[0]}" "${B[0]}" write $size 32 "$n")
two=$(kvrail "${A[0]},${A[1]}" "${B[0]},${B[1]}" write $size 32 "$n" --stripe-width 0)
p1=$(perftest_one write 0 $size 32 "$n")
p2=$(perftest_two write $size 32 "$n")
printf 'rails (1 MiB WRITE, 32 in flight): kvrail one rail %s, striped over two %s (x%s); ib_write_bw one rail %s, two at once %s (x%s); striped/two perftests %s\n' \
    "$one" "$two" "$(ratio "$two" "$one")" "$p1" "$p2" "$(ratio "$p2" "$p1")" "$(ratio "$two" "$p2")"
RAILS="{\"kvrail_one_rail_mbps\":$one,\"kvrail_striped_mbps\":$two,\"perftest_one_rail_mbps\":$p1,\"perftest_two_rails_mbps\":$p2,\"kvrail_striped_vs_one\":$(ratio "$two" "$one"),\"perftest_two_vs_one\":$(ratio "$p2" "$p1"),\"kvrail_striped_vs_two_perftests\":$(ratio "$two" "$p2")}"

# TCP over the VM's loopback: iperf3 (one stream, 5 s) vs kvrail-perf (1 MiB WRITE, 5 s)
port=$(next_port)
iperf3 -s -1 -B 127.0.0.1 -p "$port" > "$T/iperf.srv" 2>&1 &   # -B: IPv4 (wait_listen reads /proc/net/tcp)
wait_listen "$port" || die "iperf3 server did not start"
ip=$(iperf3 -c 127.0.0.1 -p "$port" -t 5 -J 2> /dev/null | awk -F: '/"bits_per_second"/ {v=$2} END {gsub(/[ ,]/, "", v); printf "%.2f", v/8/1048576}')
wait || true
"$PERF" --loopback --transport tcp -s 1M -t 32 -D 5 > "$T/kvtcp" 2>&1 || { cat "$T/kvtcp" >&2; die "kvrail-perf tcp failed"; }
kt=$(avg_of "$T/kvtcp")
printf 'tcp loopback: iperf3 %s MB/s, kvrail-perf --transport tcp (1 MiB WRITE, 32 in flight) %s MB/s (x%s)\n' "$ip" "$kt" "$(ratio "$kt" "$ip")"
TCP="{\"iperf3_mbps\":$ip,\"kvrail_tcp_mbps\":$kt,\"ratio\":$(ratio "$kt" "$ip")}"

# latency: ib_send_lat (64 B) vs kvrail-perf --op lat (a notification round trip / 2, 64 B)
pl=$(send_lat 1000)
kl=$(kvrail_lat 1000 --spin-us "$SPIN"); kls=$(kvrail_lat 1000 -e)
printf 'latency 64 B (t_typical, usec): ib_send_lat %s, kvrail-perf --op lat polling %s (x%s), sleeping %s\n' "${pl:-?}" "${kl:-?}" "$(ratio "${kl:-0}" "${pl:-0}")" "${kls:-?}"
LAT="{\"ib_send_lat_typical_us\":${pl:-null},\"kvrail_notif_typical_us\":${kl:-null},\"kvrail_notif_sleeping_typical_us\":${kls:-null}}"

# every mode works on verbs: a loopback sweep (two agents in one process, one per host)
"$PERF" --loopback --transport verbs --rails "${A[0]}" --peer-rails "${B[0]}" -a -n 10 -t 8 > "$T/sweep" 2>&1 \
    || { cat "$T/sweep" >&2; die "kvrail-perf --loopback -a on verbs failed"; }
grep -q '^# data check: every byte' "$T/sweep" || die "the verbs loopback sweep did not check its data"
echo "verbs loopback sweep (2 B - 8 MiB, -n 10 -t 8): every size ran and was checked"

mkdir -p "$(dirname "$JSON")"
( IFS=,; echo "{\"tool\":\"bench\",\"rail\":\"${A[0]}->${B[0]}\",\"rows\":[${ROWS[*]}],\"one_in_flight_64k\":$T1,\"rails\":$RAILS,\"tcp\":$TCP,\"latency\":$LAT}" ) > "$JSON"
echo "# written to $JSON"
