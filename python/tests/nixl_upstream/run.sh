#!/bin/bash
# python/tests/nixl_upstream/run.sh — NIXL's own Python tests and examples, unmodified (from
# ai-dynamo/nixl at the commit in README.md), against kvrail's `nixl` compat package, and
# NIXL 1.5.1's Python surface compared name by name with kvrail's. Runs in the vLLM venv
# (torch, the compat package installed: python/tests/vllm/run.sh calls it), with the real
# NIXL 1.5.1 in target/vllm-nixl for the surface. ~30 s.
#   1. pytest test/python: 23 passed, 4 skipped (NIXL 1.5.1 on this machine: 24, 3; the
#      fourth skip is test_query_mem, which needs a storage plugin — POSIX or MOCK_DRAM);
#   2. basic_two_peers.py, expanded_two_peers.py (two processes, socket metadata) and
#      partial_md_example.py (socket, and --etcd against a real etcd started here): each
#      exits 0 and reports its data verified;
#   3. python/tests/nixl_surface.py dump (real NIXL) then check (kvrail).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
V=${VENV:-target/vllm-venv}
case $V in /*) ;; *) V=$ROOT/$V ;; esac  # a path relative to the repository root
PY=$V/bin/python
TMP=$(mktemp -d)
ETCD_PID=
trap '[ -n "$ETCD_PID" ] && kill "$ETCD_PID" 2>/dev/null; rm -rf "$TMP"' EXIT
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
fail() { echo "NIXL upstream: $*"; exit 1; }

echo "=== nixl upstream: NIXL's test/python on kvrail's nixl compat package"
out=$(cd "$HERE/test/python" && "$PY" -m pytest -q -rs -p no:cacheprovider . 2>&1) || { echo "$out"; fail "pytest failed"; }
echo "$out" | grep -E "^SKIPPED|passed"
echo "$out" | grep -q "23 passed, 4 skipped" || { echo "$out"; fail "expected 23 passed, 4 skipped"; }
echo "$out" | grep -q "SKIPPED.*No working backends available (POSIX" || fail "test_query_mem not skipped for its storage plugin"

echo "=== nixl upstream: NIXL's examples"
cd "$HERE/examples/python"
two_peers() {  # an example with --mode target / initiator on one port
    local ex=$1 port
    port=$(free_port)
    timeout 90 "$PY" "$ex" --mode target --ip 127.0.0.1 --port "$port" > "$TMP/t.log" 2>&1 &
    local t=$!
    for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    timeout 90 "$PY" "$ex" --mode initiator --ip 127.0.0.1 --port "$port" > "$TMP/i.log" 2>&1 || { cat "$TMP/t.log" "$TMP/i.log"; fail "$ex initiator failed"; }
    wait "$t" || { cat "$TMP/t.log" "$TMP/i.log"; fail "$ex target failed"; }
    grep -q "Data verification passed\|data verification passed" "$TMP/i.log" || { cat "$TMP/i.log"; fail "$ex: no data verified"; }
    grep -q "Test Complete" "$TMP/t.log" || { cat "$TMP/t.log"; fail "$ex: target incomplete"; }
    echo "$ex: $(grep -ho '[A-Za-z ]*[Dd]ata verification passed[^"]*' "$TMP/t.log" "$TMP/i.log" | tr '\n' ';')"
}
two_peers basic_two_peers.py
two_peers expanded_two_peers.py
CP=$(free_port); PP=$(free_port)
etcd --data-dir "$TMP/etcd" --listen-client-urls "http://127.0.0.1:$CP" --advertise-client-urls "http://127.0.0.1:$CP" \
    --listen-peer-urls "http://127.0.0.1:$PP" > "$TMP/etcd.log" 2>&1 &
ETCD_PID=$!
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$CP") 2>/dev/null && break; sleep 0.1; done
for how in socket etcd; do
    flag=(); [ "$how" = etcd ] && flag=(--etcd)
    # the example reads NIXL_ETCD_ENDPOINTS even for the socket exchange (it unsets it)
    out=$(NIXL_ETCD_ENDPOINTS="http://127.0.0.1:$CP" NIXL_ETCD_NAMESPACE="nixl-ex-$how" \
          timeout 90 "$PY" partial_md_example.py "${flag[@]}" 2>&1) || { echo "$out"; fail "partial_md_example ($how) failed"; }
    [ "$(echo "$out" | grep -c 'Initiator done\|Target done')" = 4 ] && echo "$out" | grep -q "Correct exception" \
        && echo "$out" | grep -q "Test Complete" || { echo "$out"; fail "partial_md_example ($how) incomplete"; }
    echo "partial_md_example.py ($how): two partial exchanges, both READs done, the unsent set refused"
done

echo "=== nixl upstream: NIXL 1.5.1's Python surface against kvrail's"
PYTHONPATH="$ROOT/target/vllm-nixl" "$PY" "$ROOT/python/tests/nixl_surface.py" dump "$TMP/surface.json"
"$PY" "$ROOT/python/tests/nixl_surface.py" check "$TMP/surface.json"
