//! Registered memory of an agent: host memory the agent owns (a [`HostBuffer`], which the
//! verbs backend registers on every rail's device), with the least remote access its role
//! needs, and a count of active transfers that use it (deregistration is refused while it is
//! non-zero).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::AgentError;
use crate::mem::HostBuffer;

/// What peers may do to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAccess {
    /// Peers may READ it (a pull producer).
    pub read: bool,
    /// Peers may WRITE it (a push consumer).
    pub write: bool,
}

impl RemoteAccess {
    /// No remote access: a local source or destination only.
    pub const NONE: Self = Self {
        read: false,
        write: false,
    };
    /// Remote READ only.
    pub const READ: Self = Self {
        read: true,
        write: false,
    };
    /// Remote WRITE only.
    pub const WRITE: Self = Self {
        read: false,
        write: true,
    };
    /// Both.
    pub const READ_WRITE: Self = Self {
        read: true,
        write: true,
    };
}

/// A region's id: what descriptors name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

pub(crate) struct Region {
    pub(crate) id: RegionId,
    pub(crate) access: RemoteAccess,
    pub(crate) layers: Vec<String>,
    pub(crate) busy: AtomicUsize,
    pub(crate) buf: Arc<HostBuffer>,
    /// The buffer registered on each rail (verbs backend; empty on TCP).
    #[cfg(feature = "verbs")]
    pub(crate) mrs: Vec<crate::transport::verbs::Mr>,
}

impl Region {
    pub(crate) fn new(
        id: RegionId,
        buf: Arc<HostBuffer>,
        access: RemoteAccess,
        layers: Vec<String>,
    ) -> Self {
        Self {
            id,
            access,
            layers,
            busy: AtomicUsize::new(0),
            buf,
            #[cfg(feature = "verbs")]
            mrs: Vec::new(),
        }
    }

    pub(crate) fn len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn oob(&self, offset: u64, len: u64) -> AgentError {
        AgentError::OutOfRange {
            region: self.id.0,
            offset,
            len,
            size: self.len(),
        }
    }

    fn start(&self, offset: u64, len: u64) -> Result<usize, AgentError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(offset as usize),
            _ => Err(self.oob(offset, len)),
        }
    }

    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<(), AgentError> {
        let at = self.start(offset, data.len() as u64)?;
        self.buf
            .write(at, data)
            .map_err(|_| self.oob(offset, data.len() as u64))
    }

    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), AgentError> {
        let at = self.start(offset, out.len() as u64)?;
        self.buf
            .read(at, out)
            .map_err(|_| self.oob(offset, out.len() as u64))
    }

    pub(crate) fn read_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>, AgentError> {
        let at = self.start(offset, len)?;
        let mut v = vec![0u8; len as usize];
        self.buf
            .read(at, &mut v)
            .map_err(|_| self.oob(offset, len))?;
        Ok(v)
    }

    pub(crate) fn acquire(&self) {
        self.busy.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn release(&self) {
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn in_use(&self) -> usize {
        self.busy.load(Ordering::Acquire)
    }
}
