//! The verdict on each port — usable as a data-plane rail, or every reason it is not — and
//! the selection of rails for a NUMA node.

use std::fmt;

use serde::Serialize;

use super::addrs::Ipv4If;
use super::gid::{select_gid, GidChoice, LinkLayer};
use super::sysfs::{HostView, PortInfo};

/// Why a port cannot be a data-plane rail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Reason {
    /// The device sits on another NUMA node than the accelerator.
    NumaMismatch {
        /// The device's node.
        device_numa: i32,
        /// The node asked for.
        wanted: i32,
    },
    /// The port is not ACTIVE.
    PortNotActive {
        /// Its state.
        state: String,
    },
    /// The link layer is neither Ethernet nor InfiniBand.
    LinkLayer {
        /// What it is.
        link_layer: String,
    },
    /// An Ethernet port without a netdev.
    NoNetdev,
    /// The netdev has no IPv4 address.
    NoIpv4 {
        /// The netdev.
        netdev: String,
    },
    /// The netdev carries the host's default route: it is the management interface.
    DefaultRoute {
        /// The netdev.
        netdev: String,
    },
    /// No RoCEv2 GID with an IPv4 address (or no IB GID on InfiniBand).
    NoGid {
        /// What the table holds.
        detail: String,
    },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NumaMismatch {
                device_numa,
                wanted,
            } => {
                write!(
                    f,
                    "on NUMA node {device_numa}, not the accelerator's node {wanted}"
                )
            }
            Self::PortNotActive { state } => write!(f, "port is {state}, not ACTIVE"),
            Self::LinkLayer { link_layer } => write!(
                f,
                "link layer {link_layer:?} is neither Ethernet nor InfiniBand"
            ),
            Self::NoNetdev => f.write_str("Ethernet port without a netdev"),
            Self::NoIpv4 { netdev } => write!(f, "netdev {netdev} has no IPv4 address"),
            Self::DefaultRoute { netdev } => {
                write!(f, "netdev {netdev} carries the default route (management interface, not data plane)")
            }
            Self::NoGid { detail } => f.write_str(detail),
        }
    }
}

impl Reason {
    /// The command an operator runs to check this on the host.
    pub fn check_command(&self, port: &PortInfo) -> String {
        let (dev, p) = (&port.device, port.port);
        match self {
            Self::NumaMismatch { .. } => format!(
                "cat /sys/class/infiniband/{dev}/device/numa_node   # and the accelerator's: cat /sys/bus/pci/devices/<BDF>/numa_node"
            ),
            Self::PortNotActive { .. } => format!("rdma link show {dev}/{p}   # or: ibv_devinfo -d {dev}"),
            Self::LinkLayer { .. } => format!("ibv_devinfo -d {dev}"),
            Self::NoNetdev => format!("rdma link show {dev}/{p}   # the netdev column"),
            Self::NoIpv4 { netdev } => format!("ip -4 addr show dev {netdev}"),
            Self::DefaultRoute { .. } => "ip route show default".into(),
            Self::NoGid { .. } => format!(
                "grep . /sys/class/infiniband/{dev}/ports/{p}/gids/* /sys/class/infiniband/{dev}/ports/{p}/gid_attrs/types/*"
            ),
        }
    }
}

/// The verdict on one port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// The port.
    pub port: PortInfo,
    /// Every reason it is not usable (empty: usable).
    pub reasons: Vec<Reason>,
    /// Facts worth saying about a usable (or unusable) port, e.g. a NUMA node that matches
    /// anything.
    pub notes: Vec<String>,
    /// The GID a queue pair on it uses.
    #[serde(serialize_with = "ser_gid")]
    pub gid: Option<GidChoice>,
}

fn ser_gid<S: serde::Serializer>(g: &Option<GidChoice>, s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct G<'a> {
        index: u32,
        gid: String,
        reason: &'a str,
    }
    match g {
        Some(g) => s.serialize_some(&G {
            index: g.index,
            gid: g.gid.to_string(),
            reason: &g.reason,
        }),
        None => s.serialize_none(),
    }
}

impl Verdict {
    /// True when the port is a usable rail.
    pub fn usable(&self) -> bool {
        self.reasons.is_empty()
    }

    /// One line: `usable` (`usable, low MTU` below 4096) or the reasons joined.
    pub fn summary(&self) -> String {
        if self.usable() {
            if self.notes.iter().any(|n| n.starts_with("low MTU")) {
                "usable, low MTU (expect lower bandwidth)".into()
            } else {
                "usable".into()
            }
        } else {
            self.reasons
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        }
    }
}

/// The RoCE MTU a port should reach (4096, RoCE's largest); a port below it is usable with a
/// note (fewer bytes per packet: lower bandwidth).
const LOW_MTU_BELOW: u32 = 4096;

