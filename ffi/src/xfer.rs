//! `kvrail_xfer`: transfer requests (create, post, status, wait, error, free).

use std::ffi::c_char;
use std::sync::Arc;
use std::time::Duration;

use kvrail::agent::{Agent, Desc, RegionId, XferId, XferOp, XferStatus};

use crate::agent::{handle, kvrail_agent};
use crate::result::{kvrail_result, Failure};
use crate::util::{boundary, bytes_arg, null, put, slice_arg, str_arg, write_bytes};

/// A transfer request (opaque), bound to the agent that created it.
pub struct kvrail_xfer {
    _private: [u8; 0],
}

struct XferHandle {
    agent: Arc<Agent>,
    id: XferId,
}

/// `len` bytes at `offset` of region `region` (local, or the peer's as its metadata says).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvrail_desc {
    /// Region id.
    pub region: u32,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// READ or WRITE.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvrail_op {
    /// Peer → local.
    Read = 0,
    /// Local → peer.
    Write = 1,
}

/// Where a transfer stands.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvrail_xfer_state {
    /// Created, not posted.
    NotPosted = 0,
    /// Bytes are moving.
    InProgress = 1,
    /// Every byte landed (the notification, if any, came after them).
    Done = 2,
    /// Failed; `kvrail_xfer_error` says why.
    Failed = 3,
}

/// # Safety
/// `p` is NULL or from [`kvrail_xfer_new`] and not yet freed.
unsafe fn xfer<'a>(p: *const kvrail_xfer) -> Result<&'a XferHandle, Failure> {
    if p.is_null() {
        return Err(null("xfer"));
    }
    // SAFETY: non-NULL pointers come from `kvrail_xfer_new` (a leaked Box<XferHandle>),
    // valid until `kvrail_xfer_free`, by the caller's promise.
    Ok(unsafe { &*p.cast::<XferHandle>() })
}

fn descs(d: &[kvrail_desc]) -> Vec<Desc> {
    d.iter()
        .map(|d| Desc::new(RegionId(d.region), d.offset, d.len))
        .collect()
}

/// Create a transfer (`op`: a [`kvrail_op`] value): `local[i]` pairs with `remote[i]` (regions of `peer`); `notif` (may
/// be NULL with `notif_len` 0 for none; an empty notification needs a non-NULL pointer)
/// reaches the peer after every byte. Nothing moves until [`kvrail_xfer_post`].
///
/// # Safety
/// `agent` from `kvrail_agent_new`; the arrays valid for their counts; `peer`
/// NUL-terminated; `notif` valid for `notif_len` bytes; `out` writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvrail_xfer_new(
    agent: *const kvrail_agent,
    op: u32,
    local: *const kvrail_desc,
    local_count: usize,
    peer: *const c_char,
    remote: *const kvrail_desc,
    remote_count: usize,
    notif: *const u8,
    notif_len: usize,
    out: *mut *mut kvrail_xfer,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises, passed on.
        let (h, local, peer, remote) = unsafe {
            (
                handle(agent)?,
                slice_arg(local, local_count, "local")?,
                str_arg(peer, "peer")?,
                slice_arg(remote, remote_count, "remote")?,
            )
        };
        let notif = if notif.is_null() && notif_len == 0 {
            None
        } else {
            // SAFETY: the caller's promise.
            Some(unsafe { bytes_arg(notif, notif_len, "notif") }?.to_vec())
        };
        if out.is_null() {
            return Err(null("out"));
        }
        let op = match op {
            o if o == kvrail_op::Read as u32 => XferOp::Read,
            o if o == kvrail_op::Write as u32 => XferOp::Write,
            o => {
                return Err(Failure::new(
                    kvrail_result::InvalidArgument,
                    format!("op {o} is neither KVRAIL_OP_READ nor KVRAIL_OP_WRITE"),
                ))
            }
        };
        let id = h
            .agent
            .create_xfer(op, descs(local), peer, descs(remote), notif)?;
        let x = Box::new(XferHandle {
            agent: h.agent.clone(),
            id,
        });
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out, Box::into_raw(x).cast::<kvrail_xfer>(), "out") }
    })
}

