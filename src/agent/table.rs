//! The transfer table, sans-IO: every rule about a transfer's life that does not touch a
//! socket, a queue pair or a clock — validating descriptor lists against local regions and
//! the peer's metadata, the states (not posted → in progress → done or failed, reposted
//! after either), which regions a posted transfer holds busy, counting a READ's bytes in,
//! and *notify after data*: a transfer's notification is handed out only when its last byte
//! is in place and before the transfer is marked done (an engine that sees it done may
//! release it at once). The backends feed it what happened (`arrived`, `finish`,
//! `peer_lost`); the agent reads what to do (`completion_notif`, released regions).
//! `tests.rs` drives two agents' tables through a virtual-time network with injected
//! completions, errors and rail loss.

use super::metadata::AgentMetadata;
use super::{
    error::AgentError, error::XferError, region::RegionId, xfer::Desc, xfer::XferId, xfer::XferOp,
    xfer::XferStatus,
};
use crate::idhash::IdMap;

/// A region a posted transfer holds busy.
pub(crate) trait Held: Clone {
    /// Its id.
    fn region_id(&self) -> RegionId;
}

/// One transfer.
pub(crate) struct Entry<R> {
    pub(crate) op: XferOp,
    pub(crate) peer: std::sync::Arc<str>,
    /// The peer's connection epoch when the transfer was made.
    pub(crate) peer_epoch: u64,
    pub(crate) local: Vec<Desc>,
    pub(crate) remote: std::sync::Arc<[Desc]>,
    pub(crate) notif: Option<Vec<u8>>,
    pub(crate) status: XferStatus,
    /// READ: bytes still to arrive.
    remaining: u64,
    /// READ on TCP: the next byte expected of each local descriptor (its chunks come in
    /// order on one connection), so a repeated or skipped chunk cannot complete it.
    cursors: Vec<u64>,
    /// WRITE on TCP: its end is on its way to the peer (set before it is sent), so the
    /// peer's Ack may complete it; an Ack before that is a protocol error.
    end_sent: bool,
    /// Regions held busy while in progress.
    pub(crate) held: Vec<R>,
}

/// What a READ's arriving bytes mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// The transfer is not in progress (failed, released, reposted): drop them.
    Stale,
    /// More to come.
    More,
    /// The last byte: send the notification (`completion_notif`), then `finish`.
    Complete,
    /// Bytes the transfer did not ask for there (a chunk repeated, skipped or outside the
    /// descriptor, or a READ's bytes for a WRITE): a protocol error of the peer's.
    Unasked,
}

/// What a peer's Ack of a transfer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ack {
    /// The transfer is not in progress (failed, released, reposted): ignore it.
    Stale,
    /// A WRITE whose end was sent: it is done.
    Complete,
    /// A READ (completed by its bytes, never by an Ack): a protocol error.
    NotAWrite,
    /// A WRITE whose end was not sent yet: a protocol error.
    Early,
}

/// Every transfer of an agent.
pub(crate) struct XferTable<R> {
    xfers: IdMap<u64, Entry<R>>,
    next: u64,
}

impl<R: Held> Default for XferTable<R> {
    fn default() -> Self {
        Self {
            xfers: IdMap::default(),
            next: 1,
        }
    }
}

