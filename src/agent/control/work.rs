//! What a peer connection's writer thread is handed: transfers to move, notifications, the
//! verbs lanes' requests.

use std::sync::{mpsc, Arc};

use crate::agent::region::Region;
use crate::agent::xfer::{Desc, XferOp};

/// Work for a peer connection's writer thread.
pub(crate) enum Work {
    /// Move a posted transfer's bytes (WRITE) or request them (READ).
    Xfer {
        id: u64,
        op: XferOp,
        /// Local region and descriptor, per descriptor (as posted: no copy).
        local: Vec<(Arc<Region>, Desc)>,
        remote: Arc<[Desc]>,
        /// The grant each remote descriptor goes through (0: none).
        grants: Vec<u64>,
        notif: Option<Vec<u8>>,
    },
    /// Send a notification.
    Notif(Vec<u8>),
    /// Send a numbered notification.
    SeqNotif(u64, Vec<u8>),
    /// Verbs: ask the peer for queue pairs (rebuilding a rail).
    #[cfg(feature = "verbs")]
    QpOpen(crate::agent::verbs::QpRequest),
    /// Verbs: ask the peer for the receiving end of a rebuilt notification channel (its
    /// rail, our endpoint).
    #[cfg(feature = "verbs")]
    ChanOpen(u32, crate::transport::verbs::Endpoint),
    /// Everything queued before this is on the wire: say so.
    Flush(mpsc::SyncSender<()>),
}
