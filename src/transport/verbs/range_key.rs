//! Remote keys over part of a buffer that can be revoked on their own: the fencing
//! mechanism of grants (see `crate::agent::grant`).
//!
//! A [`RangeKey`] is a second registration of `[offset, offset + len)` of a buffer that is
//! (usually) registered already for local work, with remote access only through this key.
//! [`RangeKey::revoke`] (or drop) deregisters it: from then on the NIC refuses every remote
//! READ or WRITE that names its rkey with a remote access error, whatever the peer still
//! holds. The buffer's own registration, and the memory, are untouched.
//!
//! Why a registration and not a memory window: a pull grant is made before the peer has
//! queue pairs to this agent, and a type-2 window is bound to one queue pair (it dies with
//! it when a rail fails and the pair is rebuilt); a type-1 window still needs a bind posted
//! on a live queue pair of the domain. A registration needs neither and works on every
//! device; its cost (pinning already-pinned pages, once per grant and rail) is measured by
//! the lab test of grants.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as ffi;

use super::error::{from_ret, last_os_error, Error};
use super::mr::Access;
use super::pd::{Pd, PdInner};
use crate::mem::HostBuffer;

/// A revocable remote key over `[offset, offset + len)` of a buffer.
pub struct RangeKey {
    mr: Option<NonNull<ffi::ibv_mr>>,
    rkey: u32,
    // Released only after the registration is gone (leaked if deregistration fails).
    buf: Arc<HostBuffer>,
    pd: Arc<PdInner>,
}

// SAFETY: the MR handle is an opaque kernel object; nothing here touches the memory.
unsafe impl Send for RangeKey {}
// SAFETY: see Send.
unsafe impl Sync for RangeKey {}

impl std::fmt::Debug for RangeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeKey")
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .field("live", &self.mr.is_some())
            .finish()
    }
}

impl RangeKey {
    /// Register `[offset, offset + len)` of `buf` in `pd` with `access` (remote rights;
    /// local write is added when remote write is asked, as the verbs require).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a range outside the buffer or of zero length;
    /// [`Error::RegisterMemory`].
    pub fn register(
        pd: &Pd,
        buf: &Arc<HostBuffer>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<Self, Error> {
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(Error::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                region_len: buf.len() as u64,
            });
        }
        let access = access.normalized();
        // SAFETY: `[offset, offset + len)` lies inside the buffer (checked above), which
        // outlives the registration: this key holds an Arc of it and releases it only
        // after deregistering.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                pd.raw(),
                buf.ptr().add(offset).cast(),
                len,
                access.bits() as i32,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| Error::RegisterMemory {
            len,
            access: access.to_string(),
            source: last_os_error(),
        })?;
        // SAFETY: the MR was just registered and is valid; rkey is immutable.
        let rkey = unsafe { mr.as_ref().rkey };
        Ok(Self {
            mr: Some(mr),
            rkey,
            buf: buf.clone(),
            pd: pd.inner.clone(),
        })
    }

    /// The key a peer names in its work requests (with the buffer's virtual addresses).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Deregister now: the NIC refuses the key from here on.
    ///
    /// # Errors
    /// [`Error::DeregisterMemory`] (the registration and the memory are then kept for the
    /// life of the process: the NIC may still reach the pages).
    pub fn revoke(mut self) -> Result<(), Error> {
        self.dereg()
    }

    fn dereg(&mut self) -> Result<(), Error> {
        let Some(mr) = self.mr.take() else {
            return Ok(());
        };
        // SAFETY: the MR is valid (taken once); no local work request names it (remote use
        // only), and remote use after this is what deregistration refuses.
        let ret = unsafe { ffi::ibv_dereg_mr(mr.as_ptr()) };
        if ret != 0 {
            std::mem::forget(self.buf.clone());
            return Err(Error::DeregisterMemory(from_ret(ret)));
        }
        Ok(())
    }
}

impl Drop for RangeKey {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            tracing::error!(device = %self.pd.ctx.name, error = %e,
                "cannot revoke a range key (its memory stays mapped)");
        }
    }
}
