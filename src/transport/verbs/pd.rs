//! Protection domains.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as ffi;

use super::device::{Context, ContextInner};
use super::error::{from_ret, last_os_error, Error};

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ffi::ibv_pd>,
    // Declared after `pd`: the context is released only after the PD is deallocated.
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: a PD is an opaque kernel handle; verbs taking it are thread-safe.
unsafe impl Send for PdInner {}
// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of this PD, so none of them is left.
        let ret = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
        if ret != 0 {
            tracing::error!(device = %self.ctx.name, "ibv_dealloc_pd failed: {}", from_ret(ret));
        }
    }
}

/// A protection domain: memory regions and queue pairs of one PD can work together.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for Pd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pd")
            .field("device", &self.inner.ctx.name)
            .finish()
    }
}

impl Pd {
    /// `ibv_alloc_pd`.
    ///
    /// # Errors
    /// [`Error::AllocPd`].
    pub fn new(ctx: &Context) -> Result<Self, Error> {
        // SAFETY: live context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.raw()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::AllocPd {
            device: ctx.name().to_owned(),
            source: last_os_error(),
        })?;
        Ok(Self {
            inner: Arc::new(PdInner {
                pd,
                ctx: ctx.inner.clone(),
            }),
        })
    }

    /// The device this PD belongs to.
    pub fn device_name(&self) -> &str {
        &self.inner.ctx.name
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_pd {
        self.inner.pd.as_ptr()
    }
}