/// The verdict on `port` for an accelerator on NUMA node `numa` (-1: unknown, matches any).
pub fn judge(port: &PortInfo, numa: i32) -> Verdict {
    let mut reasons = Vec::new();
    let mut notes = Vec::new();
    match port.numa_node {
        None => notes.push(format!(
            "no device/numa_node (a software device{}): matches any NUMA node",
            port.parent
                .as_ref()
                .map(|p| format!(" on {p}"))
                .unwrap_or_default()
        )),
        Some(-1) => notes
            .push("device numa_node is -1 (single-node platform): matches any NUMA node".into()),
        Some(n) if numa < 0 => notes.push(format!(
            "on NUMA node {n}; no accelerator NUMA node given: matches"
        )),
        Some(n) if n != numa => reasons.push(Reason::NumaMismatch {
            device_numa: n,
            wanted: numa,
        }),
        Some(_) => {}
    }
    if !port.is_active() {
        reasons.push(Reason::PortNotActive {
            state: port.state.clone(),
        });
    }
    let link = match port.link_layer.as_str() {
        "Ethernet" => LinkLayer::Ethernet,
        "InfiniBand" => LinkLayer::InfiniBand,
        other => {
            reasons.push(Reason::LinkLayer {
                link_layer: other.to_owned(),
            });
            LinkLayer::Unspecified
        }
    };
    if link == LinkLayer::Ethernet {
        match &port.netdev {
            None => reasons.push(Reason::NoNetdev),
            Some(nd) => {
                if port.ipv4.is_empty() {
                    reasons.push(Reason::NoIpv4 { netdev: nd.clone() });
                }
                if port.default_route {
                    reasons.push(Reason::DefaultRoute { netdev: nd.clone() });
                }
            }
        }
    }
    if link == LinkLayer::InfiniBand {
        notes.push("InfiniBand: addressed by LID/GID, no IPv4 needed".into());
    }
    let mut gid = None;
    if link != LinkLayer::Unspecified {
        // Prefer the GID of the netdev's own address when there is one.
        let want = port.ipv4.first().map(|a: &Ipv4If| a.addr);
        match select_gid(link, &port.gids, want).or_else(|_| select_gid(link, &port.gids, None)) {
            Ok(g) => gid = Some(g),
            Err(detail) => reasons.push(Reason::NoGid { detail }),
        }
    }
    // (said of a port that is usable otherwise: a reason to fix comes first)
    if let (LinkLayer::Ethernet, Some(m), Some(nd)) = (link, port.active_mtu, &port.netdev) {
        if m < LOW_MTU_BELOW && reasons.is_empty() {
            notes.push(format!(
                "low MTU: active MTU {m}, from netdev {nd}'s MTU; RoCE carries {LOW_MTU_BELOW} where \
                 the fabric takes jumbo frames (ip link set dev {nd} mtu 9000): expect lower bandwidth"
            ));
        }
    }
    Verdict {
        port: port.clone(),
        reasons,
        notes,
        gid,
    }
}

/// The verdicts on every port of the host, in discovery order.
pub fn judge_all(host: &HostView, numa: i32) -> Vec<Verdict> {
    host.ports.iter().map(|p| judge(p, numa)).collect()
}

/// A usable data-plane rail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rail {
    /// The port and what is known about it.
    pub port: PortInfo,
    /// The GID its queue pairs use.
    pub gid: GidChoice,
}

/// No rail could be selected.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RailError {
    /// Nothing usable on that NUMA node; every port checked, and why it failed.
    #[error("{}", no_usable_text(*numa, verdicts, searched))]
    NoUsableNic {
        /// The NUMA node asked for.
        numa: i32,
        /// What was checked.
        verdicts: Vec<Verdict>,
        /// Where devices were looked for.
        searched: String,
    },
}

fn no_usable_text(numa: i32, verdicts: &[Verdict], searched: &str) -> String {
    let mut s = format!("no usable data-plane RoCE NIC on numa={numa}");
    if verdicts.is_empty() {
        s.push_str(&format!("; no RDMA devices under {searched}"));
        return s;
    }
    s.push_str(&format!("; checked {} port(s):", verdicts.len()));
    for v in verdicts {
        s.push_str(&format!("\n  {}: {}", v.port.name(), v.summary()));
    }
    s
}

/// The usable rails for an accelerator on NUMA node `numa` (-1: any), ordered by device
/// (natural order) and port.
///
/// A two-socket host with eight RoCE NICs (a sysfs fixture of the tests): the NPU at
/// `0000:b1:00.0` sits on node 1, whose four NICs are its rails.
///
/// ```
/// use kvrail::rails::{discover, pci_numa_node, select, AddrSource, SysfsRoot};
/// let root = SysfsRoot::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sysfs/two-socket-8nic"));
/// let host = discover(&root, &AddrSource::for_root(&root))?;
/// let numa = pci_numa_node(&root, "0000:b1:00.0")?;
/// let rails = select(&host, numa)?;
/// let names: Vec<String> = rails.iter().map(|r| format!("{}/{}", r.port.device, r.port.port)).collect();
/// assert_eq!(names, ["mlx5_4/1", "mlx5_5/1", "mlx5_6/1", "mlx5_7/1"]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`RailError::NoUsableNic`] naming the node and every port checked with its reasons.
pub fn select(host: &HostView, numa: i32) -> Result<Vec<Rail>, RailError> {
    let verdicts = judge_all(host, numa);
    let rails: Vec<Rail> = verdicts
        .iter()
        .filter(|v| v.usable())
        .filter_map(|v| {
            v.gid.clone().map(|gid| Rail {
                port: v.port.clone(),
                gid,
            })
        })
        .collect();
    if rails.is_empty() {
        return Err(RailError::NoUsableNic {
            numa,
            verdicts,
            searched: host.searched.clone(),
        });
    }
    Ok(rails)
}
