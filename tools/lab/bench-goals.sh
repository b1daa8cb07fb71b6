#!/bin/bash
# tools/lab/bench-goals.sh — runs INSIDE the lab:  tools/lab/run.sh tools/lab/bench-goals.sh
# The performance goals of one rail, as medians of ROUNDS interleaved rounds in one VM boot
# (rail 0; kvrail = kvrail-perf --server/--client, the agent API; but for the deep queue's
# two-queue-pair rows, its completions polled by the waiting thread as perftest polls):
#   deep queue   kvrail -t 32 vs ib_write_bw / ib_read_bw -t 32 at 64 KiB, 1 MiB, 8 MiB (goal >= 0.97)
#                with two queue pairs on the rail (`-q 2`, qps_per_rail = 2) and the agent's
#                default progress (`-e`: the progress thread sleeps on completion events): each
#                queue pair's poster thread posts its own, and rxe does a queue pair's packet
#                work inside the posting thread's `ibv_post_send`, so two posters keep both
#                vCPUs at it where perftest's one thread keeps one. Rows without a goal beside
#                it: the same against `ib_<op>_bw -q 2 -t 16` (as many queue pairs and
#                transfers in flight, one thread), and kvrail with one queue pair, polling
#                (`--spin-us`; the goal's row until 2026-12-04)
#   one at once  kvrail -t 1 at 256 KiB and 1 MiB vs perftest -t 32 (goal >= 0.9);
#                kvrail -t 1 at 64 KiB vs ib_write_bw -t 1 (goal >= 0.9)
#   latency      64 B notification round trip / 2 vs ib_send_lat, t_typical (goal <= 1.5);
#                also next to UCT active messages (ucx_perftest -t am_lat over rc_verbs, the
#                fastest 64 B round trip here: no goal, for scale), and the floors under the
#                agent's figure (kvrail-verbs-lat, no goal): the verbs layer's plain SENDs
#                and the notification channel's framing on them
#   scale        64 KiB WRITE -t 32, rows without a goal: ib_write_bw run a second time in the
#                round against its first run (A/A: how far one tool moves between two runs
#                here), and kvrail's verbs layer alone (kvrail-verbs-bw) against ib_write_bw
# Prints every round, then the medians, ratios and whether each goal held; JSON to
# $BENCH_JSON (default target/bench-goals.json). Under TCG runs vary ±30 %: only the medians
# of one run mean anything. ~8 min with ROUNDS=3, ~14 with 5 (CI; ~4 for one round).
#   ROUNDS (3)  BENCH_MB (100: MiB moved per bandwidth run, at least 40 transfers)  BENCH_SPIN_US (2000)
#   BENCH_INFO (1; 0: only the runs a goal needs — CI, for its 55 minutes: 19 of a round's 36)
set -u
BENCH_NAME=bench-goals
. "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
need_perf
ROUNDS=${ROUNDS:-3}
MB=${BENCH_MB:-100}
SPIN=${BENCH_SPIN_US:-2000}
INFO=${BENCH_INFO:-1}
JSON=${BENCH_JSON:-target/bench-goals.json}
# transfers a bandwidth run moves: BENCH_MB's worth, but at least 40 — more than the 32 a deep
# queue keeps in flight (at 8 MiB, 100 MiB was 12 transfers: a start-up, not a deep queue)
iters() { local n=$(( MB * 1048576 / $1 )); [ "$n" -gt 3000 ] && n=3000; [ "$n" -lt 40 ] && n=40; echo "$n"; }
K=$(mktemp -d /run/goals.XXXXXX)   # one file of values per measurement

put() { echo "$2" >> "$K/$1"; }
median() { sort -g "$K/$1" | awk '{v[NR]=$1} END {if (NR == 0) print 0; else if (NR % 2) print v[(NR+1)/2]; else printf "%.2f\n", (v[NR/2]+v[NR/2+1])/2}'; }

