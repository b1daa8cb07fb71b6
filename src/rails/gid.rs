//! GIDs and the choice of the GID a RoCE queue pair uses.
//!
//! On RoCE every port has a GID table with one entry per (address, RoCE version). kvrail
//! uses RoCEv2 over IPv4: the entry whose type is RoCEv2 *and* whose GID is an IPv4-mapped
//! address (`::ffff:a.b.c.d`). Choosing "the first RoCEv2 entry" is wrong: Soft-RoCE also
//! types the link-local `fe80::` entry at index 0 as RoCEv2, and a QP addressed with it
//! fails to reach RTR ("network unreachable").

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

/// A 128-bit GID in network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4 address, if this GID is IPv4-mapped (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// True for the all-zero GID (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4-mapped GID of `ip`.
    pub fn from_ipv4(ip: Ipv4Addr) -> Self {
        Self(ip.to_ipv6_mapped().octets())
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ipv4() {
            Some(ip) => write!(f, "::ffff:{ip}"),
            None => write!(f, "{}", Ipv6Addr::from(self.0)),
        }
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The type of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GidType {
    /// InfiniBand GID.
    Ib,
    /// RoCE v1 (Ethernet L2).
    RoceV1,
    /// RoCE v2 (UDP/IP).
    RoceV2,
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ib => "IB",
            Self::RoceV1 => "RoCE v1",
            Self::RoceV2 => "RoCE v2",
        })
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (what a QP's `sgid_index` names).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// Interface index of the netdev the entry belongs to (0 on InfiniBand).
    pub ndev_ifindex: u32,
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE).
    Ethernet,
    /// Unspecified (old drivers; treated as InfiniBand by libibverbs).
    Unspecified,
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InfiniBand => "InfiniBand",
            Self::Ethernet => "Ethernet",
            Self::Unspecified => "unspecified",
        })
    }
}

/// The GID chosen for a port, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidChoice {
    /// Table index.
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// One line that says which entry was taken and why (for logs and `kvrail-rails`).
    pub reason: String,
}

/// Choose the GID a queue pair on this port uses.
///
/// - Ethernet (RoCE): the RoCEv2 entry with an IPv4-mapped GID; with `want_ip`, the one of
///   that address; otherwise the lowest such index.
/// - InfiniBand: the IB GID at the lowest non-zero index (normally 0).
///
/// # Errors
/// A one-line reason listing what the table holds when nothing fits.
pub fn select_gid(
    link: LinkLayer,
    entries: &[GidEntry],
    want_ip: Option<Ipv4Addr>,
) -> Result<GidChoice, String> {
    let mut sorted: Vec<&GidEntry> = entries.iter().filter(|e| !e.gid.is_zero()).collect();
    sorted.sort_by_key(|e| e.index);
    if link != LinkLayer::Ethernet {
        return sorted
            .iter()
            .find(|e| e.gid_type == GidType::Ib)
            .map(|e| GidChoice {
                index: e.index,
                gid: e.gid,
                gid_type: e.gid_type,
                reason: format!("GID[{}] {} ({} link layer, IB GID)", e.index, e.gid, link),
            })
            .ok_or_else(|| format!("no IB GID in the table ({})", describe(&sorted)));
    }
    let candidates: Vec<&&GidEntry> = sorted
        .iter()
        .filter(|e| e.gid_type == GidType::RoceV2 && e.gid.ipv4().is_some())
        .collect();
    let pick = match want_ip {
        Some(ip) => candidates.iter().find(|e| e.gid.ipv4() == Some(ip)),
        None => candidates.first(),
    };
    match pick {
        Some(e) => Ok(GidChoice {
            index: e.index,
            gid: e.gid,
            gid_type: e.gid_type,
            reason: format!(
                "GID[{}] {} (RoCE v2, IPv4{})",
                e.index,
                e.gid,
                if candidates.len() > 1 {
                    format!(", lowest of {} IPv4 RoCEv2 entries", candidates.len())
                } else {
                    String::new()
                }
            ),
        }),
        None => Err(match want_ip {
            Some(ip) if !candidates.is_empty() => {
                format!("no RoCEv2 GID for {ip} (table: {})", describe(&sorted))
            }
            _ if !sorted.is_empty() && sorted.iter().all(|e| e.gid_type == GidType::RoceV1) => {
                if sorted.iter().any(|e| e.gid.ipv4().is_some()) {
                    format!(
                        "no RoCE v2 GID (the netdev's address is there; the port's GID table \
                         offers only RoCE v1: {}); enable RoCE v2 on the NIC",
                        describe(&sorted)
                    )
                } else {
                    format!(
                        "no RoCE v2 GID (the port's GID table offers only RoCE v1: {}); enable \
                         RoCE v2 on the NIC and give the netdev an IPv4 address",
                        describe(&sorted)
                    )
                }
            }
            _ => format!(
                "no RoCEv2 GID with an IPv4 address (table: {}); give the netdev an IPv4 address",
                describe(&sorted)
            ),
        }),
    }
}

