#!/bin/bash
# tools/test.sh — every test kvrail has, the way CI runs them:
#   1. tier 1 on this host: `cargo test --workspace` (lab suites print SKIPPED here; the
#      kvrail-demo crash soak runs 600 requests a mode), the Python package, kvrail.vllm in
#      real vLLM (python/tests/vllm/run.sh), and the fuzz
#      targets under AFL++ for KVRAIL_FUZZ_SECS (10) s each;
#   2. tier 2 in the lab: the verbs suite on real queue pairs (Soft-RoCE, two rails, host A
#      and host B in separate processes), the agent's shared suite (the same one tier 1 runs
#      on TCP) on verbs, the NIXL-API Python program on kvrail.nixl, the engine's own memory and NPU memory through the agent's host bounce on verbs, the C ABI's C and Python checks on verbs, agent metadata through etcd on verbs, the connector suite and kvrail-demo (a crash soak too) on verbs, the agent's verbs-only cases (a lossy rail under tc netem too), kvrail-rails list/gids/probe/link-down, and kvrail-perf's perftest command lines,
#      in four VM boots: one for every suite that leaves the lab as it found it, one each
#      for the three that take rxe links down or shape them (tc netem) — a boot costs ~12 s,
#      and sixteen of them were ~3 min of a CI run.
# Needs what tools/lab/setup.sh installs. KVRAIL_SKIP_LAB=1 runs tier 1 only (and says so);
# KVRAIL_LAB_SHARED_TIMEOUT (3600 s) bounds the shared boot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# (inside the lab's shared boot the host's start time comes along, so the step times go on)
START=${KVRAIL_TEST_START:-$(date +%s)}
# each step's header says how far in it starts (so a log shows where the time went)
step() { echo "=== [$(( $(date +%s) - START )) s] $*"; }

# Every later suite runs a test binary that build made, from its package's directory as
# cargo runs it. `cargo test --test NAME` resolves features for one package's
# dev-dependencies only, so the connector's, the tools' and the C ABI's suites each got a
# kvrail (and part of its dependencies) of their own: three more builds, ~2 min of a CI
# run. The list comes from cargo itself (nothing is built here: everything is fresh).
BINS="${CARGO_TARGET_DIR:-target}/test-binaries.tsv"
# suite NAME [ARGS...]: run test binary NAME (under the RUNNER command, when one is set) in
# its package's directory
RUNNER=()
suite() {
    local name=$1 exe dir line
    shift
    # (no process substitution: the lab's guest has no /dev/fd)
    line=$(awk -F'\t' -v n="$name" '$1 == n' "$BINS")
    IFS=$'\t' read -r _ exe dir <<< "$line" || true
    if [ -z "${exe:-}" ]; then
        echo "tools/test.sh: no test binary named $name in $BINS" >&2
        exit 1
    fi
    (cd "$dir" && "${RUNNER[@]}" "$exe" "$@")
}

# The lab suites that leave the lab as they found it (no link taken down or shaped), run one
# after another inside one VM boot: `tools/test.sh --lab-shared`, started by tier 2 below.
# Each suite is bounded as its own boot was (900 s).
lab_shared() {
    RUNNER=(timeout 900)
    step "tier 2: verbs suite inside the Soft-RoCE lab"
    suite verbs_lab
    step "tier 2: the agent's shared suite on the verbs backend inside the Soft-RoCE lab"
    suite agent_suite --test-threads=1
    step "tier 2: the engine's own memory (Vec, file mmap, raw range, NPU) in place on verbs"
    suite agent_memory --test-threads=1
    step "tier 2: NPU memory through the agent (its host bounce on verbs; RBLN test runtime) and the dma-buf probe"
    suite bounce_suite --test-threads=1
    step "tier 2: the C ABI on verbs: the C example, the C error checks, the Python ctypes check"
    suite c_abi c_ python
    step "tier 2: the NIXL-API program (python/tests) on kvrail.nixl over verbs"
    LAB=1 "${RUNNER[@]}" bash python/run-tests.sh
    step "tier 2: the connector (pull, push, dead D, dead P, pull/push refusal) on verbs"
    suite connector_suite --test-threads=1
    step "tier 2: fencing of freed blocks through the connector (late READ and WRITE) on verbs"
    suite connector_fence --test-threads=1
    step "tier 2: heterogeneous TP, push_stream and swa_window_mode between multi-rank engines on verbs"
    suite connector_engines --test-threads=1
    step "tier 2: kvrail-demo (proxy, P, D processes) on verbs across both rails"
    suite demo --test-threads=1
    step "tier 2: kvrail-perf with perftest's command lines (-d -x -m, --out_json_file) on verbs"
    suite perf_lab
    step "tier 2: agent metadata through etcd on verbs (etcd inside the VM; a restarted P's new queue pairs and rkeys)"
    suite store_etcd --test-threads=1
}
if [ "${1:-}" = --lab-shared ]; then
    lab_shared
    exit 0
fi

step "tier 1: cargo test --workspace"
cargo test --workspace

cargo test --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"], os.path.dirname(m["manifest_path"]), sep="\t")
' > "$BINS"

step "tier 1: the connector suites in metadata-store mode (a real etcd; P's parameters name its engine only)"
KVRAIL_CONNECTOR_ETCD=1 suite connector_suite
KVRAIL_CONNECTOR_ETCD=1 suite connector_engines
step "tier 1: the agent API example (examples/agent_pair.rs)"
# (built by `cargo test --workspace` above, with its features: `cargo run --example` would
# resolve other features and build kvrail again)
"${CARGO_TARGET_DIR:-target}/debug/examples/agent_pair"
step "tier 1: the Python package (pip install, pytest, the NIXL-API program on NIXL and on kvrail)"
bash python/run-tests.sh
step "tier 1: kvrail.vllm inside real vLLM 0.32 (CPU build): P and D engines in pull, push, push_stream (python/tests/vllm/run.sh)"
bash python/tests/vllm/run.sh
# (10 s a target since CI's 55 minutes got tight: 15 s found nothing more in the last runs;
# longer runs by command, `bash fuzz/run.sh --secs 600`)
step "tier 1: the fuzz targets under AFL++, ${KVRAIL_FUZZ_SECS:-10} s each (fuzz/run.sh; fails on any crash or hang)"
bash fuzz/run.sh --secs "${KVRAIL_FUZZ_SECS:-10}"

if [ "${KVRAIL_SKIP_LAB:-0}" = 1 ]; then
    echo "=== tier 2 (lab): SKIPPED because KVRAIL_SKIP_LAB=1"
    exit 0
fi
# Tier 2: the shared boot (lab_shared above; the VM may write under the checkout and the
# target dir), then one boot each for the suites that take links down or shape them.
T0=$(date +%s)
KVRAIL_TEST_START=$START LAB_TIMEOUT=${KVRAIL_LAB_SHARED_TIMEOUT:-3600} \
    LAB_RW="$PWD${CARGO_TARGET_DIR:+:$CARGO_TARGET_DIR}" tools/lab/run.sh bash tools/test.sh --lab-shared
RUNNER=("$PWD/tools/lab/run.sh")
step "tier 2: link_down_exit_s with the real rxe links taken down"
suite connector_link_down --test-threads=1
step "tier 2: the agent's verbs-only cases (rails, striping, rail failure, a lossy rail under tc netem) inside the lab"
suite agent_lab
step "tier 2: kvrail-rails (list, gids against ibv_devinfo, probe, link down) inside the Soft-RoCE lab"
suite rails_lab
step "tier 2 done in $(( $(date +%s) - T0 )) s"
