#!/bin/bash
# tools/check-front-door.sh — keeps the project's front door true (CI runs it after the
# tests; ~5 min on a warm target/, most of it the dry-run and MSRV builds):
#   1. README.md at most 200 lines, every relative link in the Markdown resolves, and each
#      README example is in the program that runs it (tools/check_front_door.py);
#   2. the README's Rust example runs (examples/readme.rs);
#   3. the API docs build with warnings as errors, and the doc tests pass;
#   4. `cargo publish --dry-run` for rbln-sys, kvrail, kvrail-ffi and kvrail-tools (each packaged
#      and built from its package alone), and the workspace checked with the minimum Rust
#      version the manifests declare (rust-version; rustup installs it when missing);
#   5. the Python wheel (built by python/run-tests.sh with its sdist, `twine check` passed there)
#      installs into a clean venv and imports and moves bytes with libibverbs hidden;
#   6. each tool's man page and completions generate, and --version names the build.
# The C library's install (pkg-config, CMake) is tested in ffi/tests/c_abi.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
T0=$(date +%s)
# each step says how far in it starts (where the front door's ~5 minutes go)
step() { echo "=== front door [$(( $(date +%s) - T0 )) s]: $*"; }

step "README, links, examples in the README"
python3 tools/check_front_door.py

step "the README's Rust example"
# (the binary `cargo test --workspace` built, with its features, when there is one: `cargo
# run --example` alone resolves the root package's features and builds kvrail again)
if [ -x target/debug/examples/readme ]; then target/debug/examples/readme; else cargo run -q --example readme; fi

step "cargo doc (warnings are errors) and the doc tests"
RUSTDOCFLAGS="-D warnings" cargo doc -q --no-deps --workspace --exclude kvrail-py
LOG=target/front-door.log
run_logged() {  # run "$@" with its output in $LOG; print the lines matching $1 (or all on failure)
    local pat=$1; shift
    if "$@" >"$LOG" 2>&1; then grep -E "$pat" "$LOG" || true; else cat "$LOG"; echo "FAILED: $*"; exit 1; fi
}
run_logged "^test result" cargo test -q --doc --workspace --exclude kvrail-py

step "cargo publish --dry-run (rbln-sys, kvrail, kvrail-ffi, kvrail-tools)"
# (each package is verified by building it from its packaged sources; with the test build's
# debug-info level those builds reuse the dependencies `cargo test` compiled: 64 s here on a
# warm target/, 134 s with the default level, which compiled them all again)
CARGO_PROFILE_DEV_DEBUG=line-tables-only \
    run_logged "^\s*(Packaged|Verifying)" cargo publish --dry-run --workspace --allow-dirty

MSRV=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml | head -1)
step "the minimum Rust version (rust-version = $MSRV) builds the workspace"
rustup toolchain list | grep -q "^$MSRV" || rustup toolchain install "$MSRV" --profile minimal
# (the libraries and the tools, what a user builds: the tests, benches and examples build on
# the CI toolchain; all targets took 132 s cold on 2 cores, these 67)
run_logged "^$" cargo "+$MSRV" check --workspace --lib --bins
echo "cargo +$MSRV check --workspace --lib --bins: ok"

step "the wheel in a clean venv, libibverbs hidden"
WHEEL=$(ls target/wheels/kvrail-*-abi3-manylinux*.whl 2>/dev/null | head -1)
[ -n "$WHEEL" ] || { echo "no manylinux abi3 wheel in target/wheels: run python/run-tests.sh first"; exit 1; }
rm -rf target/clean-venv && python3 -m venv target/clean-venv
target/clean-venv/bin/pip install -q --disable-pip-version-check "$WHEEL" numpy
unshare --mount --propagation private sh -c '
    set -e
    for f in $(ls /usr/lib/*/libibverbs.so* /lib/*/libibverbs.so* 2>/dev/null); do mount --bind /dev/null "$f"; done
    target/clean-venv/bin/python -c "import ctypes; ctypes.CDLL(\"libibverbs.so.1\")" 2>/dev/null \
        && { echo "libibverbs is still loadable"; exit 1; }
    KVRAIL_AGENT_CONFIG="{\"backend\": \"auto\"}" target/clean-venv/bin/python -c "
import kvrail
a = kvrail.Agent(\"clean\", {\"listen\": \"127.0.0.1:0\"})
assert a.backend == \"tcp\", a.backend
print(\"kvrail\", kvrail.__version__, \"imported without libibverbs; backend\", a.backend)"
    target/clean-venv/bin/python python/tests/readme_example.py'

step "man pages, completions, --version"
for t in kvrail-perf kvrail-rails kvrail-demo; do
    bin=target/debug/$t
    [ -x "$bin" ] || cargo build -q -p kvrail-tools --bin "$t"
    # (captured first: grep -q leaving early would fail the pipe under pipefail)
    out=$("$bin" --generate man)
    grep -q '^\.TH' <<<"$out" || { echo "$t: no man page"; exit 1; }
    for sh in bash zsh fish; do
        out=$("$bin" --generate "$sh")
        grep -q -- "$t" <<<"$out" || { echo "$t: no $sh completions"; exit 1; }
    done
    v=$("$bin" --version)
    echo "$v" | grep -Eq "^$t [0-9]+\.[0-9]+\.[0-9]+ \((commit [0-9a-f]{12}|not from git)" \
        || { echo "$t --version: $v"; exit 1; }
    echo "$v; man page and bash/zsh/fish completions generate"
done
step "all true"
