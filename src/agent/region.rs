//! Registered memory of an agent: host memory (a [`HostBuffer`]: the agent's own or the
//! caller's, which the verbs backend registers in place on every rail's device) or device
//! memory (reached by copies through its runtime), with the least remote access its role
//! needs, the layers it holds (one, or several at known offsets in a pooled allocation),
//! a count of active transfers that use it (deregistration is refused while it is
//! non-zero), and the [`Gate`] every copy of kvrail's own goes through (deregistration closes
//! it, so nothing of kvrail's touches memory given back).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::AgentError;
use super::metadata::MemKind;
use crate::mem::{DeviceMemory, HostBuffer, MemError};

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

/// The memory behind a region.
#[derive(Debug, Clone)]
pub enum RegionMemory {
    /// Host memory (kvrail's or the caller's, see [`HostBuffer`]).
    Host(Arc<HostBuffer>),
    /// Device memory the CPU reaches by copies through its runtime (an NPU's).
    Device(Arc<dyn DeviceMemory>),
}

impl RegionMemory {
    /// Bytes.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Self::Host(b) => b.len() as u64,
            Self::Device(d) => d.size(),
        }
    }

    /// The first byte's address (host: virtual; device: the runtime's, 0 when unknown).
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Self::Host(b) => b.addr(),
            Self::Device(d) => d.device_addr(),
        }
    }
}

/// Layers a region holds: names, and where each starts (a pooled allocation holds several
/// layers of `layer_len` bytes at known offsets; a per-layer region holds one at 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Layers {
    pub(crate) names: Vec<String>,
    /// Empty: every layer starts at 0 and spans the region.
    pub(crate) offsets: Vec<u64>,
    /// 0: the region's length.
    pub(crate) len: u64,
}

/// kvrail's own access to a region's memory — a peer's READ served or WRITE received on
/// TCP, a WRITE's source sent, a READ's bytes placed, a copy through a device runtime —
/// one chunk at a time: each chunk enters the gate and leaves it when its bytes moved.
/// Deregistration closes it: no chunk enters after that, and the close waits for the chunks
/// inside (each a bounded copy or a socket transfer of at most one message), so once
/// deregistration returned nothing of kvrail's reads or writes the memory.
#[derive(Default)]
pub(crate) struct Gate(AtomicUsize);

/// The gate's closed bit (the rest counts the chunks inside).
const CLOSED: usize = 1 << (usize::BITS - 1);

/// A chunk inside a [`Gate`]; it leaves when dropped.
pub(crate) struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::Release);
    }
}

impl Gate {
    /// Enter for one chunk; `None` once the gate is closed.
    pub(crate) fn enter(&self) -> Option<Inside<'_>> {
        // one read-modify-write on the word the closer sets its bit in: either this entry
        // comes first (the closer sees it and waits) or the bit does (it is refused)
        if self.0.fetch_add(1, Ordering::AcqRel) & CLOSED != 0 {
            self.0.fetch_sub(1, Ordering::Release);
            return None;
        }
        Some(Inside(self))
    }

    /// Close the gate and wait for the chunks inside to leave, up to `limit`: `Err` with how
    /// many are still inside when it passed (the gate is open again then).
    pub(crate) fn close(&self, limit: Duration) -> Result<(), usize> {
        self.0.fetch_or(CLOSED, Ordering::AcqRel);
        let start = Instant::now();
        loop {
            let inside = self.0.load(Ordering::Acquire) & !CLOSED;
            if inside == 0 {
                return Ok(());
            }
            if start.elapsed() >= limit {
                self.0.fetch_and(!CLOSED, Ordering::AcqRel);
                return Err(inside);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Open again (a deregistration that could not finish).
    pub(crate) fn reopen(&self) {
        self.0.fetch_and(!CLOSED, Ordering::AcqRel);
    }
}

pub(crate) struct Region {
    pub(crate) id: RegionId,
    pub(crate) access: RemoteAccess,
    pub(crate) layers: Layers,
    pub(crate) busy: AtomicUsize,
    /// kvrail's own copies of the memory go through it (see [`Gate`]).
    pub(crate) gate: Gate,
    pub(crate) mem: RegionMemory,
    pub(crate) kind: MemKind,
    /// The device the memory is on (-1 for host memory).
    pub(crate) device: i32,
    /// Peers reach it only through grants (see [`super::grant`]).
    pub(crate) fenced: bool,
    /// The buffer registered on each rail (verbs backend; empty on TCP).
    #[cfg(feature = "verbs")]
    pub(crate) mrs: Vec<crate::transport::verbs::Mr>,
}

impl Region {
    pub(crate) fn new(
        id: RegionId,
        mem: RegionMemory,
        kind: MemKind,
        device: i32,
        access: RemoteAccess,
        layers: Layers,
    ) -> Self {
        Self {
            id,
            access,
            layers,
            busy: AtomicUsize::new(0),
            gate: Gate::default(),
            mem,
            kind,
            device,
            fenced: false,
            #[cfg(feature = "verbs")]
            mrs: Vec::new(),
        }
    }

    pub(crate) fn len(&self) -> u64 {
        self.mem.len()
    }

    /// The first byte's address (host: virtual; device: the runtime's, 0 when unknown).
    pub(crate) fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// The memory, once the region is gone (its registrations dropped first).
    pub(crate) fn into_memory(self) -> RegionMemory {
        #[cfg(feature = "verbs")]
        drop(self.mrs);
        self.mem
    }

    /// The host buffer, for a host region.
    pub(crate) fn host(&self) -> Option<&Arc<HostBuffer>> {
        match &self.mem {
            RegionMemory::Host(b) => Some(b),
            RegionMemory::Device(_) => None,
        }
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

    fn mem_err(&self, offset: u64, len: u64, e: MemError) -> AgentError {
        match e {
            MemError::OutOfRange { .. } => self.oob(offset, len),
            e => AgentError::Unsupported(format!("region {}: {e}", self.id.0)),
        }
    }

    /// Enter the region's [`Gate`] for one chunk.
    ///
    /// # Errors
    /// [`AgentError::NoRegion`] once it is being deregistered.
    pub(crate) fn enter(&self) -> Result<Inside<'_>, AgentError> {
        self.gate.enter().ok_or(AgentError::NoRegion(self.id.0))
    }

    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> Result<(), AgentError> {
        let at = self.start(offset, data.len() as u64)?;
        let _in = self.enter()?;
        let res = match &self.mem {
            RegionMemory::Host(b) => b.write(at, data),
            RegionMemory::Device(d) => d.copy_from_host(offset, data),
        };
        res.map_err(|e| self.mem_err(offset, data.len() as u64, e))
    }

    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), AgentError> {
        let at = self.start(offset, out.len() as u64)?;
        let len = out.len() as u64;
        let _in = self.enter()?;
        let res = match &self.mem {
            RegionMemory::Host(b) => b.read(at, out),
            RegionMemory::Device(d) => d.copy_to_host(offset, out),
        };
        res.map_err(|e| self.mem_err(offset, len, e))
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

#[cfg(test)]
mod tests;
