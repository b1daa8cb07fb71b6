//! The data paths behind [`Agent::post`]: a posted transfer is handed to exactly one
//! [`Backend`] — the verbs queue pairs, the host bounce (device memory on verbs), or the TCP
//! connection — with the agent's maps no longer held. A backend reports the outcome
//! through the agent's transfer table (done, failed, notification after the last byte).

use std::sync::{mpsc, Arc};

use super::control::Work;
use super::metadata::AgentMetadata;
use super::region::Region;
use super::{error::AgentError, error::XferError, xfer::Desc, xfer::XferOp, Agent};

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
    fn start(&self, agent: &Agent, x: Posted) -> Result<(), AgentError>;
}

/// The TCP data path to one peer: its connection's writer queue.
pub(crate) struct TcpPath {
    pub(crate) tx: mpsc::Sender<Work>,
    pub(crate) open: bool,
}

impl Backend for TcpPath {
    fn start(&self, agent: &Agent, x: Posted) -> Result<(), AgentError> {
        let shared = &agent.shared;
        if x.op == XferOp::Read && x.local.iter().all(|(_, d)| d.len == 0) {
            // nothing to read: done at once; the notification is queued first
            if let Some(n) = x.notif {
                let _ = self.tx.send(Work::Notif(n));
            }
            shared.finish(x.id, Ok(()));
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
            shared.finish(x.id, Err(XferError::Closed));
        }
        Ok(())
    }
}

impl Backend for super::bounce::Engine {
    fn start(&self, agent: &Agent, x: Posted) -> Result<(), AgentError> {
        let part = |d: &Desc| super::bounce::wire::Part {
            region: d.region.0,
            offset: d.offset,
            len: d.len,
        };
        let pieces = x
            .local
            .iter()
            .zip(x.remote.iter())
            .map(|((_, l), r)| super::bounce::wire::Piece {
                src: part(l),
                dst: part(r),
            })
            .collect();
        let req = super::bounce::Post {
            id: x.id,
            op: x.op,
            peer: x.peer.to_string(),
            pieces,
            notif: x.notif,
        };
        self.post(agent, req)
    }
}

#[cfg(feature = "verbs")]
impl Backend for super::verbs::Verbs {
    fn start(&self, agent: &Agent, x: Posted) -> Result<(), AgentError> {
        self.post(
            &*agent.shared,
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