/// Check a transfer's descriptor lists: equal counts, pairwise equal lengths, local ones
/// inside registered regions (`local_len` gives a region's length), remote ones inside the
/// regions `meta` advertises, with the remote access `op` needs.
///
/// # Errors
/// [`AgentError::LengthMismatch`]; [`AgentError::InvalidDesc`] naming the side, the index
/// and what is wrong.
pub(crate) fn validate(
    op: XferOp,
    local: &[Desc],
    remote: &[Desc],
    meta: &AgentMetadata,
    local_len: impl Fn(RegionId) -> Option<u64>,
) -> Result<(), AgentError> {
    if local.len() != remote.len() {
        return Err(AgentError::LengthMismatch {
            local: local.len(),
            remote: remote.len(),
        });
    }
    let peer = meta.name();
    // descriptors come in runs over one region: look each region up once per run
    let mut last_local: Option<(RegionId, Option<u64>)> = None;
    let mut last_remote: Option<&super::metadata::RegionMeta> = None;
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        let bad = |side, reason| AgentError::InvalidDesc {
            side,
            index: i,
            reason,
        };
        if l.len != r.len {
            return Err(bad(
                "remote",
                format!("{} bytes, the local descriptor has {}", r.len, l.len),
            ));
        }
        let len = match last_local {
            Some((id, len)) if id == l.region => len,
            _ => {
                let len = local_len(l.region);
                last_local = Some((l.region, len));
                len
            }
        }
        .ok_or_else(|| bad("local", format!("region {} is not registered", l.region.0)))?;
        if l.offset.checked_add(l.len).is_none_or(|e| e > len) {
            return Err(bad(
                "local",
                format!(
                    "[{}, {}+{}) is outside region {} ({len} bytes)",
                    l.offset, l.offset, l.len, l.region.0
                ),
            ));
        }
        let rr = match last_remote {
            Some(m) if m.id == r.region.0 => m,
            _ => {
                let m = meta
                    .regions
                    .iter()
                    .find(|m| m.id == r.region.0)
                    .ok_or_else(|| {
                        bad(
                            "remote",
                            format!("peer {peer} advertised no region {}", r.region.0),
                        )
                    })?;
                last_remote = Some(m);
                m
            }
        };
        if r.offset.checked_add(r.len).is_none_or(|e| e > rr.len) {
            return Err(bad(
                "remote",
                format!(
                    "[{}, {}+{}) is outside {peer}'s region {} ({} bytes)",
                    r.offset, r.offset, r.len, r.region.0, rr.len
                ),
            ));
        }
        let (need, ok) = match op {
            XferOp::Read => ("READ", rr.remote_read),
            XferOp::Write => ("WRITE", rr.remote_write),
        };
        if !ok {
            return Err(bad(
                "remote",
                format!(
                    "{peer}'s region {} does not allow remote {need}",
                    r.region.0
                ),
            ));
        }
    }
    Ok(())
}

impl<R: Held> XferTable<R> {
    /// A new transfer (validated by the caller), not posted.
    pub(crate) fn create(
        &mut self,
        op: XferOp,
        (peer, peer_epoch): (&str, u64),
        local: Vec<Desc>,
        remote: Vec<Desc>,
        notif: Option<Vec<u8>>,
    ) -> XferId {
        let id = self.next;
        self.next += 1;
        self.xfers.insert(
            id,
            Entry {
                op,
                peer: peer.into(),
                peer_epoch,
                local,
                remote: remote.into(),
                notif,
                status: XferStatus::NotPosted,
                remaining: 0,
                cursors: Vec::new(),
                end_sent: false,
                held: Vec::new(),
            },
        );
        XferId(id)
    }

    /// Transfer `id`, when it may be posted.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`]; [`AgentError::Active`] while it is in progress.
    pub(crate) fn postable(&self, id: XferId) -> Result<&Entry<R>, AgentError> {
        let x = self.xfers.get(&id.0).ok_or(AgentError::NoXfer(id.0))?;
        if x.status == XferStatus::InProgress {
            return Err(AgentError::Active(id.0));
        }
        Ok(x)
    }

    /// The bytes transfer `id` moves (its local descriptors' lengths summed).
    pub(crate) fn bytes(&self, id: XferId) -> Option<u64> {
        let x = self.xfers.get(&id.0)?;
        Some(x.local.iter().map(|d| d.len).sum())
    }

    /// Post transfer `id`, holding `held` (the caller marked them busy) until it ends.
    ///
    /// # Errors
    /// As [`XferTable::postable`].
    pub(crate) fn begin(&mut self, id: XferId, held: Vec<R>) -> Result<&Entry<R>, AgentError> {
        self.postable(id)?;
        let x = self.xfers.get_mut(&id.0).ok_or(AgentError::NoXfer(id.0))?;
        x.held = held;
        x.status = XferStatus::InProgress;
        x.end_sent = false;
        x.cursors.clear();
        x.remaining = if x.op == XferOp::Read {
            x.cursors.resize(x.local.len(), 0);
            x.local.iter().map(|d| d.len).sum()
        } else {
            0
        };
        Ok(x)
    }

