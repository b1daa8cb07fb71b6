//! Device memory: one `rbln_malloc` allocation, freed on drop.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::load::{check, RblnError, RblnLib};
use crate::MemcpyKind;

/// NPU memory exported as a dma-buf: what `ibv_reg_dmabuf_mr` takes.
#[derive(Debug)]
pub struct Dmabuf {
    /// The dma-buf file descriptor.
    pub fd: OwnedFd,
    /// Offset of the memory in the dma-buf.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The address the NIC uses for the first byte.
    pub iova: u64,
}

/// One device allocation. The CPU reaches it only by copies through the runtime
/// (`rbln_memcpy`); its address is a runtime address, never dereferenced here.
pub struct DeviceAlloc {
    lib: Arc<RblnLib>,
    dev: i32,
    ptr: *mut c_void,
    len: u64,
    /// Freed on drop: kvrail's own allocation, not the caller's ([`DeviceAlloc::borrow`]).
    owned: bool,
}

impl fmt::Debug for DeviceAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAlloc")
            .field("dev", &self.dev)
            .field("addr", &format_args!("{:#x}", self.ptr as usize))
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the allocation is an address the runtime owns; every access goes through the
// runtime's thread-safe copy calls, and freeing happens once, on drop.
unsafe impl Send for DeviceAlloc {}
// SAFETY: as above; `&self` methods only pass the address to the runtime.
unsafe impl Sync for DeviceAlloc {}

impl DeviceAlloc {
    /// Allocate `len` bytes on device `dev` (`rbln_malloc`).
    ///
    /// # Errors
    /// [`RblnError::Call`] (also for `len == 0` or an unknown device, which the runtime
    /// rejects).
    pub fn new(lib: &Arc<RblnLib>, dev: i32, len: u64) -> Result<Self, RblnError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer for the duration of the call.
        let rc = unsafe { (lib.t.malloc)(dev, len, &mut ptr) };
        check("rbln_malloc", rc)?;
        if ptr.is_null() {
            return Err(RblnError::Call {
                call: "rbln_malloc",
                code: 0,
            });
        }
        Ok(Self {
            lib: lib.clone(),
            dev,
            ptr,
            len,
            owned: true,
        })
    }

    /// `len` bytes at `addr` of device `dev` that the caller allocated (an engine's KV
    /// cache): used in place, never freed here. The runtime is asked to copy the first and
    /// the last byte to the host, so an address outside every allocation of that device
    /// (on a runtime that checks, as the test runtime does) is refused now rather than at
    /// the first transfer.
    ///
    /// # Errors
    /// [`RblnError::Call`] (null address, zero length, or the runtime refusing the probe
    /// copies: the range is not device memory of `dev`).
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of device `dev` from this runtime that stays
    /// allocated until the returned value is dropped.
    pub unsafe fn borrow(
        lib: &Arc<RblnLib>,
        dev: i32,
        addr: u64,
        len: u64,
    ) -> Result<Self, RblnError> {
        let bad = RblnError::Call {
            call: "rbln_memcpy",
            code: 2,
        };
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(bad);
        }
        let me = Self {
            lib: lib.clone(),
            dev,
            ptr: addr as *mut c_void,
            len,
            owned: false,
        };
        let mut b = [0u8; 1];
        me.copy_to_host(0, &mut b)?;
        me.copy_to_host(len - 1, &mut b)?;
        Ok(me)
    }

    /// The device.
    pub fn device(&self) -> i32 {
        self.dev
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty allocation (never: the runtime refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runtime address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn range(&self, offset: u64, len: usize) -> Result<*mut c_void, RblnError> {
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr.wrapping_byte_add(offset as usize)),
            _ => Err(RblnError::OutOfRange {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copy `src` to the device at `offset` (`rbln_memcpy`, host → device).
    ///
    /// # Errors
    /// [`RblnError::OutOfRange`], [`RblnError::Call`].
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<(), RblnError> {
        let dst = self.range(offset, src.len())?;
        // SAFETY: `dst` lies inside this live allocation (checked above) and `src` is a valid
        // host slice of the same length.
        let rc = unsafe {
            (self.lib.t.memcpy)(
                self.dev,
                dst,
                src.as_ptr().cast(),
                src.len() as u64,
                MemcpyKind::HostToDevice as c_int,
            )
        };
        check("rbln_memcpy", rc)
    }

    /// Copy `dst.len()` bytes at `offset` from the device into `dst` (device → host).
    ///
    /// # Errors
    /// [`RblnError::OutOfRange`], [`RblnError::Call`].
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), RblnError> {
        let src = self.range(offset, dst.len())?;
        // SAFETY: `src` lies inside this live allocation (checked above) and `dst` is a valid,
        // exclusively borrowed host slice of the same length.
        let rc = unsafe {
            (self.lib.t.memcpy)(
                self.dev,
                dst.as_mut_ptr().cast(),
                src,
                dst.len() as u64,
                MemcpyKind::DeviceToHost as c_int,
            )
        };
        check("rbln_memcpy", rc)
    }

    /// Export the allocation as a dma-buf (kvrail's optional `rbln_rdma_export_dmabuf`).
    ///
    /// # Errors
    /// [`RblnError::Unsupported`] when the runtime lacks the entry point (every public
    /// runtime does), [`RblnError::Call`].
    pub fn export_dmabuf(&self) -> Result<Dmabuf, RblnError> {
        let f = self
            .lib
            .t
            .export_dmabuf
            .ok_or_else(|| self.lib.no_export())?;
        let (mut fd, mut offset, mut iova): (c_int, u64, u64) = (-1, 0, 0);
        // SAFETY: the allocation is live and the three out-pointers are valid for the call.
        let rc = unsafe {
            f(
                self.dev,
                self.ptr,
                self.len,
                &mut fd,
                &mut offset,
                &mut iova,
            )
        };
        check("rbln_rdma_export_dmabuf", rc)?;
        if fd < 0 {
            return Err(RblnError::Call {
                call: "rbln_rdma_export_dmabuf",
                code: rc,
            });
        }
        Ok(Dmabuf {
            // SAFETY: on success the runtime hands the caller a new descriptor it owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            offset,
            len: self.len,
            iova,
        })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: the pointer came from `rbln_malloc` on this device and is freed once.
        let rc = unsafe { (self.lib.t.free)(self.dev, self.ptr) };
        if rc != 0 {
            tracing::error!(
                dev = self.dev,
                addr = self.ptr as usize,
                rc,
                "rbln_free failed; the device memory is leaked"
            );
        }
    }
}
