#!/bin/bash
# tools/lab/setup.sh — installs everything kvrail needs to build and to run its Soft-RoCE lab.
# Idempotent: returns in well under a second when everything is already installed.
# Debian's archive only (apt); run as root (CI runs as root).
#
#   build:  cmake, libclang-dev (rdma-mummy-sys builds rdma-core-mummy and runs bindgen), gcc
#   lab:    linux-image-amd64 (Debian's kernel, ships rdma_rxe.ko; INITRD=No: the lab builds
#           its own tiny initramfs), qemu-system-x86 (from bookworm-backports on bookworm, so an
#           installed backports qemu-utils is not removed), busybox-static, cpio, xz-utils, kmod,
#           iproute2, rdma-core, ibverbs-providers (librxe), ibverbs-utils, perftest.
#   python: python3-venv (the package's tests install it into a venv, with PyPI's maturin)
#   store:  protobuf-compiler (protoc, for etcd-client's build: the `etcd` feature the tools
#           use), etcd-server (the real etcd the store suites start on a free port)
#   benches: ucx-utils (ucx_perftest, UCX's rc_verbs under NIXL), iperf3 (TCP reference),
#           valgrind (callgrind instruction counts, tools/callgrind-cost.sh).
# apt runs with private list/archive dirs under /var/lib/kvrail-lab/apt and the system's sources
# (+ backports for qemu), so /etc/apt is left as it was; it waits for the dpkg lock up to 10 min.
set -euo pipefail

PKGS=(cmake libclang-dev gcc pkg-config
      linux-image-amd64 busybox-static cpio xz-utils kmod iproute2
      rdma-core ibverbs-utils ibverbs-providers libibverbs1 perftest
      ucx-utils iperf3 valgrind python3 python3-venv binutils util-linux mount
      protobuf-compiler etcd-server)
QEMU_PKGS=(qemu-system-x86 qemu-system-common qemu-system-data seabios)

installed() { [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]; }
have_kernel() {
    ls /lib/modules/*/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko >/dev/null 2>&1 &&
        ls /boot/vmlinuz-* >/dev/null 2>&1
}

missing=(); qemu_missing=0
for p in "${PKGS[@]}"; do installed "$p" || missing+=("$p"); done
for p in "${QEMU_PKGS[@]}"; do installed "$p" || { missing+=("$p"); qemu_missing=1; }; done
if ! have_kernel && [[ " ${missing[*]} " != *" linux-image-amd64 "* ]]; then missing+=(linux-image-amd64); fi
if [ ${#missing[@]} = 0 ]; then
    echo "kvrail-lab setup: everything already installed"
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "kvrail-lab setup: must run as root (missing: ${missing[*]})" >&2; exit 1; }
echo "kvrail-lab setup: installing ${missing[*]}"

A=/var/lib/kvrail-lab/apt
rm -rf "$A/sources.d"
mkdir -p "$A/sources.d" "$A/lists/partial" "$A/archives/partial"
[ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$A/sources.d/system.list"
for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && cp "$f" "$A/sources.d/"
done
. /etc/os-release
SPEC=()
for p in "${missing[@]}"; do [[ " ${QEMU_PKGS[*]} " == *" $p "* ]] || SPEC+=("$p"); done
if [ $qemu_missing = 1 ]; then
    if [ "${VERSION_CODENAME:-}" = bookworm ]; then
        echo "deb http://deb.debian.org/debian bookworm-backports main" > "$A/sources.d/kvrail-lab-backports.list"
        SPEC+=("${QEMU_PKGS[@]/%//bookworm-backports}")
        installed qemu-utils && SPEC+=(qemu-utils/bookworm-backports)
    else
        SPEC+=("${QEMU_PKGS[@]}")
    fi
fi
APT=(apt-get -q -o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$A/sources.d"
     -o "Dir::State::lists=$A/lists" -o "Dir::Cache::archives=$A/archives"
     -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3)
export DEBIAN_FRONTEND=noninteractive INITRD=No
"${APT[@]}" update
"${APT[@]}" install -y --no-install-recommends "${SPEC[@]}"
"${APT[@]}" clean
have_kernel || { echo "kvrail-lab setup: no kernel with rdma_rxe.ko after install" >&2; exit 1; }
echo "kvrail-lab setup: done ($(qemu-system-x86_64 --version | head -n 1); kernel $(ls /lib/modules | sort -V | tail -n 1))"