    /// Where transfer `id` stands.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub(crate) fn status(&self, id: XferId) -> Result<&XferStatus, AgentError> {
        self.xfers
            .get(&id.0)
            .map(|x| &x.status)
            .ok_or(AgentError::NoXfer(id.0))
    }

    /// Replace the notification transfer `id` sends when it next completes.
    ///
    /// # Errors
    /// As [`XferTable::postable`].
    pub(crate) fn set_notif(
        &mut self,
        id: XferId,
        notif: Option<Vec<u8>>,
    ) -> Result<(), AgentError> {
        self.postable(id)?;
        if let Some(x) = self.xfers.get_mut(&id.0) {
            x.notif = notif;
        }
        Ok(())
    }

    /// Forget transfer `id`.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`]; [`AgentError::Active`] while it is in progress.
    pub(crate) fn release(&mut self, id: XferId) -> Result<(), AgentError> {
        self.postable(id)?;
        self.xfers.remove(&id.0);
        Ok(())
    }

    /// `n` bytes of READ `id` arrived for its local descriptor `idx`, at `at` of it: they
    /// count only where that descriptor expects its next bytes.
    pub(crate) fn arrived(&mut self, id: u64, (idx, at): (u32, u64), n: u64) -> Arrival {
        let Some(x) = self.xfers.get_mut(&id) else {
            return Arrival::Stale;
        };
        if x.status != XferStatus::InProgress {
            return Arrival::Stale;
        }
        let i = idx as usize;
        let (Some(d), Some(next)) = (x.local.get(i), x.cursors.get(i)) else {
            return Arrival::Unasked;
        };
        let end = at.checked_add(n);
        if x.op != XferOp::Read || at != *next || end.is_none_or(|e| e > d.len) {
            return Arrival::Unasked;
        }
        x.cursors[i] = at + n;
        x.remaining -= n;
        if x.remaining == 0 {
            Arrival::Complete
        } else {
            Arrival::More
        }
    }

    /// WRITE `id`'s end is about to be sent: the peer's Ack may complete it from now on.
    pub(crate) fn end_sent(&mut self, id: u64) {
        if let Some(x) = self.xfers.get_mut(&id) {
            x.end_sent = true;
        }
    }

    /// What the peer's Ack of transfer `id` means.
    pub(crate) fn ack(&self, id: u64) -> Ack {
        match self.xfers.get(&id) {
            Some(x) if x.status == XferStatus::InProgress => match (x.op, x.end_sent) {
                (XferOp::Read, _) => Ack::NotAWrite,
                (XferOp::Write, false) => Ack::Early,
                (XferOp::Write, true) => Ack::Complete,
            },
            _ => Ack::Stale,
        }
    }

    /// True while transfer `id` is in progress.
    pub(crate) fn in_progress(&self, id: u64) -> bool {
        self.xfers
            .get(&id)
            .is_some_and(|x| x.status == XferStatus::InProgress)
    }

    /// The notification (and its peer) of in-progress transfer `id`, to send now that
    /// every byte is in place — before [`XferTable::finish`].
    /// (The peer is the transfer's shared name: a transfer without a notification made a
    /// copy of it, allocated and freed, on every completion.)
    pub(crate) fn completion_notif(&self, id: u64) -> Option<(std::sync::Arc<str>, Vec<u8>)> {
        let x = self.xfers.get(&id)?;
        if x.status != XferStatus::InProgress {
            return None;
        }
        Some((x.peer.clone(), x.notif.clone()?))
    }

    /// Transfer `id` ended: its status is set and the regions it held come back to be
    /// released. `None` when it was not in progress (a late or duplicate outcome).
    /// The operation of transfer `id`.
    pub(crate) fn op_of(&self, id: u64) -> Option<XferOp> {
        self.xfers.get(&id).map(|x| x.op)
    }

    pub(crate) fn finish(&mut self, id: u64, res: Result<(), XferError>) -> Option<Vec<R>> {
        let x = self.xfers.get_mut(&id)?;
        if x.status != XferStatus::InProgress {
            return None;
        }
        x.status = match res {
            Ok(()) => XferStatus::Done,
            Err(e) => XferStatus::Error(e),
        };
        Some(std::mem::take(&mut x.held))
    }

    /// The transfers in progress with `peer`.
    pub(crate) fn active_with(&self, peer: &str) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .xfers
            .iter()
            .filter(|(_, x)| *x.peer == *peer && x.status == XferStatus::InProgress)
            .map(|(id, _)| *id)
            .collect();
        v.sort_unstable();
        v
    }

    /// True when transfer `id` exists and was posted to a peer other than `peer`: an
    /// answer about it from `peer` is forged (or confused) and must not touch it.
    pub(crate) fn belongs_elsewhere(&self, id: u64, peer: &str) -> bool {
        self.xfers.get(&id).is_some_and(|x| *x.peer != *peer)
    }

    /// The local descriptor `idx` of READ `id` and the region it lies in, to copy arriving
    /// bytes into.
    pub(crate) fn read_target(&self, id: u64, idx: u32) -> Option<(R, u64, u64)> {
        let x = self.xfers.get(&id)?;
        let d = x.local.get(idx as usize)?;
        let r = x.held.iter().find(|h| h.region_id() == d.region)?.clone();
        Some((r, d.offset, d.len))
    }
}

#[cfg(test)]
pub(crate) mod tests;