fn describe(entries: &[&GidEntry]) -> String {
    if entries.is_empty() {
        return "empty".into();
    }
    entries
        .iter()
        .map(|e| format!("[{}] {} {}", e.index, e.gid, e.gid_type))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid: &str, gid_type: GidType) -> GidEntry {
        let ip: Ipv6Addr = gid.parse().unwrap();
        GidEntry {
            index,
            gid: Gid(ip.octets()),
            gid_type,
            ndev_ifindex: 3,
        }
    }

    /// The table Soft-RoCE builds for an IPv4-only netdev: [0] link-local typed RoCEv2 too.
    fn rxe_table() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::ff:fec6:1201", GidType::RoceV2),
            entry(1, "::ffff:198.18.0.1", GidType::RoceV2),
        ]
    }

    #[test]
    fn rxe_picks_the_ipv4_entry_not_the_first_rocev2() {
        let c = select_gid(LinkLayer::Ethernet, &rxe_table(), None).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(c.gid.ipv4(), Some(Ipv4Addr::new(198, 18, 0, 1)));
        assert_eq!(c.reason, "GID[1] ::ffff:198.18.0.1 (RoCE v2, IPv4)");
    }

    #[test]
    fn mlx_table_with_v1_and_v2_per_address() {
        let t = vec![
            entry(0, "fe80::1", GidType::RoceV1),
            entry(1, "fe80::1", GidType::RoceV2),
            entry(2, "::ffff:10.0.0.5", GidType::RoceV1),
            entry(3, "::ffff:10.0.0.5", GidType::RoceV2),
            entry(4, "::ffff:10.1.0.5", GidType::RoceV1),
            entry(5, "::ffff:10.1.0.5", GidType::RoceV2),
        ];
        let c = select_gid(LinkLayer::Ethernet, &t, None).unwrap();
        assert_eq!(c.index, 3);
        assert!(c.reason.contains("lowest of 2"), "{}", c.reason);
        let c = select_gid(LinkLayer::Ethernet, &t, Some(Ipv4Addr::new(10, 1, 0, 5))).unwrap();
        assert_eq!(c.index, 5);
        let e = select_gid(LinkLayer::Ethernet, &t, Some(Ipv4Addr::new(10, 9, 9, 9))).unwrap_err();
        assert!(e.starts_with("no RoCEv2 GID for 10.9.9.9"), "{e}");
    }

    #[test]
    fn ipv6_only_port_has_no_usable_gid() {
        let t = vec![
            entry(0, "fe80::1", GidType::RoceV2),
            entry(1, "2001:db8::1", GidType::RoceV2),
        ];
        let e = select_gid(LinkLayer::Ethernet, &t, None).unwrap_err();
        assert_eq!(
            e,
            "no RoCEv2 GID with an IPv4 address (table: [0] fe80::1 RoCE v2, [1] 2001:db8::1 RoCE v2); \
             give the netdev an IPv4 address"
        );
    }

    #[test]
    fn rocev1_only_is_refused() {
        let t = vec![entry(0, "::ffff:10.0.0.5", GidType::RoceV1)];
        assert!(select_gid(LinkLayer::Ethernet, &t, None).is_err());
    }

    #[test]
    fn empty_and_zero_slots_are_ignored() {
        let t = vec![
            entry(0, "::", GidType::RoceV2),
            entry(7, "::ffff:10.0.0.9", GidType::RoceV2),
        ];
        assert_eq!(select_gid(LinkLayer::Ethernet, &t, None).unwrap().index, 7);
        assert_eq!(
            select_gid(LinkLayer::Ethernet, &[], None).unwrap_err(),
            "no RoCEv2 GID with an IPv4 address (table: empty); give the netdev an IPv4 address"
        );
    }

    #[test]
    fn infiniband_takes_the_ib_gid() {
        let t = vec![entry(0, "fe80::2:c903:a:1b2c", GidType::Ib)];
        let c = select_gid(LinkLayer::InfiniBand, &t, None).unwrap();
        assert_eq!(c.index, 0);
        assert!(c.reason.contains("InfiniBand link layer"));
    }

    #[test]
    fn gid_display() {
        assert_eq!(
            Gid::from_ipv4(Ipv4Addr::new(198, 18, 1, 2)).to_string(),
            "::ffff:198.18.1.2"
        );
        assert_eq!(format!("{:?}", Gid([0; 16])), "Gid(::)");
    }
}
