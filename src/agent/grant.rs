//! Grants: revocable remote access to parts of fenced regions.
//!
//! A region registered [fenced](super::register::MemRegion::fenced) is never reachable through its
//! own keys. Its owner hands a peer a [`Grant`] for the ranges the peer may READ or WRITE
//! (a request's blocks) and revokes it when the memory is given back (completion, lease
//! expiry, abort). From the moment [`Agent::revoke`] returns, nothing issued under the old
//! grant touches the memory:
//! - on verbs each range has its own remote key per rail (a `RangeKey`: a registration of
//!   just that range), deregistered on revocation, so the NIC itself refuses a late READ or
//!   WRITE with a remote access error, which the peer reports as
//!   [`XferError::GrantRevoked`](super::error::XferError::GrantRevoked);
//! - on TCP the target checks the grant for every chunk and copies fenced bytes under the
//!   grant's gate, which revocation closes after the copies in progress (memory copies,
//!   never a socket wait) are done; a refused chunk fails the transfer with the same error.
//!
//! The peer side keeps the grants it was given per peer ([`Agent::accept_grant`]) and
//! names fenced memory with ordinary descriptors: the agent finds the grant that covers each
//! one and uses its keys.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

use super::{error::AgentError, xfer::Desc};

/// The most ranges one grant may hold (a decoded token with more is refused).
pub const MAX_GRANT_RANGES: usize = 1 << 16;

/// What the TCP target's refusals start with; the initiator reports them as
/// [`XferError::GrantRevoked`](super::error::XferError::GrantRevoked).
pub(crate) const REVOKED: &str = "grant revoked: ";

/// A grant as its owner hands it to a peer (serializable with [`Grant::encode`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Its id (random, never 0).
    pub id: u64,
    /// The agent that made it (whose memory it opens).
    pub owner: String,
    /// Peers may READ the ranges.
    pub read: bool,
    /// Peers may WRITE the ranges.
    pub write: bool,
    /// The ranges, each with its remote key per rail of the owner (empty on TCP).
    pub ranges: Vec<GrantRange>,
}

/// One range of a grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantRange {
    /// The owner's region.
    pub region: u32,
    /// Offset in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Remote key per rail, in the owner's `rails` order (empty on TCP).
    pub rkeys: Vec<u32>,
}

impl Grant {
    /// The token's bytes (msgpack).
    pub fn encode(&self) -> Vec<u8> {
        // a plain struct of integers, strings and vectors always serializes
        rmp_serde::to_vec(self).unwrap_or_default()
    }

    /// Parse a token.
    ///
    /// # Errors
    /// [`AgentError::InvalidGrant`]: it does not decode, has id 0, no rights, no ranges or
    /// too many, or a range that is empty or wraps.
    pub fn decode(b: &[u8]) -> Result<Self, AgentError> {
        let g: Self = rmp_serde::from_slice(b)
            .map_err(|e| AgentError::InvalidGrant(format!("undecodable token: {e}")))?;
        let bad = |why: String| Err(AgentError::InvalidGrant(why));
        if g.id == 0 {
            return bad("id 0".into());
        }
        if !g.read && !g.write {
            return bad("it gives no rights".into());
        }
        if g.ranges.is_empty() || g.ranges.len() > MAX_GRANT_RANGES {
            return bad(format!(
                "{} ranges (1..={MAX_GRANT_RANGES})",
                g.ranges.len()
            ));
        }
        if let Some(r) = g
            .ranges
            .iter()
            .find(|r| r.len == 0 || r.offset.checked_add(r.len).is_none())
        {
            return bad(format!(
                "range [{}, +{}) of region {} is empty or wraps",
                r.offset, r.len, r.region
            ));
        }
        Ok(g)
    }

    /// The range that holds `[offset, offset + len)` of `region`, if any.
    pub fn covering(&self, region: u32, offset: u64, len: u64) -> Option<&GrantRange> {
        let end = offset.checked_add(len)?;
        self.ranges
            .iter()
            .find(|r| r.region == region && r.offset <= offset && end <= r.offset + r.len)
    }

