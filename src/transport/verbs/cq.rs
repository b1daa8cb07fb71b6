//! Completion queues, their completion channels (an fd for mio), and polling in batches.

use std::ffi::CStr;
use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdma_mummy_sys as ffi;

use super::device::{Context, ContextInner};
use super::error::{from_ret, last_os_error, Error};
use super::wc::{QpShared, WcError};
use super::wr::{OpKind, Retired, RECV_BIT};
use crate::idhash::IdMap;

/// Completions read per `ibv_poll_cq` call.
const POLL_BATCH: usize = 64;

/// A polled work completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The caller's wr_id.
    pub wr_id: u64,
    /// Queue pair number.
    pub qpn: u32,
    /// The operation.
    pub op: OpKind,
    /// Bytes received (receives only; 0 otherwise).
    pub byte_len: u32,
    /// Immediate data (host order), for receives that carried some.
    pub imm: Option<u32>,
    /// Success, or why it failed.
    pub status: Result<(), WcError>,
}

pub(crate) struct CqInner {
    cq: NonNull<ffi::ibv_cq>,
    channel: Option<NonNull<ffi::ibv_comp_channel>>,
    entries: u32,
    /// Queue pairs whose completions land here, by qpn.
    qps: Mutex<IdMap<u32, Arc<QpShared>>>,
    // Released last: the CQ and channel are destroyed first.
    ctx: Arc<ContextInner>,
}

// SAFETY: CQ verbs are thread-safe in libibverbs; the tracking map is behind a mutex.
unsafe impl Send for CqInner {}
// SAFETY: see Send.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc of it, so none is left; all events
        // were acked when read. The channel is destroyed after the CQ (man ibv_create_cq).
        let ret = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
        if ret != 0 {
            tracing::error!(device = %self.ctx.name, "ibv_destroy_cq failed: {}", from_ret(ret));
            return; // the channel is still attached: leak it too
        }
        if let Some(ch) = self.channel {
            // SAFETY: the only CQ on this channel is gone.
            let ret = unsafe { ffi::ibv_destroy_comp_channel(ch.as_ptr()) };
            if ret != 0 {
                tracing::error!(device = %self.ctx.name, "ibv_destroy_comp_channel failed: {}", from_ret(ret));
            }
        }
    }
}

impl CqInner {
    pub(crate) fn raw(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    pub(crate) fn attach(&self, qpn: u32, shared: Arc<QpShared>) {
        self.lock_qps().insert(qpn, shared);
    }

    pub(crate) fn detach(&self, qpn: u32) {
        self.lock_qps().remove(&qpn);
    }

    fn lock_qps(&self) -> MutexGuard<'_, IdMap<u32, Arc<QpShared>>> {
        self.qps.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A completion queue, optionally with its own completion channel for event-driven waits.
#[derive(Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq")
            .field("device", &self.inner.ctx.name)
            .field("entries", &self.inner.entries)
            .field("channel", &self.inner.channel.is_some())
            .finish()
    }
}

fn status_name(s: u32) -> &'static str {
    use ffi::ibv_wc_status::*;
    match s {
        IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
        IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
        IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
        IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
        IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
        IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
        IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
        IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
        IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
        IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
        IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
        IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
        IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
        IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
        IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
        IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
        IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
        _ => "IBV_WC_(other)",
    }
}