for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    line="round $ROUND:"
    for op in write read; do
        for size in 65536 1048576 8388608; do
            n=$(iters "$size")
            p=$(perftest_one "$op" 0 "$size" 32 "$n"); put "pt_${op}_$size" "$p"
            k2=$(kvrail "${A[0]}" "${B[0]}" "$op" "$size" 32 "$n" -q 2 -e); put "kv2_${op}_$size" "$k2"
            put "r2_${op}_$size" "$(ratio "$k2" "$p")"
            # (perftest's -t is per queue pair: 16 each is the same 32 in flight)
            line+=" $op $size pt $p kv -q 2 $k2"
            if [ "$INFO" = 1 ]; then   # the rows without a goal
                pq=$(PT_EXTRA="-q 2" perftest_one "$op" 0 "$size" 16 "$n"); put "ptq_${op}_$size" "$pq"
                put "rq_${op}_$size" "$(ratio "$k2" "$pq")"
                k=$(kvrail "${A[0]}" "${B[0]}" "$op" "$size" 32 "$n" --spin-us "$SPIN"); put "kv_${op}_$size" "$k"
                put "r_${op}_$size" "$(ratio "$k" "$p")"
                line+=" (pt -q 2 $pq; kv one queue pair polling $k)"
            fi
            line+=" |"
            if [ "$INFO$op$size" = 1write65536 ]; then   # for scale: A/A, and the verbs layer alone
                p2=$(perftest_one write 0 65536 32 "$n"); put pt2_65536 "$p2"
                put raa_65536 "$(ratio "$p2" "$p")"
                v=$(verbs_bw write 65536 32 "$n"); put vb_65536 "$v"
                put rvb_65536 "$(ratio "$v" "$p")"
                line+=" (pt again $p2, verbs layer $v) |"
            fi
        done
    done
    n=$(iters 262144)
    p=$(perftest_one write 0 262144 32 "$n"); put pt_write_262144 "$p"
    k=$(kvrail "${A[0]}" "${B[0]}" write 262144 1 "$n" --spin-us "$SPIN"); put t1_262144 "$k"
    put rt1_262144 "$(ratio "$k" "$p")"
    k=$(kvrail "${A[0]}" "${B[0]}" write 1048576 1 "$(iters 1048576)" --spin-us "$SPIN"); put t1_1048576 "$k"
    put rt1_1048576 "$(ratio "$k" "$(tail -n 1 "$K/pt_write_1048576")")"
    n=$(iters 65536)
    p=$(perftest_one write 0 65536 1 "$n"); put pt1_65536 "$p"
    k=$(kvrail "${A[0]}" "${B[0]}" write 65536 1 "$n" --spin-us "$SPIN"); put t1_65536 "$k"
    put rt1_65536 "$(ratio "$k" "$p")"
    pl=$(send_lat 2000); kl=$(kvrail_lat 2000 --spin-us "$SPIN"); put lat_pt "${pl:-0}"; put lat_kv "${kl:-0}"
    put rlat "$(ratio "${kl:-0}" "${pl:-0}")"
    ul=- vs=- vc=-
    if [ "$INFO" = 1 ]; then
        ul=$(ucx_lat 2000); put lat_ucx "${ul:-0}"; put rlat_ucx "$(ratio "${kl:-0}" "${ul:-0}")"
        vs=$(verbs_lat send 2000); put lat_vsend "${vs:-0}"; put rlat_vsend "$(ratio "${vs:-0}" "${pl:-0}")"
        vc=$(verbs_lat channel 2000); put lat_vch "${vc:-0}"; put rlat_vch "$(ratio "${vc:-0}" "${pl:-0}")"
    fi
    line+=" t1 256K/1M/64K $(tail -n 1 "$K/t1_262144")/$(tail -n 1 "$K/t1_1048576")/$k (ib_write_bw -t 1 $p) | lat $pl (UCT $ul; verbs layer $vs, channel $vc) vs $kl us"
    echo "$line"
done

goal() { awk -v v="$1" -v g="$2" -v dir="$3" 'BEGIN { ok = (dir == "min") ? (v >= g) : (v <= g); print ok ? "met" : "NOT met" }'; }
echo
echo "== medians of $ROUNDS interleaved rounds (MB/s = 2^20 B/s; latency us)"
printf '%-44s %10s %10s %8s  %-8s\n' case reference kvrail ratio goal
ROWS=()
row() {   # label reference-key kvrail-key ratio-key goal-value min|max
    [ "$6" = info ] && [ "$INFO" != 1 ] && return 0   # not measured (BENCH_INFO=0)
    local ref kv r g; ref=$(median "$2"); kv=$(median "$3"); r=$(median "$4")
    if [ "$6" = info ]; then   # no goal: a figure for scale
        printf '%-44s %10s %10s %8s  (no goal)\n' "$1" "$ref" "$kv" "$r"
        ROWS+=("{\"case\":\"$1\",\"reference\":$ref,\"kvrail\":$kv,\"ratio_median\":$r,\"goal\":null,\"met\":null}")
        return
    fi
    g=$(goal "$r" "$5" "$6")
    printf '%-44s %10s %10s %8s  %s %s %s\n' "$1" "$ref" "$kv" "$r" "$([ "$6" = min ] && echo ">=" || echo "<=")" "$5" "$g"
    ROWS+=("{\"case\":\"$1\",\"reference\":$ref,\"kvrail\":$kv,\"ratio_median\":$r,\"goal\":\"$([ "$6" = min ] && echo ">=" || echo "<=") $5\",\"met\":$([ "$g" = met ] && echo true || echo false)}")
}
for op in write read; do
    for size in 65536 1048576 8388608; do
        row "$op $size -t 32 (-q 2) vs ib_${op}_bw -t 32" "pt_${op}_$size" "kv2_${op}_$size" "r2_${op}_$size" 0.97 min
        row "$op $size -t 32 (-q 2) vs ib_${op}_bw -q 2 -t 16" "ptq_${op}_$size" "kv2_${op}_$size" "rq_${op}_$size" - info
        row "$op $size -t 32, one queue pair, polling" "pt_${op}_$size" "kv_${op}_$size" "r_${op}_$size" - info
    done
done
row "write 65536 -t 32: ib_write_bw again (A/A)" pt_write_65536 pt2_65536 raa_65536 - info
row "write 65536 -t 32: verbs layer vs ib_write_bw" pt_write_65536 vb_65536 rvb_65536 - info
row "write 262144 -t 1 vs ib_write_bw -t 32" pt_write_262144 t1_262144 rt1_262144 0.9 min
row "write 1048576 -t 1 vs ib_write_bw -t 32" pt_write_1048576 t1_1048576 rt1_1048576 0.9 min
row "write 65536 -t 1 vs ib_write_bw -t 1" pt1_65536 t1_65536 rt1_65536 0.9 min
row "64 B latency vs ib_send_lat (t_typical)" lat_pt lat_kv rlat 1.5 max
row "64 B latency vs UCT am_lat (median)" lat_ucx lat_kv rlat_ucx - info
row "64 B verbs layer, SENDs, vs ib_send_lat" lat_pt lat_vsend rlat_vsend - info
row "64 B verbs layer, channel, vs ib_send_lat" lat_pt lat_vch rlat_vch - info
mkdir -p "$(dirname "$JSON")"
( IFS=,; echo "{\"tool\":\"bench-goals\",\"rounds\":$ROUNDS,\"rail\":\"${A[0]}->${B[0]}\",\"spin_us\":$SPIN,\"rows\":[${ROWS[*]}]}" ) > "$JSON"
echo "# written to $JSON"