/// Start the transfer (again, after it finished: a repost moves the bytes again).
///
/// # Safety
/// `x` from [`kvrail_xfer_new`].
#[no_mangle]
pub unsafe extern "C" fn kvrail_xfer_post(x: *const kvrail_xfer) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let x = unsafe { xfer(x) }?;
        Ok(x.agent.post(x.id)?)
    })
}

fn status_of(s: &XferStatus) -> kvrail_xfer_state {
    match s {
        XferStatus::NotPosted => kvrail_xfer_state::NotPosted,
        XferStatus::InProgress => kvrail_xfer_state::InProgress,
        XferStatus::Done => kvrail_xfer_state::Done,
        XferStatus::Error(_) => kvrail_xfer_state::Failed,
    }
}

/// The transfer's status, without waiting.
///
/// # Safety
/// `x` from [`kvrail_xfer_new`]; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_xfer_status(
    x: *const kvrail_xfer,
    out: *mut kvrail_xfer_state,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let x = unsafe { xfer(x) }?;
        let s = x.agent.status(x.id)?;
        // SAFETY: the caller's promise.
        unsafe { put(out, status_of(&s), "out") }
    })
}

/// Sleep until the transfer is no longer in progress or `timeout_ms` passed. Returns
/// `KVRAIL_RESULT_OK` when done, `KVRAIL_RESULT_XFER_FAILED` when it failed,
/// `KVRAIL_RESULT_TIMEOUT` when it is still in progress.
///
/// # Safety
/// `x` from [`kvrail_xfer_new`].
#[no_mangle]
pub unsafe extern "C" fn kvrail_xfer_wait(x: *const kvrail_xfer, timeout_ms: u64) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let x = unsafe { xfer(x) }?;
        match x.agent.wait(x.id, Duration::from_millis(timeout_ms))? {
            XferStatus::Done => Ok(()),
            XferStatus::Error(e) => Err(Failure::new(kvrail_result::XferFailed, e.to_string())),
            XferStatus::InProgress => Err(Failure::new(
                kvrail_result::Timeout,
                format!("transfer still in progress after {timeout_ms} ms"),
            )),
            XferStatus::NotPosted => Err(Failure::new(
                kvrail_result::InvalidArgument,
                "the transfer was never posted",
            )),
        }
    })
}

/// Why the transfer failed (empty unless its status is failed) into `buf`.
///
/// # Safety
/// `x` from [`kvrail_xfer_new`]; `buf` valid for `len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_xfer_error(
    x: *const kvrail_xfer,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let x = unsafe { xfer(x) }?;
        let msg = match x.agent.status(x.id)? {
            XferStatus::Error(e) => e.to_string(),
            _ => String::new(),
        };
        // SAFETY: the caller's promises.
        unsafe { write_bytes(msg.as_bytes(), buf, len, out_len) }
    })
}

/// Release the transfer and free the handle. Refused with
/// [`kvrail_result::XferActive`] while it is in progress (the handle stays valid).
///
/// # Safety
/// `x` is NULL or from [`kvrail_xfer_new`]; not used after a successful call.
#[no_mangle]
pub unsafe extern "C" fn kvrail_xfer_free(x: *mut kvrail_xfer) -> kvrail_result {
    boundary(|| {
        if x.is_null() {
            return Ok(());
        }
        {
            // SAFETY: the caller's promise.
            let h = unsafe { xfer(x) }?;
            h.agent.release(h.id)?;
        }
        // SAFETY: from `kvrail_xfer_new` (Box::into_raw); released above, freed once.
        drop(unsafe { Box::from_raw(x.cast::<XferHandle>()) });
        Ok(())
    })
}
