#!/bin/bash
# python/run-tests.sh — the Python package's tests, the way CI runs them:
#   1. the package's wheel (target/wheels; maturin builds the native module) into a venv
#      (target/py),
#      then pytest python/tests (the agent, kvrail.nixl, the NIXL-API program on kvrail,
#      kvrail.vllm through the engine harness in every mode, the fake model against
#      kvrail-demo's);
#   2. the same NIXL-API program against the real NIXL from PyPI (nixl-cu12, its UCX
#      backend over TCP on loopback), in its own venv (target/nixl-venv; numpy only, no
#      torch or CUDA wheels);
#   3. with LAB=1 (inside the Soft-RoCE lab): the program against kvrail.nixl on verbs, and
#      the engine harness (kvrail.vllm, P and D processes) in pull, push and push_stream.
# Needs python3 with venv (Debian: python3-venv) and PyPI. ~1 min warm, ~4 min fresh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
VENV=target/py
NIXL_VENV=target/nixl-venv
PROGRAM=python/tests/nixl_api_program.py

if [ "${LAB:-0}" = 1 ]; then
    # inside the lab VM: the package was installed by an earlier run on the host
    out=$(KVRAIL_AGENT_CONFIG='{"backend":"verbs"}' "$VENV/bin/python" "$PROGRAM" --impl kvrail 2>&1) || {
        echo "$out"; echo "NIXL-API program on kvrail/verbs: FAILED"; exit 1; }
    echo "$out" | grep -v '^ok'
    echo "$out" | grep -q "kvrail backend verbs" || { echo "not on verbs"; exit 1; }
    echo "$out" | grep -q "payload bytes copied 0$" || { echo "kvrail copied payload on verbs"; exit 1; }
    echo "=== NIXL-API program on kvrail.nixl over verbs: passed"
    for m in "pull --memory host" "push --memory host" "push_stream --memory npu"; do
        out=$(KVRAIL_AGENT_CONFIG='{"backend":"verbs"}' "$VENV/bin/python" python/tests/engine_harness.py --mode $m --requests 4 2>&1) || {
            echo "$out"; echo "engine harness ($m) on verbs: FAILED"; exit 1; }
        echo "$out" | head -1
        echo "$out" | grep -q "on verbs, D on verbs" || { echo "$out"; echo "not on verbs"; exit 1; }
        echo "$out" | grep "^harness \|^push_stream:"
    done
    exit 0
fi

echo "=== python: the wheel (target/wheels; maturin builds the native module), installed into $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check pytest numpy 'maturin>=1.5,<2' twine
# one build for every venv that needs the package (python/tests/vllm/run.sh takes it too):
# the abi3 manylinux wheel and the sdist, as a release would publish them
rm -f target/wheels/kvrail-*
# (built from the sdist in a temporary directory; with the workspace's target dir the release
# dependencies are built once for the wheel and the release tools CI builds after it: cold,
# they cost ~150 s each time)
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" \
    "$VENV/bin/maturin" build --quiet --release --sdist -m python/Cargo.toml -o target/wheels
"$VENV/bin/twine" check --strict target/wheels/kvrail-*
"$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/kvrail-*.whl
echo "=== python: pytest python/tests (python/tests/vllm runs in its own venv: python/tests/vllm/run.sh)"
# ignored, not skipped: with python/tests on sys.path its directory `vllm` would pass for vLLM;
# nixl_upstream (NIXL's own tests) runs in the vLLM venv, which has torch and the compat package
"$VENV/bin/python" -m pytest -q python/tests --ignore=python/tests/vllm --ignore=python/tests/nixl_upstream

echo "=== python: the NIXL-API program against the real NIXL (nixl-cu12, UCX over TCP on lo)"
[ -x "$NIXL_VENV/bin/python" ] || "$PY" -m venv "$NIXL_VENV"
"$NIXL_VENV/bin/pip" install -q --disable-pip-version-check numpy
"$NIXL_VENV/bin/pip" install -q --disable-pip-version-check --no-deps nixl-cu12==1.5.1
out=$(UCX_TLS=tcp UCX_NET_DEVICES=lo "$NIXL_VENV/bin/python" "$PROGRAM" --impl nixl 2>&1) || {
    echo "$out"; echo "NIXL-API program on NIXL: FAILED"; exit 1; }
echo "$out" | grep '^\[.*\] [0-9]* ok'
echo "=== python: the README's example against the real NIXL (its import swapped back)"
sed 's/^from kvrail.nixl import nixl_agent, nixl_agent_config.*/from nixl_cu12._api import nixl_agent, nixl_agent_config/' \
    python/tests/readme_example.py > target/readme_example_nixl.py
# (NIXL 1.5.1's agent crashes in its destructor at interpreter exit: the NIXL-API program
# leaves with os._exit for the same reason)
echo 'import os; os._exit(0)' >> target/readme_example_nixl.py
UCX_TLS=tcp UCX_NET_DEVICES=lo "$NIXL_VENV/bin/python" target/readme_example_nixl.py 2>&1 | grep '^README example' \
    || { echo "the README's example on NIXL: FAILED"; exit 1; }
echo "=== python: the same program on kvrail.nixl (TCP)"
"$VENV/bin/python" "$PROGRAM" --impl kvrail 2>&1 | grep -v '^ok'
