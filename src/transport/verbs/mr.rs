//! Memory regions over host memory that the region owns.
//!
//! A region holds an `Arc` of its [`HostBuffer`] (anonymous, page-aligned mmap), so the
//! memory the NIC may touch cannot be freed while it is registered; one buffer may be
//! registered on several devices. [`Mr`] is the one user handle (not `Clone`);
//! every posted work request that references the region holds a [`MrRef`] (another `Arc`
//! of it) until its completion is polled. So the references beyond the user's are exactly
//! the in-flight requests: [`Mr::deregister`] refuses while any exist, and dropping the user
//! handle while work is in flight defers the real `ibv_dereg_mr` until the completion
//! releases the last reference.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as ffi;
use serde::{Deserialize, Serialize};

use super::error::{from_ret, last_os_error, Error};
use super::pd::{Pd, PdInner};
use crate::mem::HostBuffer;

/// Access rights of a memory region (a subset of `ibv_access_flags`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No remote access; local reads only (a WRITE/SEND source).
    pub const NONE: Self = Self(0);
    /// The local NIC may write (a READ destination, a RECV buffer).
    pub const LOCAL_WRITE: Self = Self(1);
    /// Peers may RDMA WRITE into the region (needs `LOCAL_WRITE`; added automatically).
    pub const REMOTE_WRITE: Self = Self(2);
    /// Peers may RDMA READ from the region.
    pub const REMOTE_READ: Self = Self(4);

    /// Both sets.
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// True when every flag of `other` is set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw `ibv_access_flags` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// The flags the verbs need: REMOTE_WRITE requires LOCAL_WRITE (man ibv_reg_mr).
    pub(crate) fn normalized(self) -> Self {
        if self.contains(Self::REMOTE_WRITE) {
            self.union(Self::LOCAL_WRITE)
        } else {
            self
        }
    }
}

impl std::ops::BitOr for Access {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.union(rhs)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (flag, name) in [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
        ] {
            if self.contains(flag) {
                names.push(name);
            }
        }
        if names.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&names.join("|"))
        }
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Access({self})")
    }
}

/// What a peer needs to address a region with one-sided operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Virtual address of the first byte on the peer.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The peer's rkey.
    pub rkey: u32,
}

impl RemoteRegion {
    /// True when `[offset, offset + len)` lies inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

pub(crate) struct MrInner {
    mr: NonNull<ffi::ibv_mr>,
    // Released by Drop only after `mr` was deregistered (leaked if that fails: the NIC may
    // still reference the pages). The PD reference is released after both.
    buf: Arc<HostBuffer>,
    deregistered: bool,
    access: Access,
    pd: Arc<PdInner>,
}

// SAFETY: the MR handle is an opaque kernel object; the buffer is only accessed through
// raw-pointer copies (the NIC may write it concurrently, like any RDMA buffer).
unsafe impl Send for MrInner {}
// SAFETY: see Send.
unsafe impl Sync for MrInner {}

impl MrInner {
    fn dereg(&mut self) -> Result<(), Error> {
        if self.deregistered {
            return Ok(());
        }
        // SAFETY: the MR is valid (not yet deregistered) and no WR references it: every
        // in-flight WR holds an Arc of this inner, and we have it exclusively.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if ret != 0 {
            return Err(Error::DeregisterMemory(from_ret(ret)));
        }
        self.deregistered = true;
        Ok(())
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is valid while self lives; lkey is immutable after registration.
        unsafe { self.mr.as_ref().lkey }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.buf.addr()
    }

    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn pd(&self) -> &Arc<PdInner> {
        &self.pd
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            // The NIC may still reference the pages: keep them mapped forever.
            std::mem::forget(self.buf.clone());
            tracing::error!(device = %self.pd.ctx.name, error = %e, "deregistration failed (memory leaked, not unmapped)");
        }
    }
}

/// A registered memory region that owns its host memory.
pub struct Mr {
    inner: Arc<MrInner>,
}

impl fmt::Debug for Mr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.inner.addr()))
            .field("len", &self.inner.len())
            .field("access", &self.inner.access)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// A reference to a region held by a posted work request until its completion is polled.
pub(crate) struct MrRef {
    _region: Arc<MrInner>,
}

impl MrRef {
    pub(crate) fn new(inner: &Arc<MrInner>) -> Self {
        Self {
            _region: inner.clone(),
        }
    }
}

impl Mr {
    /// Allocate `len` bytes of zeroed, page-aligned host memory and register it with `access`.
    ///
    /// # Errors
    /// [`Error::AllocMemory`], [`Error::RegisterMemory`].
    pub fn alloc(pd: &Pd, len: usize, access: Access) -> Result<Self, Error> {
        Self::register(pd, &HostBuffer::new(len).map_err(Error::from)?, access)
    }

