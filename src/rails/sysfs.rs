//! Reading what the kernel says about RDMA ports, from a sysfs/procfs tree under an
//! injectable root (`/` on a real host, a fixture directory in tests).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::net::Ipv6Addr;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::addrs::{AddrSource, Ipv4If};
use super::gid::{Gid, GidEntry, GidType};

/// Bytes asked for by a file's first read, on the stack: a GID, a state or an MTU fits
/// (a GID file is 40 bytes); a read that fills it goes on to the end.
const SMALL_READ: usize = 256;

/// The root that `sys/` and `proc/` are read under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysfsRoot(PathBuf);

impl SysfsRoot {
    /// `root` (`/` on a real host).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self(root.into())
    }

    /// The host's own root, `/`.
    pub fn system() -> Self {
        Self::new("/")
    }

    /// The root path.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// True for `/`.
    pub fn is_system(&self) -> bool {
        self.0 == Path::new("/")
    }

    pub(crate) fn join(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }

    /// The trimmed contents of `rel`, or None when it does not exist / cannot be read (or
    /// is not UTF-8).
    ///
    /// Three system calls for a small file (open, one read, close) where
    /// `fs::read_to_string` makes five (it asks the size, which sysfs gives as a page, and
    /// reads again for the end): discovery reads every GID entry of every port (1,024 per
    /// Soft-RoCE port), and under the lab's emulation those calls were most of an agent's
    /// start. A read that fills the buffer goes on to the end.
    pub(crate) fn read(&self, rel: &str) -> Option<String> {
        use std::io::Read;
        let mut f = fs::File::open(self.join(rel)).ok()?;
        let mut small = [0u8; SMALL_READ];
        let n = f.read(&mut small).ok()?;
        if n < SMALL_READ {
            return std::str::from_utf8(&small[..n])
                .ok()
                .map(|s| s.trim().to_owned());
        }
        let mut buf = small.to_vec();
        f.read_to_end(&mut buf).ok()?;
        String::from_utf8(buf).ok().map(|s| s.trim().to_owned())
    }

    /// The state word of `device:port` (`ACTIVE`, `DOWN`, …) from
    /// `sys/class/infiniband/<device>/ports/<port>/state` (`4: ACTIVE`); None when unreadable.
    pub fn port_state(&self, device: &str, port: u8) -> Option<String> {
        self.read(&format!("sys/class/infiniband/{device}/ports/{port}/state"))
            .map(|s| {
                s.split_once(':')
                    .map_or(s.as_str(), |(_, w)| w)
                    .trim()
                    .to_owned()
            })
    }

    fn list(&self, rel: &str) -> io::Result<Vec<String>> {
        let mut v: Vec<String> = fs::read_dir(self.join(rel))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        v.sort_by(|a, b| natural_cmp(a, b));
        Ok(v)
    }
}

/// Compare names so that `mlx5_2` sorts before `mlx5_10`: as runs of (text, number)
/// (a run with no digits counts 0, a number too long for u64 as u64::MAX), then bytewise.
///
/// Allocation-free: a port's `gids` directory lists 1,024 names on Soft-RoCE (256 on a
/// ConnectX port), sorted at every discovery; keys built as strings per comparison made
/// that sort ~30 M instructions per port (callgrind), part of an agent's start.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    natural_runs(a).cmp(natural_runs(b)).then_with(|| a.cmp(b))
}

/// `s` as runs of (non-digits, the number of the digits after them); at least one run.
fn natural_runs(s: &str) -> impl Iterator<Item = (&str, u64)> {
    let bytes = s.as_bytes();
    let mut pos = 0;
    let mut first = true;
    std::iter::from_fn(move || {
        if pos >= bytes.len() && !std::mem::take(&mut first) {
            return None;
        }
        first = false;
        let t = pos
            + bytes[pos..]
                .iter()
                .take_while(|c| !c.is_ascii_digit())
                .count();
        let d = t + bytes[t..].iter().take_while(|c| c.is_ascii_digit()).count();
        let num = if d == t {
            0
        } else {
            s[t..d].parse().unwrap_or(u64::MAX)
        };
        let run = (&s[pos..t], num);
        pos = d;
        Some(run)
    })
}