fn status_text(s: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a static string (or NULL from the shim).
    let p = unsafe { ffi::ibv_wc_status_str(s) };
    if p.is_null() {
        return format!("status {s}");
    }
    // SAFETY: non-null static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Cq {
    /// A CQ of `entries` entries without a completion channel (poll-only).
    ///
    /// # Errors
    /// [`Error::CreateCq`].
    pub fn new(ctx: &Context, entries: u32) -> Result<Self, Error> {
        Self::create(ctx, entries, false)
    }

    /// A CQ with its own completion channel: [`Cq::wait`] sleeps in the kernel, and the
    /// channel's fd ([`AsRawFd`]) can be registered with mio (`SourceFd`, readable).
    ///
    /// # Errors
    /// [`Error::CreateCompChannel`], [`Error::CreateCq`], [`Error::ReqNotifyCq`].
    pub fn with_channel(ctx: &Context, entries: u32) -> Result<Self, Error> {
        Self::create(ctx, entries, true)
    }

    fn create(ctx: &Context, entries: u32, channel: bool) -> Result<Self, Error> {
        let ch = if channel {
            // SAFETY: live context.
            let ch = unsafe { ffi::ibv_create_comp_channel(ctx.raw()) };
            let ch = NonNull::new(ch).ok_or_else(|| Error::CreateCompChannel(last_os_error()))?;
            // SAFETY: the channel's fd is owned by the channel and valid while it lives.
            let fd = unsafe { ch.as_ref().fd };
            set_nonblocking(fd).map_err(Error::CreateCompChannel)?;
            Some(ch)
        } else {
            None
        };
        let chp = ch.map_or(std::ptr::null_mut(), |c| c.as_ptr());
        // SAFETY: live context; `chp` is NULL or a live channel of the same context.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx.raw(), entries as i32, std::ptr::null_mut(), chp, 0) };
        let Some(cq) = NonNull::new(cq) else {
            let source = last_os_error();
            if let Some(ch) = ch {
                // SAFETY: the channel has no CQ; destroyed once.
                unsafe { ffi::ibv_destroy_comp_channel(ch.as_ptr()) };
            }
            return Err(Error::CreateCq { entries, source });
        };
        let cq = Self {
            inner: Arc::new(CqInner {
                cq,
                channel: ch,
                entries,
                qps: Mutex::new(IdMap::default()),
                ctx: ctx.inner.clone(),
            }),
        };
        if channel {
            cq.arm()?;
        }
        Ok(cq)
    }

    /// Number of entries.
    pub fn entries(&self) -> u32 {
        self.inner.entries
    }

    /// Ask for one completion event (`ibv_req_notify_cq`) on the next completion.
    ///
    /// # Errors
    /// [`Error::ReqNotifyCq`].
    pub fn arm(&self) -> Result<(), Error> {
        // SAFETY: live CQ.
        let ret = unsafe { ffi::ibv_req_notify_cq(self.inner.raw(), 0) };
        if ret != 0 {
            return Err(Error::ReqNotifyCq(from_ret(ret)));
        }
        Ok(())
    }

    /// Read (and acknowledge) a pending completion event from the channel, then re-arm.
    /// Returns false when there was none (a spurious wakeup). Call it when the channel fd
    /// is readable, then [`Cq::poll`] until it returns 0.
    ///
    /// # Errors
    /// [`Error::NoCompChannel`], [`Error::CqEvent`], [`Error::ReqNotifyCq`].
    pub fn consume_event(&self) -> Result<bool, Error> {
        if !self.take_event()? {
            return Ok(false);
        }
        self.arm()?;
        Ok(true)
    }

    /// Read (and acknowledge) a pending completion event from the channel without arming
    /// the CQ again: no further event comes until [`Cq::arm`] (for a thread that polls the
    /// CQ itself meanwhile; it must poll once more after arming). Returns false when there
    /// was none.
    ///
    /// # Errors
    /// [`Error::NoCompChannel`], [`Error::CqEvent`].
    pub fn take_event(&self) -> Result<bool, Error> {
        let ch = self.inner.channel.ok_or(Error::NoCompChannel)?;
        let mut ev_cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut ev_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: live channel; valid out-pointers. The fd is non-blocking: EAGAIN when
        // there is no event.
        let ret = unsafe { ffi::ibv_get_cq_event(ch.as_ptr(), &mut ev_cq, &mut ev_ctx) };
        if ret != 0 {
            let e = last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(false);
            }
            return Err(Error::CqEvent(e));
        }
        // SAFETY: one event was read for this CQ (the channel serves only it).
        unsafe { ffi::ibv_ack_cq_events(ev_cq, 1) };
        Ok(true)
    }

    /// Event-driven wait: sleep (no spinning) until a completion is available or `timeout`
    /// passes, then poll. Returns the number of completions appended to `out` (0 on timeout).
    ///
    /// # Errors
    /// As [`Cq::poll`] and [`Cq::consume_event`].
    pub fn wait(
        &self,
        out: &mut Vec<Completion>,
        timeout: Option<Duration>,
    ) -> Result<usize, Error> {
        let fd = self.as_raw_fd_checked()?;
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            // Armed (on creation and after every event): sleep until the next event.
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return Ok(0);
                    }
                    left.as_millis().clamp(1, i32::MAX as u128) as i32
                }
            };
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r < 0 {
                let e = last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::CqEvent(e));
                }
            } else if r > 0 {
                self.consume_event()?;
            }
        }
    }

    fn as_raw_fd_checked(&self) -> Result<RawFd, Error> {
        let ch = self.inner.channel.ok_or(Error::NoCompChannel)?;
        // SAFETY: live channel.
        Ok(unsafe { ch.as_ref().fd })
    }

    /// Poll completions (batches of 64) until the CQ is empty; append them to `out` and
    /// return how many were appended. Completions of unsignaled requests the layer signaled
    /// by itself are consumed silently unless they failed. Every completion releases the
    /// memory-region references of its request (and of the unsignaled ones before it).
    ///
    /// # Errors
    /// [`Error::PollCq`].
    pub fn poll(&self, out: &mut Vec<Completion>) -> Result<usize, Error> {
        let before = out.len();
        // Not zeroed: the provider writes the entries it returns and only those are read (a
        // zeroed 3 KiB array per call was the largest cost of an empty poll in a polling loop).
        let mut wcs = [const { std::mem::MaybeUninit::<ffi::ibv_wc>::uninit() }; POLL_BATCH];
        loop {
            // SAFETY: live CQ; the array holds POLL_BATCH entries, written by the provider.
            let n = unsafe {
                ffi::ibv_poll_cq(self.inner.raw(), POLL_BATCH as i32, wcs.as_mut_ptr().cast())
            };
            if n < 0 {
                return Err(Error::PollCq(n));
            }
            let n = (n as usize).min(POLL_BATCH);
            if n > 0 {
                let qps = self.inner.lock_qps();
                for wc in &wcs[..n] {
                    // SAFETY: ibv_poll_cq wrote the first n entries.
                    let wc = unsafe { wc.assume_init_ref() };
                    if let Some(c) = retire(&qps, wc) {
                        out.push(c);
                    }
                }
            }
            if n < POLL_BATCH {
                return Ok(out.len() - before);
            }
        }
    }
}

