//! Registering memory: the caller's (NIXL's `register_memory`: address, length, kind,
//! device) or kvrail's own, with the least remote access its role needs and the layers it
//! holds. Host memory is registered in place — the NIC reads and writes the caller's pages
//! and kvrail copies none of them on verbs; device memory is reached by copies through its
//! runtime.

use std::sync::Arc;

use super::metadata::MemKind;
use super::region::{Layers, RegionMemory};
use super::{error::AgentError, region::RemoteAccess};
use crate::mem::{DeviceMemory, HostBuffer, HostOwner};

/// Memory to register, built from the caller's memory (or kvrail's), then
/// [`Agent::register_memory`](super::Agent::register_memory).
///
/// ```
/// # use kvrail::agent::{Agent, AgentConfig, MemRegion, RemoteAccess};
/// let agent = Agent::new("prefill-0", AgentConfig { listen: "127.0.0.1:0".parse().unwrap(), ..AgentConfig::default() })?;
/// let kv: Vec<u8> = vec![0; 1 << 20]; // the engine's cache
/// let id = agent.register_memory(
///     MemRegion::vec(kv)?.access(RemoteAccess::READ).layers(vec!["model.layers.0".into()]),
/// )?;
/// // … transfers READ the vector's pages in place …
/// let kv = agent.deregister_memory(id)?.into_vec();
/// # Ok::<(), kvrail::agent::AgentError>(())
/// ```
#[derive(Debug, Clone)]
pub struct MemRegion {
    pub(super) mem: RegionMemory,
    pub(super) kind: MemKind,
    pub(super) device: i32,
    pub(super) access: RemoteAccess,
    pub(super) layers: Layers,
    pub(super) fenced: bool,
}

fn mem_err(e: crate::mem::MemError) -> AgentError {
    AgentError::InvalidMemory(e.to_string())
}

impl MemRegion {
    /// Host memory in a [`HostBuffer`]: kvrail's ([`HostBuffer::new`]), the caller's handed
    /// over, or the caller's raw range ([`HostBuffer::from_raw`], `unsafe`: the caller
    /// keeps it alive while it is registered).
    pub fn host(buf: Arc<HostBuffer>) -> Self {
        Self {
            mem: RegionMemory::Host(buf),
            kind: MemKind::Host,
            device: -1,
            access: RemoteAccess::NONE,
            layers: Layers::default(),
            fenced: false,
        }
    }

    /// The caller's vector, registered in place; [`Agent::deregister_memory`](super::Agent::deregister_memory) gives it back.
    ///
    /// # Errors
    /// [`AgentError::InvalidMemory`] for an empty vector.
    pub fn vec(v: Vec<u8>) -> Result<Self, AgentError> {
        Ok(Self::host(HostBuffer::from_vec(v).map_err(mem_err)?))
    }

    /// The caller's mapping, registered in place; [`Agent::deregister_memory`](super::Agent::deregister_memory) gives it back.
    ///
    /// # Errors
    /// [`AgentError::InvalidMemory`] for an empty mapping.
    pub fn mmap(m: memmap2::MmapMut) -> Result<Self, AgentError> {
        Ok(Self::host(HostBuffer::from_mmap(m).map_err(mem_err)?))
    }

    /// Device memory on device `device` (an NPU's, e.g. [`crate::mem::NpuMemory`] or the
    /// engine's own allocation through [`crate::mem::NpuMemory::from_raw`]).
    pub fn device(mem: Arc<dyn DeviceMemory>, device: i32) -> Self {
        Self {
            mem: RegionMemory::Device(mem),
            kind: MemKind::Npu,
            device,
            access: RemoteAccess::NONE,
            layers: Layers::default(),
            fenced: false,
        }
    }

    /// What peers may do to it (default: nothing; a local source or destination).
    pub fn access(mut self, access: RemoteAccess) -> Self {
        self.access = access;
        self
    }

    /// Fenced: peers reach it only through grants ([`Agent::grant`](super::Agent::grant)), each revocable on
    /// its own, never through the region's own keys. `access` is then the most a grant
    /// may give. Host memory only.
    pub fn fenced(mut self) -> Self {
        self.fenced = true;
        self
    }

    /// The layers it holds, each spanning the whole region (one layer per region, or
    /// layers that share one region).
    pub fn layers(mut self, names: Vec<String>) -> Self {
        self.layers = Layers {
            names,
            offsets: Vec::new(),
            len: 0,
        };
        self
    }

    /// A pooled allocation: layers of `layer_len` bytes each at the given offsets (the
    /// hybrid-allocator layout, one allocation for several layers).
    pub fn pooled_layers(mut self, layers: Vec<(String, u64)>, layer_len: u64) -> Self {
        let (names, offsets) = layers.into_iter().unzip();
        self.layers = Layers {
            names,
            offsets,
            len: layer_len,
        };
        self
    }

    /// The memory's kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The device it is on (-1 for host memory).
    pub fn device_id(&self) -> i32 {
        self.device
    }

    /// Each layer it holds and where: (name, offset, bytes).
    pub fn layer_spans(&self) -> Vec<(String, u64, u64)> {
        let l = &self.layers;
        let region_len = self.len();
        l.names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let (off, len) = super::metadata::layer_span(&l.offsets, l.len, region_len, i);
                (n.clone(), off, len)
            })
            .collect()
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.mem.len()
    }

    /// True for no bytes (never: empty memory cannot be built).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn check(&self) -> Result<(), AgentError> {
        let len = self.len();
        if self.fenced && self.kind != MemKind::Host {
            return Err(AgentError::Unsupported(
                "fencing (grants) covers host memory only; device memory moves through the \
                 host bounce, which checks the region's access instead"
                    .into(),
            ));
        }
        let lay = &self.layers;
        if !lay.offsets.is_empty() && lay.offsets.len() != lay.names.len() {
            return Err(AgentError::InvalidMemory(format!(
                "{} layer offsets for {} layers",
                lay.offsets.len(),
                lay.names.len()
            )));
        }
        if !lay.offsets.is_empty() && lay.len == 0 {
            return Err(AgentError::InvalidMemory(
                "pooled layers need a layer length".into(),
            ));
        }
        for (name, off) in lay.names.iter().zip(&lay.offsets) {
            if off.checked_add(lay.len).is_none_or(|e| e > len) {
                return Err(AgentError::InvalidMemory(format!(
                    "layer {name:?} at offset {off} (+{} bytes) lies outside the {len}-byte \
                     region",
                    lay.len
                )));
            }
        }
        Ok(())
    }
}

/// Memory given back by [`Agent::deregister_memory`](super::Agent::deregister_memory).
#[derive(Debug)]
#[non_exhaustive]
pub enum RegisteredMemory {
    /// Host memory: kvrail's, or what the caller handed over.
    Host(HostOwner),
    /// A host buffer the caller still shares (it kept an `Arc` of the [`HostBuffer`]).
    HostShared(Arc<HostBuffer>),
    /// Device memory (dropping the last reference frees an allocation kvrail made; the
    /// caller's own allocation stays the caller's).
    Device(Arc<dyn DeviceMemory>),
}

impl RegisteredMemory {
    /// The vector handed to [`MemRegion::vec`]; empty for any other memory.
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            Self::Host(HostOwner::Vec(v)) => v,
            _ => Vec::new(),
        }
    }

    /// The mapping handed to [`MemRegion::mmap`] (or kvrail's own), if that is what it was.
    pub fn into_mmap(self) -> Option<memmap2::MmapMut> {
        match self {
            Self::Host(HostOwner::Mmap(m) | HostOwner::Allocated(m)) => Some(m),
            _ => None,
        }
    }
}
