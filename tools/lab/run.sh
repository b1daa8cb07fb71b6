#!/bin/bash
# tools/lab/run.sh CMD [ARGS...]
#
# Boots Debian's own kernel (linux-image-amd64, which ships rdma_rxe) under
# qemu with the host's root filesystem shared read-only over 9p, builds the
# Soft-RoCE topology (see guest-init.sh / README.md), runs CMD inside the guest in
# the caller's working directory with the caller's environment, and exits with
# CMD's exit status.  The guest is always powered off (or killed on timeout).
#
# Environment knobs (all optional):
#   RAILS=2            number of rails (veth pairs with an rxe device on each end); 0 = none
#   LAB_TIMEOUT=900    seconds before the VM is killed (exit status 124)
#   LAB_MEM=2048       guest memory, MiB
#   LAB_CPUS=2         guest vCPUs
#   LAB_ACCEL=auto     auto | tcg | kvm  (auto = kvm only if kvm_intel/kvm_amd is loaded;
#                      this workplace's /dev/kvm is PVM, which cannot run a stock kernel)
#   LAB_CPU=max        qemu -cpu model
#   LAB_MTU=9000       veth MTU (9000 gives rxe active_mtu 4096; 1500 gives 1024)
#   LAB_RW=<cwd>       colon-separated host dirs the guest may write (default: the cwd,
#                      unless it is /); everything else is read-only, with guest-local
#                      scratch overlays on /etc /var /root /home /tmp
#   LAB_KERNEL=<ver>   kernel version under /lib/modules (default: newest with rdma_rxe.ko)
#   LAB_CACHE=/var/cache/kvrail-lab   where the uncompressed kernel is cached (made on first use, ~1 s)
#   LAB_APPEND=        extra kernel command line (e.g. "loglevel=7" to see kernel messages)
#   LAB_VERBOSE=0      1 = print boot/topology progress and the console log on stderr
#   LAB_KEEP=0         1 = keep the per-run state dir (console.log, initramfs) for debugging
set -u -o pipefail

LAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RAILS=${RAILS:-2}
LAB_TIMEOUT=${LAB_TIMEOUT:-900}
LAB_MEM=${LAB_MEM:-2048}
LAB_CPUS=${LAB_CPUS:-2}
LAB_ACCEL=${LAB_ACCEL:-auto}
LAB_CPU=${LAB_CPU:-max}
LAB_MTU=${LAB_MTU:-9000}
LAB_VERBOSE=${LAB_VERBOSE:-0}
LAB_KEEP=${LAB_KEEP:-0}

say() { echo "[kvrail-lab] $*" >&2; }
die() { say "error: $*"; exit 125; }

