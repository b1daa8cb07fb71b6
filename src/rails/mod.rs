//! Rails: RDMA NIC ports, discovered from sysfs under an injectable root, each judged usable
//! as a data-plane rail or not — with every reason — and selected for an accelerator's NUMA
//! node by one rule:
//!
//! a port is usable when it is on the accelerator's NUMA node (a device without
//! `device/numa_node`, or with -1, matches any node), ACTIVE, Ethernet with an IPv4 address
//! on its netdev and a RoCEv2 IPv4 GID, or InfiniBand with an IB GID, and its netdev does not
//! carry the host's default route (that is the management interface).
//!
//! Usable rails are ordered by device name (natural order: `mlx5_2` before `mlx5_10`) and
//! port. With none, the error reads `no usable data-plane RoCE NIC on numa=N` followed by
//! every port checked and why it failed.

mod addrs;
pub mod gid;
mod sysfs;
mod verdict;

pub use addrs::{AddrSource, Ipv4If};
pub use sysfs::{
    default_route_ifaces, discover, discover_gids_of, natural_cmp, parse_sysfs_gid, pci_numa_node,
    roce_mtu_for_netdev_mtu, HostView, NumaNodeError, PortInfo, SysfsRoot,
};
pub use verdict::{judge, judge_all, select, Rail, RailError, Reason, Verdict};