/// One RDMA port as the kernel describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PortInfo {
    /// RDMA device name (`mlx5_0`, `rxeA0`).
    pub device: String,
    /// Port number (1-based).
    pub port: u8,
    /// Port state word (`ACTIVE`, `DOWN`, …) from `ports/<p>/state` (`4: ACTIVE`).
    pub state: String,
    /// Physical state word (`LinkUp`, `Disabled`, `Polling`, …) from
    /// `ports/<p>/phys_state` (`5: LinkUp`); None when the file is not there.
    pub phys_state: Option<String>,
    /// `Ethernet`, `InfiniBand`, or what the file says.
    pub link_layer: String,
    /// The RoCE active MTU derived from the netdev MTU (the largest IB MTU that fits a frame
    /// with RoCEv2 headers); None on InfiniBand or without a netdev.
    pub active_mtu: Option<u32>,
    /// The Ethernet netdev of the port.
    pub netdev: Option<String>,
    /// Its IPv4 addresses.
    pub ipv4: Vec<Ipv4If>,
    /// `device/numa_node`: None when the file does not exist (Soft-RoCE), -1 when the
    /// platform does not say.
    pub numa_node: Option<i32>,
    /// `parent` (Soft-RoCE devices name their netdev there).
    pub parent: Option<String>,
    /// The non-empty GID table entries.
    #[serde(skip)]
    pub gids: Vec<GidEntry>,
    /// Netdev of each GID entry, by index (`gid_attrs/ndevs/<i>`).
    #[serde(skip)]
    pub gid_ndevs: BTreeMap<u32, String>,
    /// The netdev carries the host's default route (a management interface).
    pub default_route: bool,
}

impl PortInfo {
    /// `device:port`.
    pub fn name(&self) -> String {
        format!("{}:{}", self.device, self.port)
    }

    /// True when the state is ACTIVE.
    pub fn is_active(&self) -> bool {
        self.state == "ACTIVE"
    }
}

/// What discovery found on a host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HostView {
    /// Every port of every RDMA device, sorted by device (natural order) and port.
    pub ports: Vec<PortInfo>,
    /// Interfaces that carry a default route (`proc/net/route`).
    pub default_route_ifaces: Vec<String>,
    /// Where the devices were looked for.
    pub searched: String,
}

/// Parse a sysfs GID (`fe80:0000:…:0001`, 8 groups of 4 hex digits).
pub fn parse_sysfs_gid(s: &str) -> Option<Gid> {
    s.trim().parse::<Ipv6Addr>().ok().map(|ip| Gid(ip.octets()))
}

/// Interfaces with a default route in a `/proc/net/route` text.
pub fn default_route_ifaces(route: &str) -> Vec<String> {
    let mut out: Vec<String> = route
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            (f.len() >= 8 && f[1] == "00000000" && f[7] == "00000000").then(|| f[0].to_owned())
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The RoCE active MTU for a netdev MTU (what mlx5 and rxe report): the largest IB MTU
/// that still fits in one Ethernet frame with the RoCEv2 headers.
pub fn roce_mtu_for_netdev_mtu(netdev_mtu: u32) -> Option<u32> {
    const OVERHEAD: u32 = 100; // Ethernet + IPv4/UDP + BTH/RETH + ICRC, rounded up
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|&m| m + OVERHEAD <= netdev_mtu)
}

/// Discover every RDMA port under `root`.
///
/// # Errors
/// None for a host without RDMA (no `sys/class/infiniband`: no ports); an error only when
/// a directory that exists cannot be listed.
pub fn discover(root: &SysfsRoot, addrs: &AddrSource) -> io::Result<HostView> {
    discover_gids_of(root, addrs, |_, _| true)
}

