//! The one unsafe step of the Python glue: memory at an address Python hands over becomes a
//! region (host memory in place, or NPU memory through the RBLN runtime).
#![allow(unsafe_code)]

use std::sync::Arc;

use kvrail::agent::MemRegion;
use kvrail::mem::{HostBuffer, NpuMemory};
use pyo3::PyResult;

use crate::errors;

/// The RBLN runtime, loaded once, for NPU ("VRAM") registrations.
fn runtime() -> PyResult<Arc<rbln_sys::RblnLib>> {
    rbln_sys::RblnLib::shared().map_err(|e| {
        errors::UnavailableError::new_err(format!(
            "mem_type VRAM: NPU memory needs the RBLN runtime: {e}"
        ))
    })
}

/// `length` bytes at `addr` as a region: `mem_type` "DRAM" (host) or "VRAM" (NPU `dev_id`).
///
/// # Safety
/// The range is memory of that kind (of device `dev_id` for VRAM) that stays allocated and
/// mapped until every reference to the returned region is dropped (the agent drops its own
/// at deregistration, once no transfer uses it).
pub(crate) unsafe fn region(
    addr: u64,
    length: u64,
    mem_type: &str,
    dev_id: i32,
) -> PyResult<MemRegion> {
    if addr == 0 {
        return Err(errors::misuse("addr", "0 (a NULL address)"));
    }
    if length == 0 {
        return Err(errors::misuse(
            "length",
            "0 (a region needs at least one byte)",
        ));
    }
    match mem_type {
        "DRAM" | "cpu" => {
            let a = usize::try_from(addr).map_err(|_| errors::misuse("addr", "too large"))?;
            let n = usize::try_from(length).map_err(|_| errors::misuse("length", "too large"))?;
            // SAFETY: this function's contract: host memory, mapped while registered.
            let b = unsafe { HostBuffer::from_raw(a, n) }
                .map_err(|e| errors::MemoryRegionError::new_err(format!("addr: {e}")))?;
            Ok(MemRegion::host(b))
        }
        "VRAM" | "cuda" | "npu" => {
            let lib = runtime()?;
            // SAFETY: this function's contract: NPU memory of `dev_id`, allocated while
            // registered.
            let m = unsafe { NpuMemory::from_raw(&lib, dev_id, addr, length) }
                .map_err(|e| errors::MemoryRegionError::new_err(format!("addr: {e}")))?;
            Ok(MemRegion::device(m, dev_id))
        }
        o => Err(errors::misuse(
            "mem_type",
            format!("{o:?}: use \"DRAM\" or \"VRAM\""),
        )),
    }
}
