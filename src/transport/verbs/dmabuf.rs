//! dma-buf memory regions (`ibv_reg_dmabuf_mr`): accelerator memory the NIC reaches through a
//! dma-buf file descriptor instead of host page tables, and the per-device probe that says
//! whether a device can do it at all.
//!
//! The probe is UCX's: register with `fd = -1`. A device whose driver implements dma-buf
//! registration gets as far as looking the descriptor up and fails with `EBADF`; one without
//! fails earlier with `EOPNOTSUPP` (rxe, irdma and bnxt_re on some kernels). Any other errno
//! also counts as unsupported, with the errno reported.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as ffi;

use super::error::{from_ret, last_os_error, Error};
use super::mr::Access;
use super::pd::{Pd, PdInner};

/// Whether a device can register dma-buf memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmabufSupport {
    /// `ibv_reg_dmabuf_mr` reached the descriptor lookup (`EBADF` for fd -1).
    Supported,
    /// It cannot: the errno the probe got and what it means.
    Unsupported {
        /// The errno.
        errno: i32,
        /// A sentence for the log.
        reason: String,
    },
}

impl DmabufSupport {
    /// True when supported.
    pub fn is_supported(&self) -> bool {
        matches!(self, Self::Supported)
    }

    /// Classify the errno of a probe registration with `fd = -1`.
    pub fn from_probe_errno(device: &str, errno: i32) -> Self {
        match errno {
            libc::EBADF => Self::Supported,
            libc::EOPNOTSUPP => Self::Unsupported {
                errno,
                reason: format!(
                    "{device} cannot register dma-buf memory (ibv_reg_dmabuf_mr: EOPNOTSUPP; \
                     its driver has no dma-buf support)"
                ),
            },
            e => Self::Unsupported {
                errno: e,
                reason: format!(
                    "{device}: the dma-buf probe failed with {} (expected EBADF from a device \
                     that supports dma-buf)",
                    std::io::Error::from_raw_os_error(e)
                ),
            },
        }
    }
}

/// Probe `pd`'s device for dma-buf registration (see the module docs).
pub fn probe_dmabuf(pd: &Pd) -> DmabufSupport {
    let page = 4096;
    let access = Access::LOCAL_WRITE.bits() as i32;
    // SAFETY: fd -1 refers to no memory: the call either fails (the expected outcome) or,
    // on a driver that accepts it anyway, returns a region we deregister at once.
    let mr = unsafe { ffi::ibv_reg_dmabuf_mr(pd.raw(), 0, page, 0, -1, access) };
    if let Some(mr) = NonNull::new(mr) {
        // SAFETY: `mr` was just registered and nothing else references it.
        unsafe { ffi::ibv_dereg_mr(mr.as_ptr()) };
        return DmabufSupport::Supported;
    }
    let errno = last_os_error().raw_os_error().unwrap_or(0);
    DmabufSupport::from_probe_errno(pd.device_name(), errno)
}

/// A memory region over a dma-buf. The exporter's file descriptor must stay open while the
/// region is registered (the caller keeps it; the region borrows nothing else).
pub struct DmabufMr {
    mr: NonNull<ffi::ibv_mr>,
    len: u64,
    iova: u64,
    _pd: Arc<PdInner>,
}

// SAFETY: an ibv_mr handle may be used and deregistered from any thread.
unsafe impl Send for DmabufMr {}
// SAFETY: shared access only reads the immutable keys.
unsafe impl Sync for DmabufMr {}

impl DmabufMr {
    /// Register `len` bytes at `offset` of the dma-buf `fd`; peers address them from `iova`.
    ///
    /// # Errors
    /// [`Error::RegisterMemory`] with the OS error (`EOPNOTSUPP` where the device has no
    /// dma-buf support: probe first with [`probe_dmabuf`]).
    pub fn register(
        pd: &Pd,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        access: Access,
    ) -> Result<Self, Error> {
        let access = access.normalized();
        // SAFETY: `fd` is an open descriptor for the call's duration; the kernel takes its own
        // reference to the dma-buf, so the region never points at freed memory.
        let mr = unsafe {
            ffi::ibv_reg_dmabuf_mr(
                pd.raw(),
                offset,
                len as usize,
                iova,
                fd.as_raw_fd(),
                access.bits() as i32,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| Error::RegisterMemory {
            len: len as usize,
            access: access.to_string(),
            source: last_os_error(),
        })?;
        Ok(Self {
            mr,
            len,
            iova,
            _pd: pd.inner.clone(),
        })
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty region (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address peers use for the first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is valid while self lives; lkey is immutable.
        unsafe { self.mr.as_ref().lkey }
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is valid while self lives; rkey is immutable.
        unsafe { self.mr.as_ref().rkey }
    }
}

impl Drop for DmabufMr {
    fn drop(&mut self) {
        // SAFETY: registered by `register` and deregistered only here.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if ret != 0 {
            tracing::error!("ibv_dereg_mr (dma-buf) failed: {}", from_ret(ret));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_errno_classification() {
        assert!(DmabufSupport::from_probe_errno("mlx5_0", libc::EBADF).is_supported());
        let u = DmabufSupport::from_probe_errno("rxe0", libc::EOPNOTSUPP);
        let DmabufSupport::Unsupported { errno, reason } = &u else {
            panic!("{u:?}")
        };
        assert_eq!(*errno, libc::EOPNOTSUPP);
        assert!(
            reason.contains("rxe0") && reason.contains("EOPNOTSUPP"),
            "{reason}"
        );
        let u = DmabufSupport::from_probe_errno("x", libc::EINVAL);
        assert!(!u.is_supported());
    }
}
