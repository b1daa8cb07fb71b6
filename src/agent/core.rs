//! The agent's core: what it knows and the rules it keeps, with no socket, thread or clock
//! of its own — the registered regions, the transfer table (ending a transfer, a READ's
//! bytes counted in, notify after data), the grants over fenced memory, notifications (the
//! numbered ones put back in send order, each kind routed to its consumer) and the counters.
//! The drivers (the TCP data path, the verbs lanes, the control channel, the host bounce)
//! report to it what happened — `finish`, `read_arrival`, `deliver_notif`, `under_grant` —
//! and read from it what to do; none of them reaches the facade's state ([`super::Shared`]:
//! peers, connections, threads), which holds a `Core` and lends it to them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::error::{AgentError, XferError};
use super::grant::{Grant, Grants, Held, REVOKED};
use super::notifs::Ordered;
use super::region::{Region, RegionId};
use super::route::RouteQueue;
use super::stats::AgentStats;
use super::table::{self, XferTable};
use super::wake::Wake;
use super::xfer::Desc;
use crate::idhash::IdMap;
use crate::threads::lock;

/// A driver that takes some notifications for itself (the host bounce takes the messages
/// that start with its magic); the core asks it before the engine's queue.
pub(crate) trait NotifTap: Send + Sync {
    /// `bytes` from peer `from`: `None` when taken, else handed back.
    fn take(&self, from: &str, bytes: Vec<u8>) -> Option<Vec<u8>>;
}

/// The agent's state and rules without I/O (see the module docs).
pub(crate) struct Core {
    /// The agent's name.
    pub(crate) name: String,
    /// Registered regions by id (ids this agent hands out, so hashed as its own integers).
    pub(crate) regions: Mutex<IdMap<u32, Arc<Region>>>,
    pub(crate) next_region: Mutex<u32>,
    pub(crate) xfers: Mutex<XferTable<Arc<Region>>>,
    /// Signalled (with `xfers`) whenever a transfer leaves InProgress.
    pub(crate) xfer_done_cv: Wake,
    /// Transfers ended so far (bumped under the table's lock by `finish`): a polling waiter
    /// takes that lock only when this moved, instead of on every look, which kept the
    /// thread finishing transfers waiting for it.
    pub(crate) ended: AtomicU64,
    /// Signalled when a notification is queued.
    pub(crate) notif_cv: Wake,
    pub(crate) notifs: Mutex<VecDeque<(String, Vec<u8>)>>,
    /// Numbered notifications per target connection (see [`super::notifs`]).
    pub(crate) seqs: Mutex<IdMap<u64, Ordered>>,
    /// Consumers of one kind of notification each (see [`super::route`]).
    pub(crate) routes: Mutex<Vec<Arc<RouteQueue>>>,
    /// Grants made here and grants peers gave (see [`super::grant`]).
    pub(crate) grants: Mutex<Grants>,
    /// Payload bytes the CPU copied in transfers (see `Agent::payload_bytes_copied`).
    pub(crate) copied: AtomicU64,
    /// Counters and gauges (see [`crate::metrics`]).
    pub(crate) stats: AgentStats,
    /// The driver that takes its own notifications, once it runs.
    tap: OnceLock<Arc<dyn NotifTap>>,
}