    /// Register `buf` (all of it) in `pd` with `access`. The region keeps the buffer alive.
    ///
    /// # Errors
    /// [`Error::RegisterMemory`].
    pub fn register(pd: &Pd, buf: &Arc<HostBuffer>, access: Access) -> Result<Self, Error> {
        let access = access.normalized();
        let len = buf.len();
        // SAFETY: the buffer is valid for `len` bytes and outlives the registration (the
        // region holds an Arc of it and releases it only after deregistering).
        let mr = unsafe { ffi::ibv_reg_mr(pd.raw(), buf.ptr().cast(), len, access.bits() as i32) };
        let mr = NonNull::new(mr).ok_or_else(|| Error::RegisterMemory {
            len,
            access: access.to_string(),
            source: last_os_error(),
        })?;
        Ok(Self {
            inner: Arc::new(MrInner {
                mr,
                buf: buf.clone(),
                deregistered: false,
                access,
                pd: pd.inner.clone(),
            }),
        })
    }

    /// The memory behind the region.
    pub fn buffer(&self) -> &Arc<HostBuffer> {
        &self.inner.buf
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// True for a zero-length region (never, since registration needs memory).
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }

    /// Virtual address of the first byte.
    pub fn addr(&self) -> u64 {
        self.inner.addr()
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey()
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: MR valid while self lives; rkey is immutable.
        unsafe { self.inner.mr.as_ref().rkey }
    }

    /// The access rights it was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// What a peer needs to READ or WRITE this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }

    /// Posted work requests that still reference this region.
    pub fn in_flight(&self) -> usize {
        Arc::strong_count(&self.inner) - 1
    }

    pub(crate) fn inner(&self) -> &Arc<MrInner> {
        &self.inner
    }

    /// Another handle on this registration, for queue pairs of the same protection domain
    /// (the agent's lanes of one port). The registration goes when the last handle and the
    /// last work request referencing it do; [`Mr::in_flight`] counts the other handles too.
    pub(crate) fn share(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }

    /// Copy `data` into the region at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), Error> {
        Ok(self.inner.buf.write(offset, data)?)
    }

    /// Copy `parts` into the region one after another from `offset`, with one range check
    /// and one lock: how many bytes. Nothing is written when they do not all fit.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub fn write_parts(&self, offset: usize, parts: &[&[u8]]) -> Result<usize, Error> {
        Ok(self.inner.buf.write_parts(offset, parts)?)
    }

    /// Copy `out.len()` bytes at `offset` out of the region.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        Ok(self.inner.buf.read(offset, out)?)
    }

    /// Deregister the region and free its memory now.
    ///
    /// # Errors
    /// Refused with [`Error::RegionBusy`] while posted work requests still reference the
    /// region (poll their completions first): the region comes back in
    /// [`DeregisterError::region`]. When `ibv_dereg_mr`
    /// itself fails the memory is leaked rather than freed under the NIC.
    pub fn deregister(self) -> Result<(), DeregisterError> {
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => match inner.dereg() {
                Ok(()) => Ok(()), // Drop unmaps the buffer
                Err(error) => {
                    std::mem::forget(inner);
                    Err(DeregisterError {
                        region: None,
                        error,
                    })
                }
            },
            Err(inner) => {
                let in_flight = Arc::strong_count(&inner) - 1;
                Err(DeregisterError {
                    region: Some(Self { inner }),
                    error: Error::RegionBusy { in_flight },
                })
            }
        }
    }
}

/// Work requests in flight on any of `mrs` (handles of one region on each rail, some sharing
/// one registration): each registration's references beyond the handles here. Zero means
/// dropping the handles deregisters every one of them at once.
pub(crate) fn work_in_flight(mrs: &[Mr]) -> usize {
    let mut seen: Vec<*const MrInner> = Vec::new();
    let mut n = 0;
    for m in mrs {
        let p = Arc::as_ptr(&m.inner);
        if seen.contains(&p) {
            continue;
        }
        seen.push(p);
        let handles = mrs
            .iter()
            .filter(|o| Arc::ptr_eq(&o.inner, &m.inner))
            .count();
        n += Arc::strong_count(&m.inner) - handles;
    }
    n
}

/// A refused or failed [`Mr::deregister`].
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct DeregisterError {
    /// The region, still registered, when deregistration was refused.
    pub region: Option<Mr>,
    /// Why.
    pub error: Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_write_implies_local_write() {
        assert_eq!(
            Access::REMOTE_WRITE.normalized(),
            Access::REMOTE_WRITE | Access::LOCAL_WRITE
        );
        assert_eq!(Access::REMOTE_READ.normalized(), Access::REMOTE_READ);
        assert_eq!(Access::NONE.normalized().bits(), 0);
    }

    #[test]
    fn access_names() {
        assert_eq!(Access::NONE.to_string(), "NONE");
        assert_eq!(
            (Access::REMOTE_READ | Access::LOCAL_WRITE).to_string(),
            "LOCAL_WRITE|REMOTE_READ"
        );
        assert!((Access::REMOTE_READ | Access::REMOTE_WRITE).contains(Access::REMOTE_READ));
        assert!(!Access::REMOTE_READ.contains(Access::REMOTE_WRITE));
    }

    #[test]
    fn remote_region_bounds() {
        let r = RemoteRegion {
            addr: 0x1000,
            len: 4096,
            rkey: 7,
        };
        assert!(r.contains(0, 4096));
        assert!(r.contains(4096, 0));
        assert!(!r.contains(4090, 7));
        assert!(
            !r.contains(u64::MAX, 2),
            "overflow must not wrap into range"
        );
    }
}
