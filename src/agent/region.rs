//! Registered memory of an agent: host memory the agent owns, with the least remote access
//! its role needs, and a count of active transfers that use it (deregistration is refused
//! while it is non-zero).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::RwLock;

use super::AgentError;

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
    bytes: RwLock<Box<[u8]>>,
}

impl Region {
    pub(crate) fn new(id: RegionId, len: usize, access: RemoteAccess, layers: Vec<String>) -> Self {
        Self {
            id,
            access,
            layers,
            busy: AtomicUsize::new(0),
            bytes: RwLock::new(vec![0u8; len].into_boxed_slice()),
        }
    }

    pub(crate) fn len(&self) -> u64 {
        self.bytes.read().unwrap_or_else(|p| p.into_inner()).len() as u64
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, AgentError> {
        let size = self.len();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(AgentError::OutOfRange {
                region: self.id.0,
                offset,
                len,
                size,
            }),
        }
    }

    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<(), AgentError> {
        let r = self.range(offset, data.len() as u64)?;
        self.bytes.write().unwrap_or_else(|p| p.into_inner())[r].copy_from_slice(data);
        Ok(())
    }

    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), AgentError> {
        let r = self.range(offset, out.len() as u64)?;
        out.copy_from_slice(&self.bytes.read().unwrap_or_else(|p| p.into_inner())[r]);
        Ok(())
    }

    pub(crate) fn read_vec(&self, offset: u64, len: u64) -> Result<Vec<u8>, AgentError> {
        let r = self.range(offset, len)?;
        Ok(self.bytes.read().unwrap_or_else(|p| p.into_inner())[r].to_vec())
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