impl Core {
    /// The core of agent `name`: nothing registered, no transfers.
    pub(crate) fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            regions: Mutex::new(IdMap::default()),
            next_region: Mutex::new(1),
            xfers: Mutex::new(XferTable::default()),
            xfer_done_cv: Wake::default(),
            ended: AtomicU64::new(0),
            notif_cv: Wake::default(),
            notifs: Mutex::new(VecDeque::new()),
            seqs: Mutex::new(IdMap::default()),
            routes: Mutex::new(Vec::new()),
            grants: Mutex::new(Grants::default()),
            copied: AtomicU64::new(0),
            stats: AgentStats::new(name),
            tap: OnceLock::new(),
        }
    }

    /// Hand the notifications `tap` takes to it from now on (set once).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn set_tap(&self, tap: Arc<dyn NotifTap>) {
        let _ = self.tap.set(tap);
    }

    pub(crate) fn region(&self, id: u32) -> Result<Arc<Region>, AgentError> {
        lock(&self.regions)
            .get(&id)
            .cloned()
            .ok_or(AgentError::NoRegion(id))
    }

    /// The notification (and its peer) of in-progress transfer `id`, looked up *before* the
    /// transfer is finished: once the engine sees it done it may release it at once, and a
    /// lookup after that would lose the notification.
    pub(crate) fn xfer_notif(&self, id: u64) -> Option<(Arc<str>, Vec<u8>)> {
        lock(&self.xfers).completion_notif(id)
    }

    /// A verbs transfer failed.
    #[cfg(feature = "verbs")]
    pub(crate) fn xfer_failed(&self, id: u64, why: String) {
        self.finish(id, Err(XferError::Rdma(why)));
    }

    /// A transfer ended: set its status and release its regions.
    pub(crate) fn finish(&self, id: u64, res: Result<(), XferError>) {
        let mut xfers = lock(&self.xfers);
        let op = xfers.op_of(id);
        let outcome = res.clone();
        if let Some(held) = xfers.finish(id, res) {
            if let Some(op) = op {
                self.stats.ended(&self.name, op, &outcome);
            }
            for r in held {
                r.release();
            }
            self.ended.fetch_add(1, Ordering::Release);
            self.xfer_done_cv.notify_all();
        }
    }

    /// `n` bytes of READ `id` came for its descriptor `idx` at `at` (see
    /// [`table::XferTable::arrived`]).
    pub(crate) fn read_arrival(&self, id: u64, at: (u32, u64), n: u64) -> table::Arrival {
        lock(&self.xfers).arrived(id, at, n)
    }

    /// True while transfer `id` is in progress.
    pub(crate) fn xfer_in_progress(&self, id: u64) -> bool {
        lock(&self.xfers).in_progress(id)
    }

    /// WRITE `id`'s end is about to be sent (its Ack may complete it from now on).
    pub(crate) fn xfer_end_sent(&self, id: u64) {
        lock(&self.xfers).end_sent(id);
    }
    pub(crate) fn fail_peer(&self, peer: &str, why: &str) {
        let ids = lock(&self.xfers).active_with(peer);
        for id in ids {
            let why = why.to_owned();
            self.finish(
                id,
                Err(XferError::ConnectionLost {
                    peer: peer.to_owned(),
                    why,
                }),
            );
        }
    }

    /// The CPU copied `n` payload bytes of a transfer.
    pub(crate) fn count_copy(&self, n: u64) {
        self.copied.fetch_add(n, Ordering::Relaxed);
    }

    /// A notification arrived from `from`: a driver's own (the host bounce's) go to its
    /// tap, the rest to their consumer.
    pub(crate) fn deliver_notif(&self, from: &str, bytes: Vec<u8>) {
        let bytes = match self.tap.get() {
            Some(tap) => match tap.take(from, bytes) {
                Some(bytes) => bytes,
                None => return,
            },
            None => bytes,
        };
        self.deliver_user_notif(from, bytes);
    }

    /// Queue a notification for its consumer: the route of its kind, else the engine's
    /// queue.
    pub(crate) fn deliver_user_notif(&self, from: &str, bytes: Vec<u8>) {
        self.stats.notifs_received.inc();
        if let Err(bytes) = self.route_notif(from, bytes) {
            lock(&self.notifs).push_back((from.to_owned(), bytes));
            self.notif_cv.notify_all();
        }
    }

    /// The local descriptor `idx` of READ transfer `id`, to copy arriving bytes into.
    pub(crate) fn read_target(&self, id: u64, idx: u32) -> Option<(Arc<Region>, u64, u64)> {
        lock(&self.xfers).read_target(id, idx)
    }

    /// A numbered notification from `from` on target connection `conn`.
    pub(crate) fn deliver_seq_notif(&self, conn: u64, from: &str, seq: u64, bytes: Vec<u8>) {
        let ready = lock(&self.seqs).entry(conn).or_default().take(seq, bytes);
        for b in ready {
            self.deliver_notif(from, b);
        }
    }

    /// Target connection `conn` ended.
    pub(crate) fn forget_conn(&self, conn: u64) {
        lock(&self.seqs).remove(&conn);
    }

    /// Give `bytes` to the route of its kind; `Err` hands them back when none takes them.
    pub(crate) fn route_notif(&self, from: &str, bytes: Vec<u8>) -> Result<(), Vec<u8>> {
        let routes = lock(&self.routes);
        match routes.iter().find(|r| bytes.starts_with(&r.prefix)) {
            Some(r) => {
                lock(&r.q).push_back((from.to_owned(), bytes));
                r.cv.notify_all();
                Ok(())
            }
            None => Err(bytes),
        }
    }

    /// For each remote descriptor to `peer`'s memory, the grant that covers it when its
    /// region is fenced (None for the others); empty when the peer fences nothing (the
    /// common case costs one look at its regions, not one per descriptor).
    pub(crate) fn grants_for(
        &self,
        peer: &str,
        meta: &super::metadata::AgentMetadata,
        remote: &[Desc],
        write: bool,
    ) -> Result<Vec<Option<Arc<Grant>>>, AgentError> {
        if !meta.regions.iter().any(|m| m.fenced) {
            return Ok(Vec::new());
        }
        let g = lock(&self.grants);
        let given = g.given.get(peer);
        remote
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let fenced = meta.regions.iter().any(|m| m.id == d.region.0 && m.fenced);
                if !fenced {
                    return Ok(None);
                }
                given
                    .into_iter()
                    .flat_map(HashMap::values)
                    .find(|g| g.allows(write) && g.covering(d.region.0, d.offset, d.len).is_some())
                    .cloned()
                    .map(Some)
                    .ok_or_else(|| AgentError::InvalidDesc {
                        side: "remote",
                        index: i,
                        reason: format!(
                            "region {} of {peer} is fenced and no grant from it covers \
                             [{}, +{}) for {}",
                            d.region.0,
                            d.offset,
                            d.len,
                            if write { "WRITE" } else { "READ" }
                        ),
                    })
            })
            .collect()
    }

    /// Run `f` (a copy of fenced bytes of `region`) if grant `id` is live and gives
    /// `write` (else READ) over `[offset, offset + len)`; revocation waits for it.
    ///
    /// # Errors
    /// The refusal, starting with [`REVOKED`].
    pub(crate) fn under_grant<R>(
        &self,
        id: u64,
        (region, offset, len): (u32, u64, u64),
        write: bool,
        f: impl FnOnce() -> R,
    ) -> Result<R, String> {
        let gate = {
            let g = lock(&self.grants);
            let Some(h) = g.made.get(&id) else {
                return Err(format!("{REVOKED}no live grant {id:#x} on region {region}"));
            };
            if !h.covers(region, offset, len) || !(if write { h.write } else { h.read }) {
                return Err(format!(
                    "{REVOKED}grant {id:#x} does not give {} over [{offset}, +{len}) of \
                     region {region}",
                    if write { "WRITE" } else { "READ" }
                ));
            }
            h.gate.clone()
        };
        let open = gate.read().unwrap_or_else(|p| p.into_inner());
        if !*open {
            return Err(format!("{REVOKED}grant {id:#x} was revoked"));
        }
        Ok(f())
    }

    /// A revoked grant: close its gate (after the copies under it) and drop its keys.
    pub(crate) fn close_grant(&self, held: Held) {
        *held.gate.write().unwrap_or_else(|p| p.into_inner()) = false;
        drop(held);
        self.stats.grants_revoked.inc();
    }

    /// Revoke every grant over `region` (it is being deregistered).
    pub(crate) fn revoke_region_grants(&self, region: u32) {
        let gone: Vec<Held> = {
            let mut g = lock(&self.grants);
            let ids: Vec<u64> = (g.made.iter())
                .filter(|(_, h)| h.ranges.iter().any(|r| r.0 == region))
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| g.made.remove(id)).collect()
        };
        for h in gone {
            self.close_grant(h);
        }
    }
}

impl table::Held for Arc<Region> {
    fn region_id(&self) -> RegionId {
        self.id
    }
}

#[cfg(test)]
mod tests;
