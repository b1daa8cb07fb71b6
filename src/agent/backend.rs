//! The data paths behind `Agent::post`: a posted transfer is handed to exactly one
//! [`Backend`] — the verbs queue pairs, the host bounce (device memory on verbs), or the TCP
//! connection — with the agent's maps no longer held. A backend reports the outcome
//! through the agent's transfer table (done, failed, notification after the last byte).

use std::sync::{mpsc, Arc};

use super::control::work::Work;
use super::core::Core;
use super::metadata::AgentMetadata;
use super::region::Region;
use super::stats::BounceStats;
use super::{error::AgentError, error::XferError, xfer::Desc, xfer::XferOp};

/// A posted transfer, as a backend gets it.
pub(crate) struct Posted {
    pub(crate) id: u64,
    pub(crate) op: XferOp,
    pub(crate) peer: Arc<str>,
    /// Each local descriptor with the region it lies in (held busy by the table).
    pub(crate) local: Vec<(Arc<Region>, Desc)>,
    pub(crate) remote: Arc<[Desc]>,
    pub(crate) notif: Option<Vec<u8>>,
    /// The peer's metadata as loaded (the verbs path addresses its regions by rkey).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) meta: Arc<AgentMetadata>,
    /// The grant each remote descriptor goes through (fenced memory of the peer), if any.
    pub(crate) grants: Vec<Option<Arc<super::grant::Grant>>>,
}

/// A data path.
pub(crate) trait Backend {
    /// Start moving `x`. An error means nothing moves; the agent fails the transfer.
    fn start(&self, x: Posted) -> Result<(), AgentError>;
}

/// The host bounce as the agent holds it (the engine in [`super::bounce`]): device memory
/// moved through staging slots.
pub(crate) trait DevicePath: Backend + Send + Sync {
    /// Counters since the start.
    fn stats(&self) -> BounceStats;
    /// `peer` is gone (invalidated, or reloaded at a new address).
    fn forget(&self, peer: &str);
    /// The agent released transfer `id`.
    fn forget_xfer(&self, id: u64);
}

/// The TCP data path to one peer: its connection's writer queue.
pub(crate) struct TcpPath<'a> {
    /// Where the transfer ends when nothing could be queued.
    pub(crate) core: &'a Core,
    pub(crate) tx: mpsc::Sender<Work>,
    pub(crate) open: bool,
}

impl Backend for TcpPath<'_> {
    fn start(&self, x: Posted) -> Result<(), AgentError> {
        if x.op == XferOp::Read && x.local.iter().all(|(_, d)| d.len == 0) {
            // nothing to read: done at once; the notification is queued first
            if let Some(n) = x.notif {
                let _ = self.tx.send(Work::Notif(n));
            }
            self.core.finish(x.id, Ok(()));
            return Ok(());
        }
        let work = Work::Xfer {
            id: x.id,
            op: x.op,
            local: x.local,
            grants: x
                .grants
                .iter()
                .map(|g| g.as_ref().map_or(0, |g| g.id))
                .collect(),
            remote: x.remote,
            notif: x.notif,
        };
        if !self.open || self.tx.send(work).is_err() {
            self.core.finish(x.id, Err(XferError::Closed));
        }
        Ok(())
    }
}

/// The verbs lanes to a peer with queue pairs, and the agent as they see it.
#[cfg(feature = "verbs")]
pub(crate) struct VerbsPath<'a> {
    pub(crate) lanes: &'a super::verbs::Verbs,
    pub(crate) host: &'a dyn super::verbs::Host,
}

#[cfg(feature = "verbs")]
impl Backend for VerbsPath<'_> {
    fn start(&self, x: Posted) -> Result<(), AgentError> {
        self.lanes.post(
            self.host,
            super::verbs::PostReq {
                id: x.id,
                op: x.op,
                peer: &x.peer,
                local: &x.local,
                remote: &x.remote,
                meta: &x.meta,
                grants: &x.grants,
            },
        )
    }
}
