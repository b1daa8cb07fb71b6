//! `Agent::register_memory`: memory described by a [`MemRegion`] registered with the
//! backends, its region published.

use std::sync::Arc;

use super::region::{Region, RegionMemory};
use super::register::{MemRegion, RegisteredMemory};
use super::{error::AgentError, region::RegionId, Agent};
use crate::mem::{HostBuffer, KvBufferDevice};
use crate::threads::lock;

impl Agent {
    /// Register memory (see [`MemRegion`]): host memory in place, or device memory. Returns
    /// the id descriptors name. Peers see its kind, device and layers in the metadata.
    ///
    /// # Errors
    /// [`AgentError::InvalidMemory`]: it overlaps memory already registered, or its layers
    /// lie outside it; [`AgentError::Unsupported`]: the backend cannot move this kind of
    /// memory (device memory on verbs without dma-buf).
    pub fn register_memory(&self, m: MemRegion) -> Result<RegionId, AgentError> {
        m.check()?;
        let (addr, len) = (m.mem.addr(), m.len());
        let mut regions = lock(&self.shared.regions);
        if addr != 0 {
            if let Some(r) = regions.values().find(|r| {
                r.kind == m.kind
                    && r.device == m.device
                    && r.addr() != 0
                    && r.addr() < addr + len
                    && addr < r.addr() + r.len()
            }) {
                return Err(AgentError::InvalidMemory(format!(
                    "[{addr:#x}, +{len}) overlaps region {} at [{:#x}, +{}) (register each \
                     byte once; descriptors address parts of a region)",
                    r.id.0,
                    r.addr(),
                    r.len()
                )));
            }
        }
        let id = {
            let mut n = lock(&self.shared.next_region);
            let id = *n;
            *n += 1;
            RegionId(id)
        };
        if let RegionMemory::Device(d) = &m.mem {
            // How its bytes will move, said once per reason: never device to device yet
            // (staged by the host bounce on verbs; copies through the runtime on TCP).
            let exporter = d
                .export_dmabuf()
                .map(drop)
                .map_err(|e| e.to_string())
                .and(Err(
                    "kvrail does not register dma-buf memory with the NIC yet".to_owned(),
                ));
            crate::mem::MemoryPath::choose(KvBufferDevice::Rbln, exporter, &self.dmabuf_support());
        }
        #[allow(unused_mut)]
        let mut region = Region::new(id, m.mem, m.kind, m.device, m.access, m.layers);
        region.fenced = m.fenced;
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            region.mrs = v.register(&region)?;
        }
        tracing::debug!(agent = %self.shared.name, region = id.0, len, kind = ?region.kind,
            callers = region.host().is_some_and(|b| b.is_callers()), "memory registered");
        regions.insert(id.0, Arc::new(region));
        drop(regions);
        self.shared.republish();
        Ok(id)
    }

    /// Deregister a region and give its memory back (the caller's vector or mapping, say),
    /// with [`Agent::deregister`]'s guarantee: nothing of kvrail's touches it any more.
    ///
    /// # Errors
    /// As [`Agent::deregister`] (the region stays registered).
    pub fn deregister_memory(&self, id: RegionId) -> Result<RegisteredMemory, AgentError> {
        match self.shared.deregister_region(id)? {
            RegionMemory::Host(b) => Ok(HostBuffer::into_owner(b)
                .map_or_else(RegisteredMemory::HostShared, RegisteredMemory::Host)),
            RegionMemory::Device(d) => Ok(RegisteredMemory::Device(d)),
        }
    }

    /// Bytes of payload this agent's transfers copied with the CPU between registered
    /// memory and its own buffers (the TCP backend's socket copies, device-memory copies).
    /// Host regions on verbs add nothing: the NIC moves their bytes in place.
    pub fn payload_bytes_copied(&self) -> u64 {
        self.shared
            .copied
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}
