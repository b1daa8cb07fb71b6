//! The caller's memory through the C ABI: `kvrail_agent_register_memory` (NIXL's
//! `registerMem`: address, length, kind, device) and the engine caches that
//! `kvrail_worker_new_caches` registers. Host memory is registered in place; NPU memory is
//! the caller's allocation in the RBLN runtime (`RBLN_RUNTIME_LIB` names it); a dma-buf is
//! checked and then refused until the agent registers dma-bufs.

use std::ffi::c_char;
use std::sync::Arc;

use kvrail::agent::{MemRegion, RemoteAccess};
use kvrail::mem::{HostBuffer, NpuMemory};
use rbln_sys::RblnLib;

use crate::agent::{kvrail_agent, KVRAIL_ACCESS_NONE, KVRAIL_ACCESS_READ, KVRAIL_ACCESS_WRITE};
use crate::result::{kvrail_result, Failure};
use crate::util::{boundary, null, put, slice_arg, str_arg};

/// Memory kind: host DRAM (`addr` is a host pointer).
pub const KVRAIL_MEM_HOST: u32 = 0;
/// Memory kind: a dma-buf (`dmabuf_fd`, `dmabuf_offset`; `addr` is the address the NIC
/// uses for its first byte).
pub const KVRAIL_MEM_DMABUF: u32 = 1;
/// Memory kind: NPU memory allocated with the RBLN runtime on `device_id` (`addr` is the
/// runtime's device address).
pub const KVRAIL_MEM_NPU: u32 = 2;

/// Memory the caller owns, to register (see [`kvrail_agent_register_memory`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvrail_mem_desc {
    /// First byte (host pointer, device address, or the dma-buf's NIC address).
    pub addr: u64,
    /// Bytes (at least one).
    pub len: u64,
    /// `KVRAIL_MEM_*`.
    pub kind: u32,
    /// The device (NPU index) for device kinds; ignored for host memory.
    pub device_id: i32,
    /// The dma-buf's file descriptor (`KVRAIL_MEM_DMABUF`; -1 otherwise).
    pub dmabuf_fd: i32,
    /// Offset of the memory in the dma-buf.
    pub dmabuf_offset: u64,
}

/// One of an engine's KV cache allocations (see [`kvrail_worker_new_caches`](crate::kvrail_worker_new_caches)).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvrail_kv_cache {
    /// The allocation.
    pub mem: kvrail_mem_desc,
    /// The layer names it holds (`n_layers` NUL-terminated strings).
    pub layers: *const *const c_char,
    /// How many.
    pub n_layers: usize,
    /// NULL: one layer spanning the allocation. Otherwise `n_layers` offsets: a pooled
    /// allocation with each layer's `layer_len` bytes at its offset.
    pub offsets: *const u64,
    /// Bytes of one layer in a pooled allocation (ignored when `offsets` is NULL).
    pub layer_len: u64,
}

fn invalid(what: impl Into<String>) -> Failure {
    Failure::new(kvrail_result::InvalidArgument, what)
}

pub(crate) fn access(access: u32) -> Result<RemoteAccess, Failure> {
    Ok(match access {
        KVRAIL_ACCESS_NONE => RemoteAccess::NONE,
        KVRAIL_ACCESS_READ => RemoteAccess::READ,
        KVRAIL_ACCESS_WRITE => RemoteAccess::WRITE,
        3 => RemoteAccess::READ_WRITE,
        o => {
            return Err(invalid(format!(
                "access {o:#x} is not a KVRAIL_ACCESS_* combination"
            )))
        }
    })
}

/// The RBLN runtime, loaded once (for NPU memory).
pub(crate) fn runtime() -> Result<Arc<RblnLib>, Failure> {
    RblnLib::shared()
        .map_err(|e| Failure::new(kvrail_result::Unsupported, format!("NPU memory: {e}")))
}