    /// True when it gives the right `write` (else READ) needs.
    pub fn allows(&self, write: bool) -> bool {
        if write {
            self.write
        } else {
            self.read
        }
    }
}

/// A live grant, on its owner.
pub(crate) struct Held {
    pub(crate) read: bool,
    pub(crate) write: bool,
    pub(crate) ranges: Vec<(u32, u64, u64)>,
    /// Open (true) until revoked; TCP copies of fenced bytes hold it for reading.
    pub(crate) gate: Arc<RwLock<bool>>,
    /// Each range's key on each rail (verbs): revocation deregisters them.
    #[cfg(feature = "verbs")]
    pub(crate) _keys: Vec<crate::transport::verbs::RangeKey>,
}

impl Held {
    pub(crate) fn covers(&self, region: u32, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| {
            self.ranges
                .iter()
                .any(|&(r, o, l)| r == region && o <= offset && end <= o + l)
        })
    }
}

/// `descs` as ranges: sorted, and joined where they touch or overlap in one region.
pub(crate) fn merge(descs: &[Desc]) -> Vec<(u32, u64, u64)> {
    let mut v: Vec<(u32, u64, u64)> = descs
        .iter()
        .filter(|d| d.len > 0)
        .map(|d| (d.region.0, d.offset, d.len))
        .collect();
    v.sort_unstable();
    let mut out: Vec<(u32, u64, u64)> = Vec::with_capacity(v.len());
    for (r, o, l) in v {
        match out.last_mut() {
            Some((lr, lo, ll)) if *lr == r && o <= *lo + *ll => {
                *ll = (*ll).max(o + l - *lo);
            }
            _ => out.push((r, o, l)),
        }
    }
    out
}

/// Grants on an agent: the ones it made (by id) and the ones peers gave it (by peer).
#[derive(Default)]
pub(crate) struct Grants {
    pub(crate) made: HashMap<u64, Held>,
    pub(crate) given: HashMap<String, HashMap<u64, Arc<Grant>>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::region::RegionId;

    #[test]
    fn ranges_are_sorted_and_joined_where_they_touch() {
        let d = |r, o, l| Desc::new(RegionId(r), o, l);
        let m = merge(&[
            d(1, 100, 50),
            d(0, 0, 10),
            d(1, 150, 10),
            d(1, 120, 5),
            d(1, 400, 1),
            d(0, 20, 0),
        ]);
        assert_eq!(m, vec![(0, 0, 10), (1, 100, 60), (1, 400, 1)]);
    }

    #[test]
    fn tokens_round_trip_and_bad_ones_are_refused() {
        let g = Grant {
            id: 7,
            owner: "p".into(),
            read: true,
            write: false,
            ranges: vec![GrantRange {
                region: 1,
                offset: 4096,
                len: 8192,
                rkeys: vec![0x11, 0x22],
            }],
        };
        assert_eq!(Grant::decode(&g.encode()).unwrap(), g);
        assert!(g.covering(1, 4096, 8192).is_some());
        assert!(g.covering(1, 4095, 2).is_none());
        assert!(g.covering(1, 12287, 2).is_none());
        assert!(g.covering(2, 4096, 1).is_none());
        assert!(g.covering(1, u64::MAX, 2).is_none());
        for bad in [
            Grant { id: 0, ..g.clone() },
            Grant {
                read: false,
                ..g.clone()
            },
            Grant {
                ranges: vec![],
                ..g.clone()
            },
            Grant {
                ranges: vec![GrantRange {
                    offset: u64::MAX,
                    ..g.ranges[0].clone()
                }],
                ..g.clone()
            },
        ] {
            let e = Grant::decode(&bad.encode()).unwrap_err();
            assert!(matches!(e, AgentError::InvalidGrant(_)), "{e}");
        }
        assert!(matches!(
            Grant::decode(b"\xc1junk"),
            Err(AgentError::InvalidGrant(_))
        ));
    }
}
