//! IPv4 addresses of network interfaces: from the system (`getifaddrs`) or, for fixture
//! trees, from a file `ipv4_addrs` at the fixture root (lines `NETDEV A.B.C.D/PREFIX`).

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::{Serialize, Serializer};

/// An interface address with its prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ipv4If {
    /// The address.
    pub addr: Ipv4Addr,
    /// Prefix length (0–32).
    pub prefix: u8,
}

impl Ipv4If {
    /// True when `other` is in the same subnet (by this address's prefix).
    pub fn same_subnet(&self, other: Ipv4Addr) -> bool {
        let mask = if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.prefix.min(32)))
        };
        u32::from(self.addr) & mask == u32::from(other) & mask
    }
}

impl fmt::Display for Ipv4If {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl std::str::FromStr for Ipv4If {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s.split_once('/').unwrap_or((s, "32"));
        let addr = a
            .parse()
            .map_err(|_| format!("{s:?}: not an IPv4 address"))?;
        let prefix = p
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| format!("{s:?}: bad prefix length"))?;
        Ok(Self { addr, prefix })
    }
}

impl Serialize for Ipv4If {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Where interface addresses come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddrSource {
    /// The running system (`getifaddrs`).
    System,
    /// A fixture file (a missing file means: no addresses).
    File(PathBuf),
}

impl AddrSource {
    /// The system for the root `/`, otherwise `ROOT/ipv4_addrs`.
    pub fn for_root(root: &super::SysfsRoot) -> Self {
        if root.is_system() {
            Self::System
        } else {
            Self::File(root.join("ipv4_addrs"))
        }
    }

    /// Addresses by interface name, each list sorted.
    ///
    /// # Errors
    /// `getifaddrs` failing, an unreadable file, or a malformed line (naming it).
    pub fn load(&self) -> io::Result<BTreeMap<String, Vec<Ipv4If>>> {
        let mut map: BTreeMap<String, Vec<Ipv4If>> = BTreeMap::new();
        match self {
            Self::System => {
                for ifa in nix::ifaddrs::getifaddrs().map_err(io::Error::from)? {
                    let Some(sin) = ifa.address.as_ref().and_then(|a| a.as_sockaddr_in()) else {
                        continue;
                    };
                    let prefix = ifa
                        .netmask
                        .as_ref()
                        .and_then(|m| m.as_sockaddr_in())
                        .map_or(32, |m| u32::from(m.ip()).count_ones() as u8);
                    map.entry(ifa.interface_name.clone())
                        .or_default()
                        .push(Ipv4If {
                            addr: sin.ip(),
                            prefix,
                        });
                }
            }
            Self::File(path) => {
                let text = match std::fs::read_to_string(path) {
                    Ok(t) => t,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
                    Err(e) => return Err(e),
                };
                for (n, line) in text.lines().enumerate() {
                    let line = line.trim();
                    if line.is_empty() || line.starts_with('#') {
                        continue;
                    }
                    let bad = |why: String| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("{}:{}: {why}", path.display(), n + 1),
                        )
                    };
                    let (dev, addr) = line
                        .split_once(char::is_whitespace)
                        .ok_or_else(|| bad("expected `NETDEV ADDR/PREFIX`".into()))?;
                    map.entry(dev.to_owned())
                        .or_default()
                        .push(addr.trim().parse().map_err(bad)?);
                }
            }
        }
        for v in map.values_mut() {
            v.sort();
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_subnets() {
        let a: Ipv4If = "198.18.1.1/24".parse().unwrap();
        assert_eq!(a.to_string(), "198.18.1.1/24");
        assert!(a.same_subnet(Ipv4Addr::new(198, 18, 1, 2)));
        assert!(!a.same_subnet(Ipv4Addr::new(198, 18, 0, 2)));
        assert!("1.2.3.4/33".parse::<Ipv4If>().is_err());
        assert_eq!("10.0.0.1".parse::<Ipv4If>().unwrap().prefix, 32);
    }

    #[test]
    fn system_addresses_include_loopback() {
        let m = AddrSource::System.load().unwrap();
        assert!(m.values().flatten().any(|a| a.addr.is_loopback()), "{m:?}");
    }
}
