#!/bin/bash
# kvrail-lab stage 2: runs as PID 1 inside the guest, started by stage1.sh once
# the filesystems are mounted and the RDMA modules loaded.  Builds the Soft-RoCE
# topology, runs the caller's command, records its exit status and powers off.
# Bash builtins where possible: under TCG every fork+exec costs ~50-100 ms.
#
# Topology for rail r (r = 0 .. RAILS-1), all in the init network namespace
# (rdma_rxe in Linux 6.1 only works on netdevs in init_net):
#   vethA<r> 198.18.<r>.1/24  MAC 02:00:c6:12:<r>:01  <--veth-->  vethB<r> 198.18.<r>.2/24  MAC 02:00:c6:12:<r>:02
#   rxeA<r> on vethA<r>                                           rxeB<r> on vethB<r>
# rxe routes its packets with its own netdev as output interface, so RoCE traffic
# between rxeA<r> and rxeB<r> crosses the veth (ARP included) although both IPs are
# local; plain IP traffic between the two addresses (e.g. a TCP side channel) goes
# over lo, like a separate management network that survives a rail going down.
# GID index 0 = default link-local GID, 1 = IPv4 RoCEv2 GID.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
S=/run/kvrail-lab/state

poweroff_now() { sync; echo o > /proc/sysrq-trigger; while :; do sleep 1; done; }
# log: always into the state dir (run.sh shows it on failure), and to stderr when LAB_VERBOSE=1
log() {
    local up; read -r up _ < /proc/uptime 2>/dev/null
    echo "[kvrail-lab guest ${up}s] $*" >> "$S/guest.log" 2>/dev/null
    [ "${LAB_VERBOSE:-0}" = 1 ] && echo "[kvrail-lab guest ${up}s] $*" >&2
    return 0
}
fail() {
    log "error: $*"
    echo "[kvrail-lab guest] error: $*" >&2
    echo "[kvrail-lab guest] error: $*" > /dev/console 2>/dev/null
    echo 125 > "$S/rc"; poweroff_now
}
trap 'fail "guest-init.sh exited unexpectedly"' EXIT