[ $# -ge 1 ] || die "usage: $0 CMD [ARGS...]"
[[ $LAB_DIR =~ [[:space:]] ]] && die "the lab dir path must not contain whitespace: $LAB_DIR"
[[ $RAILS =~ ^[0-9]+$ ]] && [ "$RAILS" -le 16 ] || die "RAILS must be 0..16"
[[ $LAB_MTU =~ ^[0-9]+$ ]] && [ "$LAB_MTU" -ge 1280 ] || die "LAB_MTU must be a number >= 1280"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing: run tools/lab/setup.sh"
command -v cpio >/dev/null || die "cpio missing: run tools/lab/setup.sh"
[ -x /bin/busybox ] || die "busybox-static missing: run tools/lab/setup.sh"

# --- pick the guest kernel: newest version that has both a vmlinuz and rdma_rxe.ko
KVER=${LAB_KERNEL:-}
if [ -z "$KVER" ]; then
    for d in $(ls -1d /lib/modules/*/kernel/drivers/infiniband/sw/rxe 2>/dev/null | sort -V); do
        v=${d#/lib/modules/}; v=${v%%/*}
        [ -f "/boot/vmlinuz-$v" ] && KVER=$v
    done
fi
[ -n "$KVER" ] && [ -f "/boot/vmlinuz-$KVER" ] || die "no kernel with rdma_rxe found: run tools/lab/setup.sh"

# --- uncompressed kernel, cached: qemu boots the vmlinux ELF directly (PVH entry),
# skipping the XZ decompressor, which alone takes ~8 s under TCG.  Falls back to
# the vmlinuz if extraction fails.
KIMG=/boot/vmlinuz-$KVER
CACHE=${LAB_CACHE:-/var/cache/kvrail-lab}
VMLINUX=$CACHE/vmlinux-$KVER
if [ ! -s "$VMLINUX" ] || [ "$VMLINUX" -ot "$KIMG" ]; then
    mkdir -p "$CACHE" 2>/dev/null
    off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$KIMG" 2>/dev/null | head -n 1 | cut -d: -f1)
    if [ -n "$off" ] && tail -c +$((off + 1)) "$KIMG" | xz -dc 2>/dev/null > "$VMLINUX.$$";
       [ "$(head -c 4 "$VMLINUX.$$" 2>/dev/null | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
        mv -f "$VMLINUX.$$" "$VMLINUX"
    else
        rm -f "$VMLINUX.$$"
    fi
fi
[ -s "$VMLINUX" ] && KIMG=$VMLINUX
BIOS=()
[ -f /usr/share/qemu/qboot.rom ] && BIOS=(-bios /usr/share/qemu/qboot.rom)   # faster than SeaBIOS

# --- accelerator
case "$LAB_ACCEL" in
    auto) if [ -w /dev/kvm ] && [ -d /sys/module/kvm_intel -o -d /sys/module/kvm_amd ]; then ACCEL=kvm; else ACCEL=tcg; fi ;;
    kvm|tcg) ACCEL=$LAB_ACCEL ;;
    *) die "LAB_ACCEL must be auto, kvm or tcg" ;;
esac
if [ "$ACCEL" = kvm ]; then ACCEL_OPTS=(-accel kvm); CPU=host; else ACCEL_OPTS=(-accel tcg,thread=multi); CPU=$LAB_CPU; fi

# --- per-run state dir, shared read-write with the guest (command, env, exit status)
STATE=$(mktemp -d /tmp/kvrail-lab.XXXXXX) || die "mktemp failed"
QPID=
cleanup() {
    [ -n "$QPID" ] && kill -TERM "$QPID" 2>/dev/null
    if [ "$LAB_KEEP" = 1 ]; then say "state kept in $STATE"; else rm -rf "$STATE"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The caller's environment, and the command (cd to the caller's cwd, then exec CMD);
# the guest sources env.sh, then the topology variables, then cmd.sh.
export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_)=' > "$STATE/env.sh"
{
    printf 'cd -- %q || exit 126\n' "$PWD"
    printf 'exec'; printf ' %q' "$@"; printf '\n'
} > "$STATE/cmd.sh"

# Read-write shares (default: the cwd). Never the whole root.
RW_LIST=()
IFS=: read -r -a rw_req <<< "${LAB_RW-$PWD}"
for d in "${rw_req[@]}"; do
    [ -n "$d" ] || continue
    d=$(realpath -e -- "$d" 2>/dev/null) || die "LAB_RW: no such directory: $d"
    [ "$d" = / ] && { say "not sharing / read-write; it stays read-only"; continue; }
    RW_LIST+=("$d")
done
printf '%s\n' "${RW_LIST[@]}" > "$STATE/rwdirs"
printf 'RAILS=%s\nLAB_MTU=%s\nLAB_VERBOSE=%s\n' "$RAILS" "$LAB_MTU" "$LAB_VERBOSE" > "$STATE/config"

# --- stage-1 initramfs: static busybox, the modules needed to mount the 9p root,
# and stage1.sh as /init.  The RDMA modules are loaded later from the root.
IRD=$STATE/initrd
mkdir -p "$IRD"/{bin,dev,proc,sys,newroot,mod}
cp /bin/busybox "$IRD/bin/busybox"
cp "$LAB_DIR/stage1.sh" "$IRD/init"
resolve() { for m in "$@"; do modprobe -S "$KVER" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}'; done; }
resolve virtio_pci 9pnet_virtio 9p overlay virtio_console | awk '!seen[$0]++' > "$STATE/modlist"
resolve veth rdma_rxe rdma_ucm | awk '!seen[$0]++' | grep -v -x -F -f "$STATE/modlist" > "$IRD/rdma-modules"
[ -s "$STATE/modlist" ] && [ -s "$IRD/rdma-modules" ] || die "could not resolve guest modules for $KVER"
: > "$IRD/modules"
while read -r ko; do cp "$ko" "$IRD/mod/"; basename "$ko" >> "$IRD/modules"; done < "$STATE/modlist"
chmod 755 "$IRD/init"
(cd "$IRD" && find . | cpio -o -H newc --quiet) > "$STATE/initrd.cpio" || die "cpio failed"

# --- qemu command line
QEMU=(qemu-system-x86_64 -nodefaults -no-user-config -nographic -no-reboot
      "${ACCEL_OPTS[@]}" -machine q35 "${BIOS[@]}" -cpu "$CPU" -smp "$LAB_CPUS" -m "$LAB_MEM"
      -kernel "$KIMG" -initrd "$STATE/initrd.cpio"
      -append "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off tsc=reliable no_timer_check i8042.nokbd i8042.noaux i8042.nopnp random.trust_cpu=on kvrail_lab.dir=$LAB_DIR ${LAB_APPEND:-}"
      -serial "file:$STATE/console.log" -monitor none
      -fsdev "local,id=root,path=/,security_model=none,readonly=on,multidevs=remap"
      -device virtio-9p-pci,fsdev=root,mount_tag=labroot
      -fsdev "local,id=state,path=$STATE,security_model=none"
      -device virtio-9p-pci,fsdev=state,mount_tag=labstate
      -device virtio-serial-pci
      -chardev "file,id=out,path=$STATE/out.fifo" -device virtserialport,chardev=out,name=lab.stdout
      -chardev "file,id=err,path=$STATE/err.fifo" -device virtserialport,chardev=err,name=lab.stderr)
i=0
for d in "${RW_LIST[@]}"; do
    QEMU+=(-fsdev "local,id=rw$i,path=$d,security_model=none,multidevs=remap" -device "virtio-9p-pci,fsdev=rw$i,mount_tag=labrw$i")
    i=$((i+1))
done

[ "$LAB_VERBOSE" = 1 ] && say "kernel $KIMG, accel $ACCEL, cpu $CPU x$LAB_CPUS, ${LAB_MEM}MiB, rails $RAILS, rw: ${RW_LIST[*]:-none}"
# The guest's stdout/stderr arrive through FIFOs relayed by cat, so they share the
# caller's open file descriptions (a reopen of /proc/self/fd/1 would get its own
# file offset and clobber, or be clobbered by, the caller's other output).
mkfifo "$STATE/out.fifo" "$STATE/err.fifo" || die "mkfifo failed"
cat "$STATE/out.fifo" & OUTPID=$!
cat "$STATE/err.fifo" >&2 & ERRPID=$!
T0=$(date +%s.%N)
timeout -k 10 "$LAB_TIMEOUT" "${QEMU[@]}" </dev/null &
QPID=$!
wait "$QPID"; QRC=$?
QPID=
T1=$(date +%s.%N)
# Unblock a relay still waiting in open() (qemu died early), then let both drain.
for f in out err; do exec {fd}<>"$STATE/$f.fifo" && exec {fd}>&-; done
wait "$OUTPID" "$ERRPID"
[ "$LAB_VERBOSE" = 1 ] && { say "vm ran $(awk "BEGIN{printf \"%.1f\", $T1-$T0}") s (qemu rc $QRC); console log:"; sed 's/^/[console] /' "$STATE/console.log" >&2; }

RC=$(cat "$STATE/rc" 2>/dev/null)
if [ "$RC" = 125 ] && [ -f "$STATE/guest.log" ]; then   # the lab itself failed
    say "lab setup failed inside the guest:"; sed 's/^/[guest] /' "$STATE/guest.log" >&2
fi
[ -n "$RC" ] && exit "$RC"
if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then
    say "timed out after ${LAB_TIMEOUT}s (LAB_TIMEOUT); last console lines:"
    RC=124
else
    say "guest ended without an exit status (qemu rc $QRC); last console lines:"
    RC=125
fi
tail -n 30 "$STATE/console.log" | sed 's/^/[console] /' >&2
[ -f "$STATE/guest.log" ] && sed 's/^/[guest] /' "$STATE/guest.log" >&2
exit $RC