/// [`discover`], reading the GID tables only of the ports `gids_of(device, port)` names;
/// the other ports come with no GIDs (so no usable GID, and possibly no netdev). For a
/// caller that will use only those ports (an agent given `devices`): reading a GID table
/// is one file per entry, up to thousands a device.
///
/// # Errors
/// As [`discover`].
pub fn discover_gids_of(
    root: &SysfsRoot,
    addrs: &AddrSource,
    gids_of: impl Fn(&str, u8) -> bool,
) -> io::Result<HostView> {
    let ib = "sys/class/infiniband";
    let defaults = root
        .read("proc/net/route")
        .map(|r| default_route_ifaces(&r))
        .unwrap_or_default();
    let mut view = HostView {
        ports: Vec::new(),
        default_route_ifaces: defaults.clone(),
        searched: root.join(ib).display().to_string(),
    };
    let devices = match root.list(ib) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(view),
        Err(e) => return Err(e),
    };
    let addr_map = addrs.load()?;
    for dev in devices {
        let base = format!("{ib}/{dev}");
        let numa_node = root
            .read(&format!("{base}/device/numa_node"))
            .and_then(|s| s.parse().ok());
        let parent = root.read(&format!("{base}/parent"));
        let dev_netdevs = root.list(&format!("{base}/device/net")).unwrap_or_default();
        let Ok(ports) = root.list(&format!("{base}/ports")) else {
            continue;
        };
        for p in ports {
            let Ok(port) = p.parse::<u8>() else { continue };
            let pb = format!("{base}/ports/{port}");
            let state = root
                .port_state(&dev, port)
                .unwrap_or_else(|| "UNKNOWN".into());
            let phys_state = root.read(&format!("{pb}/phys_state")).map(|s| {
                s.split_once(':')
                    .map_or(s.as_str(), |(_, w)| w)
                    .trim()
                    .to_owned()
            });
            let link_layer = root
                .read(&format!("{pb}/link_layer"))
                .unwrap_or_else(|| "unknown".into());
            let ethernet = link_layer == "Ethernet";
            let mut gids = Vec::new();
            let mut gid_ndevs = BTreeMap::new();
            let table = if gids_of(&dev, port) {
                root.list(&format!("{pb}/gids")).unwrap_or_default()
            } else {
                Vec::new()
            };
            for i in table {
                let Ok(index) = i.parse::<u32>() else {
                    continue;
                };
                let Some(gid) = root
                    .read(&format!("{pb}/gids/{index}"))
                    .and_then(|g| parse_sysfs_gid(&g))
                else {
                    continue;
                };
                if gid.is_zero() {
                    continue;
                }
                let t = root
                    .read(&format!("{pb}/gid_attrs/types/{index}"))
                    .unwrap_or_default();
                let gid_type = match (t.as_str(), ethernet) {
                    ("RoCE v2", _) => GidType::RoceV2,
                    (_, true) => GidType::RoceV1,
                    (_, false) => GidType::Ib,
                };
                if let Some(nd) = root
                    .read(&format!("{pb}/gid_attrs/ndevs/{index}"))
                    .filter(|s| !s.is_empty())
                {
                    gid_ndevs.insert(index, nd);
                }
                gids.push(GidEntry {
                    index,
                    gid,
                    gid_type,
                    ndev_ifindex: 0,
                });
            }
            gids.sort_by_key(|g| g.index);
            // The port's netdev: what its GIDs name, else the device's net/ dir (one port
            // per netdev on multi-port devices: port order), else rxe's `parent`.
            let netdev = if ethernet {
                gid_ndevs
                    .values()
                    .next()
                    .cloned()
                    .or_else(|| {
                        dev_netdevs
                            .get(usize::from(port).saturating_sub(1))
                            .cloned()
                    })
                    .or_else(|| parent.clone())
            } else {
                None
            };
            let active_mtu = netdev
                .as_ref()
                .and_then(|n| root.read(&format!("sys/class/net/{n}/mtu")))
                .and_then(|m| m.parse().ok())
                .and_then(roce_mtu_for_netdev_mtu);
            let ipv4 = netdev
                .as_ref()
                .and_then(|n| addr_map.get(n))
                .cloned()
                .unwrap_or_default();
            let default_route = netdev.as_ref().is_some_and(|n| defaults.contains(n));
            view.ports.push(PortInfo {
                device: dev.clone(),
                port,
                state,
                phys_state,
                link_layer,
                active_mtu,
                netdev,
                ipv4,
                numa_node,
                parent: parent.clone(),
                gids,
                gid_ndevs,
                default_route,
            });
        }
    }
    Ok(view)
}