/// The caller's memory `d` as a region to register.
///
/// # Safety
/// `d` describes memory of its kind that stays valid while it is registered.
pub(crate) unsafe fn mem_region(d: &kvrail_mem_desc) -> Result<MemRegion, Failure> {
    if d.addr == 0 {
        return Err(invalid("addr: NULL"));
    }
    if d.len == 0 {
        return Err(invalid("len: 0 (a region needs at least one byte)"));
    }
    let len = usize::try_from(d.len).map_err(|_| invalid("len: larger than the address space"))?;
    match d.kind {
        KVRAIL_MEM_HOST => {
            // SAFETY: the caller's promise: `len` bytes of host memory at `addr`, alive while
            // registered.
            let b = unsafe { HostBuffer::from_raw(d.addr as usize, len) }
                .map_err(|e| Failure::new(kvrail_result::InvalidMemory, format!("addr: {e}")))?;
            Ok(MemRegion::host(b))
        }
        KVRAIL_MEM_NPU => {
            let lib = runtime()?;
            // SAFETY: the caller's promise: NPU memory of `device_id`, alive while registered.
            let m = unsafe { NpuMemory::from_raw(&lib, d.device_id, d.addr, d.len) }
                .map_err(|e| Failure::new(kvrail_result::InvalidMemory, format!("addr: {e}")))?;
            Ok(MemRegion::device(m, d.device_id))
        }
        KVRAIL_MEM_DMABUF => {
            if d.dmabuf_fd < 0 {
                return Err(invalid(format!(
                    "dmabuf_fd: {} (KVRAIL_MEM_DMABUF needs the dma-buf's file descriptor)",
                    d.dmabuf_fd
                )));
            }
            Err(Failure::new(
                kvrail_result::Unsupported,
                format!(
                    "kind KVRAIL_MEM_DMABUF (fd {}): this agent does not register dma-buf \
                     memory yet; register NPU memory as KVRAIL_MEM_NPU",
                    d.dmabuf_fd
                ),
            ))
        }
        k => Err(invalid(format!(
            "kind: {k} is not KVRAIL_MEM_HOST (0), KVRAIL_MEM_DMABUF (1) or KVRAIL_MEM_NPU (2)"
        ))),
    }
}

/// Register memory the caller owns, in place (NIXL's `registerMem`): `desc` says where it
/// is and what it is, `access` what peers may do (`KVRAIL_ACCESS_*`). Host memory is read
/// and written by the NIC where it is; kvrail copies none of it on RDMA. Errors name the
/// argument: NULL `addr` or zero `len` and an unknown `kind` are `INVALID_ARGUMENT`, so is a
/// dma-buf without `dmabuf_fd`; memory overlapping a registration, and an NPU address
/// outside every allocation of the runtime, are `INVALID_MEMORY`.
///
/// # Safety
/// `agent` from `kvrail_agent_new`; `desc` readable; the memory stays valid (allocated,
/// mapped) until `kvrail_agent_deregister` returned for the region; `out_region` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_register_memory(
    agent: *const kvrail_agent,
    desc: *const kvrail_mem_desc,
    access: u32,
    out_region: *mut u32,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { crate::agent::handle(agent) }?;
        if desc.is_null() {
            return Err(null("desc"));
        }
        if out_region.is_null() {
            return Err(null("out_region"));
        }
        let access = self::access(access)?;
        // SAFETY: non-NULL and readable by the caller's promise; the memory's lifetime is
        // the caller's promise too.
        let m = unsafe { mem_region(&*desc) }?;
        let id = h.agent.register_memory(m.access(access))?;
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out_region, id.0, "out_region") }
    })
}

/// The engine caches `caches[0..n]` as regions with their layers.
///
/// # Safety
/// As [`kvrail_worker_new_caches`](crate::kvrail_worker_new_caches).
pub(crate) unsafe fn kv_caches(
    caches: *const kvrail_kv_cache,
    n: usize,
) -> Result<Vec<MemRegion>, Failure> {
    if n == 0 {
        return Err(invalid("n_caches: 0 (the engine's KV cache is needed)"));
    }
    // SAFETY: the caller's promise: `n` readable entries.
    let caches = unsafe { slice_arg(caches, n, "caches") }?;
    let mut out = Vec::with_capacity(n);
    for (i, c) in caches.iter().enumerate() {
        let at = |e: Failure| Failure::new(e.0, format!("caches[{i}].{}", e.1));
        // SAFETY: the caller's promise: `n_layers` NUL-terminated strings.
        let names = unsafe { slice_arg(c.layers, c.n_layers, "layers") }.map_err(at)?;
        if names.is_empty() {
            return Err(at(invalid("layers: none (name the layers it holds)")));
        }
        let names = names
            .iter()
            .map(|&p| {
                // SAFETY: each is a NUL-terminated string by the caller's promise.
                unsafe { str_arg(p, "layers") }.map(str::to_owned)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(at)?;
        // SAFETY: the memory's validity is the caller's promise.
        let m = unsafe { mem_region(&c.mem) }
            .map_err(|e| Failure::new(e.0, format!("caches[{i}].mem.{}", e.1)))?;
        out.push(if c.offsets.is_null() {
            m.layers(names)
        } else {
            // SAFETY: `n_layers` offsets by the caller's promise.
            let offs = unsafe { slice_arg(c.offsets, c.n_layers, "offsets") }.map_err(at)?;
            m.pooled_layers(
                names.into_iter().zip(offs.iter().copied()).collect(),
                c.layer_len,
            )
        });
    }
    Ok(out)
}