# From here on, stdout/stderr go to the caller (virtio-serial ports wired to run.sh's fds).
OUT=; ERR=
for p in /sys/class/virtio-ports/*; do
    read -r n < "$p/name"
    case $n in lab.stdout) OUT=/dev/${p##*/} ;; lab.stderr) ERR=/dev/${p##*/} ;; esac
done
[ -n "$OUT" ] && [ -n "$ERR" ] && exec >"$OUT" 2>"$ERR" </dev/null
. "$S/config"
log "userspace up (stdout=$OUT stderr=$ERR)"

echo kvrail-lab > /proc/sys/kernel/hostname

# ---- Soft-RoCE topology ----------------------------------------------------
# (stage 1 already loaded veth, rdma_rxe, rdma_ucm and their dependencies)
[ -d /sys/module/rdma_rxe ] || modprobe -a veth rdma_rxe rdma_ucm || fail "modprobe rdma_rxe failed"
echo "link set lo up" > /run/kvrail-lab/ip.batch
if [ "$RAILS" -gt 0 ]; then
    # Inherited by the veths created below: no IPv6 (keeps the GID table to
    # exactly [0]=link-local default GID, [1]=IPv4); and, defensively (the guest's
    # defaults already allow it), accept packets whose source is a local address.
    echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6
    echo 1 > /proc/sys/net/ipv4/conf/default/accept_local
    echo 1 > /proc/sys/net/ipv4/conf/all/accept_local
    echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter
    echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter
    # rxe sends a whole message's packets in a burst; the default backlog (1000) drops them.
    echo 100000 > /proc/sys/net/core/netdev_max_backlog
    {
        for ((r = 0; r < RAILS; r++)); do
            A=198.18.$r.1; B=198.18.$r.2; printf -v h '%02x' "$r"
            echo "link add vethA$r address 02:00:c6:12:$h:01 mtu $LAB_MTU type veth peer name vethB$r address 02:00:c6:12:$h:02 mtu $LAB_MTU"
            echo "addr add $A/24 dev vethA$r"
            echo "addr add $B/24 dev vethB$r"
            echo "link set vethA$r up"
            echo "link set vethB$r up"
        done
    } >> /run/kvrail-lab/ip.batch
    ip -b /run/kvrail-lab/ip.batch || fail "network setup failed"
    for ((r = 0; r < RAILS; r++)); do
        echo "link add rxeA$r type rxe netdev vethA$r"
        echo "link add rxeB$r type rxe netdev vethB$r"
    done > /run/kvrail-lab/rdma.batch
    rdma -b /run/kvrail-lab/rdma.batch 2>>"$S/guest.log" || fail "rdma link add failed"
    log "rxe devices created"

    mkfifo /run/kvrail-lab/sleep.fifo && exec 9<>/run/kvrail-lab/sleep.fifo
    # Wait until every port is ACTIVE and its IPv4 GID is in the table; find its index.
    GID_INDEX=
    for ((r = 0; r < RAILS; r++)); do
        for side in A B; do
            dev=rxe$side$r; [ $side = A ] && o=1 || o=2
            printf -v want '0000:0000:0000:0000:0000:ffff:c612:%02x%02x' "$r" "$o"
            for ((t = 0; t < 300; t++)); do
                st=; g=
                read -r st _ < "/sys/class/infiniband/$dev/ports/1/state" 2>/dev/null
                for idx in 0 1 2 3; do
                    read -r g < "/sys/class/infiniband/$dev/ports/1/gids/$idx" 2>/dev/null
                    [ "$g" = "$want" ] && break
                done
                [ "$st" = 4: ] && [ "$g" = "$want" ] && break
                read -t 0.05 -r -u 9 _ || :   # 50 ms sleep without forking sleep(1)
            done
            [ "$g" = "$want" ] || fail "$dev: IPv4 GID $want never appeared (port state '$st')"
            [ -z "$GID_INDEX" ] && GID_INDEX=$idx
            [ "$idx" = "$GID_INDEX" ] || fail "$dev: IPv4 GID at index $idx, others at $GID_INDEX"
        done
    done
    log "all ports ACTIVE, IPv4 GID index $GID_INDEX"
else
    ip -b /run/kvrail-lab/ip.batch || fail "network setup failed"
fi

# Topology description for the command (also in /run/kvrail-lab/topology.env).
A_DEVS=; B_DEVS=; A_IPS=; B_IPS=; A_NETDEVS=; B_NETDEVS=
for ((r = 0; r < RAILS; r++)); do
    A_DEVS+="${A_DEVS:+ }rxeA$r"; B_DEVS+="${B_DEVS:+ }rxeB$r"
    A_IPS+="${A_IPS:+ }198.18.$r.1"; B_IPS+="${B_IPS:+ }198.18.$r.2"
    A_NETDEVS+="${A_NETDEVS:+ }vethA$r"; B_NETDEVS+="${B_NETDEVS:+ }vethB$r"
done
cat > /run/kvrail-lab/topology.env <<EOF
export LAB_GUEST=1
export LAB_RAILS=$RAILS
export LAB_GID_INDEX=${GID_INDEX:-}
export LAB_A_DEVS="$A_DEVS"
export LAB_B_DEVS="$B_DEVS"
export LAB_A_IPS="$A_IPS"
export LAB_B_IPS="$B_IPS"
export LAB_A_NETDEVS="$A_NETDEVS"
export LAB_B_NETDEVS="$B_NETDEVS"
EOF

# ---- run the command --------------------------------------------------------
log "running command"
trap - EXIT
# (the outer 2>/dev/null only hides bash's own "Killed" job report; the command
# itself gets the real stderr back through fd 5)
exec 5>&2
{ ( exec 2>&5 5>&-; . "$S/env.sh"; . /run/kvrail-lab/topology.env; . "$S/cmd.sh" ) </dev/null; rc=$?; } 2>/dev/null
exec 5>&-
log "command exited with $rc"
echo "$rc" > "$S/rc"
poweroff_now
