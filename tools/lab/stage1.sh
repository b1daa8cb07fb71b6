#!/bin/busybox sh
# kvrail-lab stage 1: /init of the initramfs that run.sh builds (static busybox + a
# few modules).  Does all the mounting with busybox (cheap under TCG, where every
# exec of a dynamic binary from the 9p root costs ~0.1 s), then switch_root's into
# the host's root and runs guest-init.sh from the lab dir as PID 1.
#
# Guest filesystem view:
#   /                 host root, read-only (9p, cache=loose)
#   /etc /var /root /home /tmp   overlay: host content + guest-local tmpfs writes
#   /run              tmpfs;  /run/kvrail-lab/state = this run's state dir (9p, rw)
#   each LAB_RW dir   host dir, read-write (9p, cache=mmap), default: the caller's cwd
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
msg() { echo "kvrail-lab stage 1: $*" > /dev/kmsg; }
die() { echo "kvrail-lab stage 1: error: $*" > /dev/console; poweroff -f; }

for m in $(cat /modules); do insmod "/mod/$m" || die "insmod $m failed"; done
labdir=$(sed -n 's/.*kvrail_lab\.dir=\([^ ]*\).*/\1/p' /proc/cmdline)
N=/newroot
P9="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o "$P9,ro,cache=loose" labroot $N || die "cannot mount the host root over 9p"
mount -t proc proc $N/proc
mount -t sysfs sysfs $N/sys
mount -t devtmpfs devtmpfs $N/dev
mkdir -p $N/dev/pts $N/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $N/dev/pts
mount -t tmpfs -o mode=1777 tmpfs $N/dev/shm
mount -t tmpfs -o mode=755 tmpfs $N/run
S=$N/run/kvrail-lab/state
mkdir -p $S $N/run/netns $N/run/lock
mount -t 9p -o "$P9,cache=none" labstate $S || die "cannot mount the state dir"
for d in etc var root home tmp; do
    [ -d "$N/$d" ] || continue
    o=$N/run/kvrail-lab/ovl/$d
    mkdir -p $o/u $o/w
    [ $d = tmp ] && chmod 1777 $o/u
    mount -t overlay overlay -o "lowerdir=$N/$d,upperdir=$o/u,workdir=$o/w" $N/$d || die "overlay on /$d failed"
done
i=0
while IFS= read -r d; do
    [ -n "$d" ] || continue
    mount -t 9p -o "$P9,cache=mmap" labrw$i "$N$d" || die "cannot mount $d read-write"
    i=$((i + 1))
done < $S/rwdirs
msg "filesystems mounted"
# The RDMA modules (list resolved by run.sh), loaded from the host's /lib/modules.
for m in $(cat /rdma-modules); do insmod "$N$m" || die "insmod $m failed"; done
msg "rdma modules loaded"
umount /dev
umount /proc
exec switch_root $N /bin/bash "$labdir/guest-init.sh"
