//! A transfer's vocabulary: descriptors, the operation, its id and status, and the bound on
//! a notification (what every part of the agent names, defined apart from all of them).

use super::error::{AgentError, XferError};
use super::region::RegionId;

/// A descriptor: `len` bytes at `offset` of a region (local, or the peer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// The region.
    pub region: RegionId,
    /// Offset in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl Desc {
    /// `len` bytes at `offset` of `region`.
    pub fn new(region: RegionId, offset: u64, len: u64) -> Self {
        Self {
            region,
            offset,
            len,
        }
    }
}

/// READ (pull the peer's bytes into local memory) or WRITE (push local bytes to the peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    /// Peer → local.
    Read,
    /// Local → peer.
    Write,
}

/// A transfer request's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct XferId(pub u64);

/// Where a transfer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferStatus {
    /// Created or released-for-repost, not posted.
    NotPosted,
    /// Posted; bytes are moving.
    InProgress,
    /// Every byte is in place (and the notification, if any, was delivered after them).
    Done,
    /// Failed, with the cause; nothing reports success for bytes that did not land.
    Error(XferError),
}

/// The largest notification, in bytes: one fits a control frame with room for its header
/// (larger ones are refused when handed in, before anything is queued).
pub const MAX_NOTIF_LEN: usize = 4 << 20;

pub(super) fn check_notif_len(n: Option<&[u8]>) -> Result<(), AgentError> {
    match n {
        Some(b) if b.len() > MAX_NOTIF_LEN => Err(AgentError::NotifTooLarge {
            len: b.len(),
            max: MAX_NOTIF_LEN,
        }),
        _ => Ok(()),
    }
}