/// Match one work completion with its pending request.
fn retire(qps: &IdMap<u32, Arc<QpShared>>, wc: &ffi::ibv_wc) -> Option<Completion> {
    let recv = wc.wr_id & RECV_BIT != 0;
    let seq = wc.wr_id & !RECV_BIT;
    let ok = wc.status == ffi::ibv_wc_status::IBV_WC_SUCCESS;
    let Some(shared) = qps.get(&wc.qp_num) else {
        tracing::warn!(
            qpn = wc.qp_num,
            "completion for an unknown queue pair dropped"
        );
        return None;
    };
    let found = shared.queue(recv).retire(seq);
    let Retired::Found(p) = found else {
        tracing::error!(
            qpn = wc.qp_num,
            seq,
            recv,
            "completion with an unknown wr sequence dropped"
        );
        return None;
    };
    let op = if recv && ok && wc.opcode == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
        OpKind::RecvRdmaWithImm
    } else {
        p.op
    };
    let status = if ok {
        Ok(())
    } else {
        let e = WcError {
            op,
            wr_id: p.wr_id,
            qpn: wc.qp_num,
            status: wc.status,
            status_name: status_name(wc.status),
            text: status_text(wc.status),
            vendor_err: wc.vendor_err,
        };
        shared.record_error(&e);
        Err(e)
    };
    if !p.report && status.is_ok() {
        return None;
    }
    let with_imm = ok && wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
    Some(Completion {
        wr_id: p.wr_id,
        qpn: wc.qp_num,
        op,
        byte_len: if recv && ok { wc.byte_len } else { 0 },
        // SAFETY: imm_data is the active union member when IBV_WC_WITH_IMM is set.
        imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
        status,
    })
}

impl AsRawFd for Cq {
    /// The completion channel's fd (-1 for a CQ created without one). Register it with mio
    /// as `SourceFd` for `Interest::READABLE`; on readiness call [`Cq::consume_event`], then
    /// [`Cq::poll`].
    fn as_raw_fd(&self) -> RawFd {
        self.as_raw_fd_checked().unwrap_or(-1)
    }
}

fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a valid fd owned by the channel.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
