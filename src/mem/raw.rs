//! The caller's host memory as a byte range kvrail did not allocate. This is the one
//! module of `mem` with `unsafe` code: memory that crosses an API boundary as a raw address
//! is an FFI boundary like the verbs and C ABI modules, and its soundness rests on the
//! caller's promise in [`super::HostBuffer::from_raw`], which this type only records.

use std::ptr::NonNull;
use std::sync::Arc;

use super::{nonempty, HostBuffer, MemError};

/// `len` bytes at `ptr`, readable and writable, alive while this value lives.
pub(crate) struct RawRange {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the range is plain host memory; every CPU access goes through the owning
// `HostBuffer`'s lock, and the NIC's concurrent access is what registration allows.
unsafe impl Send for RawRange {}
// SAFETY: as above: `&self` hands out nothing; `bytes` takes `&mut self`.
unsafe impl Sync for RawRange {}

impl RawRange {
    /// # Safety
    /// `[addr, addr + len)` is readable and writable host memory that stays mapped while the
    /// returned value lives, and nothing else creates Rust references into it meanwhile.
    pub(crate) unsafe fn new(addr: usize, len: usize) -> Result<Self, &'static str> {
        let ptr = NonNull::new(addr as *mut u8).ok_or("the address is null")?;
        if addr.checked_add(len).is_none() || len > isize::MAX as usize {
            return Err("the range wraps around the address space");
        }
        Ok(Self { ptr, len })
    }

    /// The bytes, for one CPU copy under the buffer's lock.
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `new`'s contract: the range is valid for reads and writes for `len` bytes
        // while `self` lives, and `&mut self` (taken under the buffer's lock) makes this the
        // only Rust reference into it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl HostBuffer {
    /// `len` bytes of the caller's memory at `addr`, registered in place: what an engine
    /// that allocated its KV cache itself (in C, C++ or Python) hands over.
    ///
    /// # Errors
    /// [`MemError::Alloc`] for a null address, zero length, or a range that wraps.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be readable and writable host memory that stays mapped
    /// until every `Arc` of the returned buffer is dropped (the agent drops its own when the
    /// region is deregistered and no transfer uses it). The caller may keep reading and
    /// writing it, as with any memory a NIC accesses, but must not free it before then.
    pub unsafe fn from_raw(addr: usize, len: usize) -> Result<Arc<Self>, MemError> {
        nonempty(len)?;
        // SAFETY: the caller's promise above is exactly RawRange::new's contract.
        let r = unsafe { RawRange::new(addr, len) }.map_err(|why| MemError::Alloc {
            len,
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, why),
        })?;
        Ok(Self::wrap_raw(r))
    }
}

impl super::NpuMemory {
    /// `len` bytes at `addr` of NPU `dev` that the engine allocated itself (its KV cache),
    /// used in place and never freed by kvrail. The runtime copies the first and last byte
    /// to the host as a check, so an address outside every allocation (on a runtime that
    /// checks) is refused here.
    ///
    /// # Errors
    /// [`MemError::Device`] naming the address when the runtime refuses it.
    ///
    /// # Safety
    /// The range must be memory of device `dev` from `lib`'s runtime that stays allocated
    /// while the returned memory (and any registration of it) lives.
    pub unsafe fn from_raw(
        lib: &Arc<rbln_sys::RblnLib>,
        dev: i32,
        addr: u64,
        len: u64,
    ) -> Result<Arc<Self>, MemError> {
        // SAFETY: the caller's promise is DeviceAlloc::borrow's contract.
        let alloc = unsafe { rbln_sys::DeviceAlloc::borrow(lib, dev, addr, len) }.map_err(|e| {
            MemError::Device(format!(
                "NPU address {addr:#x} (+{len} bytes) is outside every allocation of device \
                 {dev}: {e}"
            ))
        })?;
        Ok(Self::wrap(alloc))
    }
}