/// The NUMA node of a PCI device (an accelerator), from `sys/bus/pci/devices/<bdf>/numa_node`.
///
/// # Errors
/// [`NumaNodeError`], naming the file, when it is missing or not a number.
pub fn pci_numa_node(root: &SysfsRoot, bdf: &str) -> Result<i32, NumaNodeError> {
    let rel = format!("sys/bus/pci/devices/{bdf}/numa_node");
    let text = root
        .read(&rel)
        .ok_or_else(|| NumaNodeError::Unreadable(root.join(&rel)))?;
    text.parse().map_err(|_| NumaNodeError::NotANumber {
        path: root.join(&rel),
        text,
    })
}

/// A PCI device's NUMA node that cannot be read ([`pci_numa_node`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NumaNodeError {
    /// The file is missing or unreadable (no such device).
    #[error("cannot read {}", .0.display())]
    Unreadable(std::path::PathBuf),
    /// It holds something other than a number.
    #[error("{}: {text:?} is not a NUMA node", path.display())]
    NotANumber {
        /// The file.
        path: std::path::PathBuf,
        /// What it holds.
        text: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn natural_order() {
        let mut v = vec!["mlx5_10", "mlx5_2", "mlx5_1", "rxeB0", "rxeA1", "rxeA0"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            ["mlx5_1", "mlx5_2", "mlx5_10", "rxeA0", "rxeA1", "rxeB0"]
        );
    }

    /// The allocation-free comparison orders every pair as the key-building one it replaced
    /// (runs of text and number as owned strings), on names from a small alphabet that
    /// makes ties, leading zeros, numbers past u64, non-ASCII text and empty names common.
    #[test]
    fn natural_order_matches_the_key_building_comparison() {
        fn old_key(s: &str) -> Vec<(String, u64)> {
            let (mut out, mut text, mut num) = (Vec::new(), String::new(), String::new());
            for c in s.chars() {
                if c.is_ascii_digit() {
                    num.push(c);
                } else {
                    if !num.is_empty() {
                        out.push((std::mem::take(&mut text), num.parse().unwrap_or(u64::MAX)));
                        num.clear();
                    }
                    text.push(c);
                }
            }
            let last = if num.is_empty() {
                0
            } else {
                num.parse().unwrap_or(u64::MAX)
            };
            out.push((text, last));
            out
        }
        let alphabet = [
            "",
            "0",
            "1",
            "9",
            "00",
            "10",
            "a",
            "_",
            "é",
            "99999999999999999999",
        ];
        let mut names = Vec::new();
        for x in alphabet {
            for y in alphabet {
                for z in ["", "0", "b", "2"] {
                    names.push(format!("{x}{y}{z}"));
                }
            }
        }
        for a in &names {
            for b in &names {
                let old = old_key(a).cmp(&old_key(b)).then_with(|| a.cmp(b));
                assert_eq!(natural_cmp(a, b), old, "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn default_route_parsing() {
        let route =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                     eno1\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                     eno1\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                     ens1f0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(default_route_ifaces(route), ["eno1"]);
        assert!(default_route_ifaces("Iface\tDestination\n").is_empty());
    }

    #[test]
    fn sysfs_gid_format() {
        let g = parse_sysfs_gid("0000:0000:0000:0000:0000:ffff:c612:0001").unwrap();
        assert_eq!(g.ipv4(), Some(Ipv4Addr::new(198, 18, 0, 1)));
        assert!(parse_sysfs_gid("zz").is_none());
    }

    #[test]
    fn roce_mtu() {
        assert_eq!(roce_mtu_for_netdev_mtu(9000), Some(4096));
        assert_eq!(roce_mtu_for_netdev_mtu(1500), Some(1024));
        assert_eq!(roce_mtu_for_netdev_mtu(4200), Some(4096));
        assert_eq!(roce_mtu_for_netdev_mtu(200), None);
    }
}
