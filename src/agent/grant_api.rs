//! The grant API of [`Agent`]: grants made over fenced memory, revoked, accepted from peers
//! (the rules and the bookkeeping are in [`super::grant`]).

use std::sync::{Arc, RwLock};

use super::grant::{merge, Grant, GrantRange, Held, MAX_GRANT_RANGES};
use super::*;

impl Agent {
    /// Give peers `access` to the bytes of `descs` (local, in fenced regions) until
    /// [`Agent::revoke`]. Hand the returned [`Grant`] (e.g. [`Grant::encode`]) to the peer,
    /// which passes it to its [`Agent::accept_grant`]. Touching or overlapping descriptors
    /// are joined; on verbs each range gets a remote key per rail.
    ///
    /// # Errors
    /// [`AgentError::InvalidGrant`] (no rights asked, no bytes, a region that is not fenced
    /// or does not give the rights, too many ranges), [`AgentError::NoRegion`],
    /// [`AgentError::OutOfRange`]; [`AgentError::InvalidMemory`] when a key cannot be
    /// registered.
    pub fn grant(&self, descs: &[Desc], access: RemoteAccess) -> Result<Grant, AgentError> {
        if !access.read && !access.write {
            return Err(AgentError::InvalidGrant("no rights asked".into()));
        }
        let ranges = merge(descs);
        if ranges.is_empty() || ranges.len() > MAX_GRANT_RANGES {
            return Err(AgentError::InvalidGrant(format!(
                "{} ranges after joining (1..={MAX_GRANT_RANGES})",
                ranges.len()
            )));
        }
        #[cfg(feature = "verbs")]
        let mut keys = Vec::new();
        let mut out = Vec::with_capacity(ranges.len());
        for &(region, offset, len) in &ranges {
            let r = self.shared.region(region)?;
            if !r.fenced {
                return Err(AgentError::InvalidGrant(format!(
                    "region {region} is not fenced (its own keys already give access)"
                )));
            }
            if (access.read && !r.access.read) || (access.write && !r.access.write) {
                return Err(AgentError::InvalidGrant(format!(
                    "region {region} gives at most {:?}",
                    r.access
                )));
            }
            if offset.checked_add(len).is_none_or(|e| e > r.len()) {
                return Err(AgentError::OutOfRange {
                    region,
                    offset,
                    len,
                    size: r.len(),
                });
            }
            #[allow(unused_mut)]
            let mut rkeys = Vec::new();
            #[cfg(feature = "verbs")]
            if let (Some(v), Some(buf)) = (&self.shared.verbs, r.host()) {
                for k in v.range_keys(buf, offset, len, access)? {
                    rkeys.push(k.rkey());
                    keys.push(k);
                }
            }
            out.push(GrantRange {
                region,
                offset,
                len,
                rkeys,
            });
        }
        let id = loop {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b)
                .map_err(|e| AgentError::Unsupported(format!("no randomness for an id: {e}")))?;
            let id = u64::from_le_bytes(b);
            if id != 0 && !lock(&self.shared.grants).made.contains_key(&id) {
                break id;
            }
        };
        let held = Held {
            read: access.read,
            write: access.write,
            ranges,
            gate: Arc::new(RwLock::new(true)),
            #[cfg(feature = "verbs")]
            _keys: keys,
        };
        lock(&self.shared.grants).made.insert(id, held);
        self.shared.stats.grants_made.inc();
        tracing::debug!(agent = %self.shared.name, grant = id, ranges = out.len(), "grant made");
        Ok(Grant {
            id,
            owner: self.shared.name.clone(),
            read: access.read,
            write: access.write,
            ranges: out,
        })
    }

    /// Revoke grant `id`: when this returns, no READ or WRITE under it reaches the memory
    /// any more (the NIC refuses its keys; TCP copies under it have ended).
    ///
    /// # Errors
    /// [`AgentError::NoGrant`].
    pub fn revoke(&self, id: u64) -> Result<(), AgentError> {
        let held = lock(&self.shared.grants)
            .made
            .remove(&id)
            .ok_or(AgentError::NoGrant(id))?;
        self.shared.close_grant(held);
        tracing::debug!(agent = %self.shared.name, grant = id, "grant revoked");
        Ok(())
    }

    /// Grants this agent made that are not revoked.
    pub fn grants_live(&self) -> usize {
        lock(&self.shared.grants).made.len()
    }

    /// Keep `grant` from peer `peer` (loaded): descriptors naming the peer's fenced memory
    /// inside it use it from now on. A grant with the same id replaces the old one.
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`]; [`AgentError::InvalidGrant`] when it was made by
    /// another agent, or names regions the peer's metadata lacks, that are not fenced, that
    /// it lies outside of, or has a key count that does not match the peer's rails.
    pub fn accept_grant(&self, peer: &str, grant: Grant) -> Result<(), AgentError> {
        let meta = self
            .remote_metadata(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.into()))?;
        if grant.owner != peer {
            return Err(AgentError::InvalidGrant(format!(
                "made by {:?}, not by {peer:?}",
                grant.owner
            )));
        }
        let keys = if meta.backend == super::metadata::BackendKind::Verbs {
            meta.rails.len()
        } else {
            0
        };
        for g in &grant.ranges {
            let Some(m) = meta.regions.iter().find(|m| m.id == g.region) else {
                return Err(AgentError::InvalidGrant(format!(
                    "{peer} has no region {}",
                    g.region
                )));
            };
            if !m.fenced {
                return Err(AgentError::InvalidGrant(format!(
                    "region {} of {peer} is not fenced",
                    g.region
                )));
            }
            if g.offset.checked_add(g.len).is_none_or(|e| e > m.len) {
                return Err(AgentError::InvalidGrant(format!(
                    "[{}, +{}) lies outside region {} of {peer} ({} bytes)",
                    g.offset, g.len, g.region, m.len
                )));
            }
            if g.rkeys.len() != keys {
                return Err(AgentError::InvalidGrant(format!(
                    "{} keys for {keys} rails",
                    g.rkeys.len()
                )));
            }
        }
        lock(&self.shared.grants)
            .given
            .entry(peer.to_owned())
            .or_default()
            .insert(grant.id, Arc::new(grant));
        Ok(())
    }

    /// Drop grant `id` from `peer` (the request it was for is over). True when it was kept.
    pub fn forget_grant(&self, peer: &str, id: u64) -> bool {
        let mut g = lock(&self.shared.grants);
        let Some(m) = g.given.get_mut(peer) else {
            return false;
        };
        let had = m.remove(&id).is_some();
        if m.is_empty() {
            g.given.remove(peer);
        }
        had
    }
}
