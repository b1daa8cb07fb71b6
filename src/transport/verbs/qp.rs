//! RC queue pairs: creation, INIT → RTR → RTS, error-state detection and posting.

mod recv;
mod send;
mod setup;

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_mummy_sys as ffi;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::cq::{Cq, CqInner};
use super::device::{Mtu, PortState};
use super::error::{from_ret, last_os_error, Error};
use super::mr::{Access, MrRef};
use super::pd::{Pd, PdInner};
use super::wc::QpShared;
use super::wr::{Mark, OpKind, Pending, RecvWr, SendOp, SendWr, WorkQueue, RECV_BIT};
use crate::rails::gid::{Gid, LinkLayer};

/// How to create a queue pair. Every port and GID index is explicit: there is no default
/// port (multi-rail code must always say which one).
#[derive(Debug, Clone)]
pub struct QpOptions {
    /// Port number (1-based).
    pub port: u8,
    /// Local GID index (see [`crate::rails::gid::select_gid`]).
    pub gid_index: u32,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather elements per send request.
    pub max_send_sge: u32,
    /// Scatter/gather elements per receive request.
    pub max_recv_sge: u32,
    /// What peers may do to this side's memory through this QP (least access: a pull
    /// producer needs REMOTE_READ only, a push consumer REMOTE_WRITE only).
    pub remote_access: Access,
    /// At most this path MTU (None: the port's active MTU). The path MTU is the smaller of
    /// both ends' values.
    pub max_mtu: Option<Mtu>,
    /// Bytes a send request may carry inline (0: none). The device may grant more
    /// ([`Qp::max_inline`]); creating the queue pair fails when it cannot grant this much.
    pub max_inline_data: u32,
}

impl QpOptions {
    /// A QP on `port` using `gid_index`, with depth 256 each way, 4 SGEs, and both remote
    /// READ and WRITE allowed.
    pub fn new(port: u8, gid_index: u32) -> Self {
        Self {
            port,
            gid_index,
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            remote_access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            max_mtu: None,
            max_inline_data: 0,
        }
    }
}

/// What the peer needs to connect to a queue pair (exchanged out of band).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// GID the QP sends from.
    pub gid: Gid,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's active MTU.
    pub mtu: Mtu,
    /// RDMA READs (and atomics) this queue pair serves at once as a responder
    /// (`max_dest_rd_atomic`); the peer keeps at most this many outstanding toward it. 0 from
    /// a peer that does not say (an older kvrail): taken as 16, the value it used.
    #[serde(default)]
    pub rd_atomic: u8,
}

/// Outstanding READs assumed of a peer whose endpoint does not say (see [`Endpoint::rd_atomic`]).
const UNSAID_RD_ATOMIC: u8 = 16;

/// Work requests of one post kept on the stack (more go to the heap).
const INLINE_WRS: usize = 2;
/// SGEs of one post kept on the stack.
const INLINE_SGES: usize = 4;
/// Receive requests (and their SGEs) of one post kept on the stack: a message channel posts
/// its receives again eight at a time (larger inline lists made every send post slower).
const INLINE_RECVS: usize = 8;

/// Connection parameters (RTR / RTS attributes).
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout. 18 (≈1 s) and up; lower values gave
    /// spurious retry-exceeded errors on Soft-RoCE under load.
    pub timeout: u8,
    /// Transport retries (0–7; default 6). At 7 Soft-RoCE retried a peer that had closed its
    /// queue pair for as long as the lab test waited (a minute), and a READ whose region the
    /// peer deregistered in the middle of its response for as long (120 s, issue 46); at 6
    /// it gives up after ~7 s (`IBV_WC_RETRY_EXC_ERR`), the agent moves the work to another
    /// rail, and there a fresh request meets the peer's refusal of the key at once.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer code (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Hop limit of the GRH.
    pub hop_limit: u8,
    /// Traffic class of the GRH.
    pub traffic_class: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            timeout: 18,
            retry_cnt: 6,
            rnr_retry: 7,
            min_rnr_timer: 12,
            hop_limit: 64,
            traffic_class: 0,
        }
    }
}

/// Queue pair state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// RESET.
    Reset,
    /// INIT.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every outstanding request is flushed; nothing more can be posted.
    Error,
    /// Unknown.
    Unknown,
}

// A variant added without its place in `QpState::ALL` fails the build here (Unknown stays
// the last).
const _: () = assert!(QpState::Unknown as usize + 1 == QpState::ALL.len());

impl QpState {
    /// Every state, in declaration order (the index is what [`QpInner::state`] stores).
    const ALL: [Self; 8] = [
        Self::Reset,
        Self::Init,
        Self::Rtr,
        Self::Rts,
        Self::Sqd,
        Self::Sqe,
        Self::Error,
        Self::Unknown,
    ];

    fn from_index(i: u8) -> Self {
        Self::ALL
            .get(usize::from(i))
            .copied()
            .unwrap_or(Self::Unknown)
    }

    fn from_raw(v: u32) -> Self {
        use ffi::ibv_qp_state::*;
        match v {
            IBV_QPS_RESET => Self::Reset,
            IBV_QPS_INIT => Self::Init,
            IBV_QPS_RTR => Self::Rtr,
            IBV_QPS_RTS => Self::Rts,
            IBV_QPS_SQD => Self::Sqd,
            IBV_QPS_SQE => Self::Sqe,
            IBV_QPS_ERR => Self::Error,
            _ => Self::Unknown,
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reset => "RESET",
            Self::Init => "INIT",
            Self::Rtr => "RTR",
            Self::Rts => "RTS",
            Self::Sqd => "SQD",
            Self::Sqe => "SQE",
            Self::Error => "ERR",
            Self::Unknown => "UNKNOWN",
        }
    }
}

struct QpInner {
    qp: NonNull<ffi::ibv_qp>,
    qpn: u32,
    opts: QpOptions,
    local: Endpoint,
    link_layer: LinkLayer,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    max_inline: u32,
    /// The last state a transition or query saw ([`QpState::ALL`]'s index). An atomic, not a
    /// lock: every post reads it, and it is only ever read or replaced whole.
    state: AtomicU8,
    /// Serializes posters of the send queue through `ibv_post_send`, so that sequence
    /// numbers follow the order the device sees. The queue's own lock (in `shared`) is held
    /// only to reserve and, after a failed post, to give back: the completion side retires
    /// while a post is in the device's hands — rxe (Soft-RoCE) does a user queue pair's
    /// packet work inside `ibv_post_send`, and with the queue's lock held through it the
    /// progress thread slept on that lock for the whole post.
    posting: Mutex<()>,
    shared: Arc<QpShared>,
    // Released after the QP is destroyed: CQs (ibv_destroy_cq fails with EBUSY while a QP
    // is attached), then the PD.
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Arc<PdInner>,
}

// SAFETY: posting and modify verbs are thread-safe in libibverbs; our own state is behind
// mutexes.
unsafe impl Send for QpInner {}
// SAFETY: see Send.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: the QP is valid and destroyed once; after this the device no longer
        // touches the memory of pending requests, so their region references can go.
        let ret = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            tracing::error!(
                qpn = self.qpn,
                "ibv_destroy_qp failed: {} (pending regions leaked)",
                from_ret(ret)
            );
            // Keep the memory of pending requests alive forever rather than free it under
            // a QP that may still use it.
            std::mem::forget(std::mem::replace(
                &mut *self.shared.queue(false),
                WorkQueue::new(0),
            ));
            std::mem::forget(std::mem::replace(
                &mut *self.shared.queue(true),
                WorkQueue::new(0),
            ));
        } else {
            self.shared.queue(false).clear();
            self.shared.queue(true).clear();
        }
        self.send_cq.detach(self.qpn);
        self.recv_cq.detach(self.qpn);
    }
}

/// A reliable-connected queue pair.
#[derive(Clone)]
pub struct Qp {
    inner: Arc<QpInner>,
}

impl fmt::Debug for Qp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.inner.qpn)
            .field("port", &self.inner.opts.port)
            .field("state", &self.cached_state())
            .finish()
    }
}

fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b76_7261_696c);
    (h.finish() & 0x00ff_ffff) as u32
}

impl Qp {
    fn cached_state(&self) -> QpState {
        QpState::from_index(self.inner.state.load(Ordering::Acquire))
    }

    /// Queue pair number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// The port it lives on.
    pub fn port(&self) -> u8 {
        self.inner.opts.port
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        self.inner.local
    }

    /// Move the QP to the error state: the device stops working on it and flushes every
    /// outstanding request (their completions come back with `IBV_WC_WR_FLUSH_ERR`). Used
    /// to retire a rail for good before its work is moved elsewhere, so a stalled request
    /// cannot resume later and touch memory that was reused since.
    ///
    /// # Errors
    /// [`Error::ModifyQp`].
    pub fn set_error(&self) -> Result<(), Error> {
        // SAFETY: zeroed is valid; only the state is read.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE, QpState::Error)
    }

    /// The QP's state as the device reports it (`ibv_query_qp`).
    ///
    /// # Errors
    /// [`Error::QueryQp`].
    pub fn state(&self) -> Result<QpState, Error> {
        let s = QpState::from_raw(self.query(ffi::ibv_qp_attr_mask::IBV_QP_STATE)?.qp_state);
        self.set_state(s);
        Ok(s)
    }

    /// The path MTU the QP was connected with (`ibv_query_qp`).
    ///
    /// # Errors
    /// [`Error::QueryQp`]; [`Error::QpState`] before [`Qp::connect`].
    pub fn path_mtu(&self) -> Result<Mtu, Error> {
        let a = self.query(ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU)?;
        Mtu::from_raw(a.path_mtu).ok_or(Error::QpState {
            qpn: self.inner.qpn,
            state: self.cached_state().name(),
            expected: "RTR or RTS",
        })
    }

    /// RDMA READs this queue pair keeps outstanding as a requester (`max_rd_atomic`, as the
    /// device reports it): the smaller of what the device takes and what the peer's endpoint
    /// serves ([`Endpoint::rd_atomic`]).
    ///
    /// # Errors
    /// [`Error::QueryQp`].
    pub fn outstanding_reads(&self) -> Result<u8, Error> {
        Ok(self
            .query(ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC)?
            .max_rd_atomic)
    }

    /// Bytes a send request may carry inline ([`SendWr::inline`]): what the device granted
    /// for [`QpOptions::max_inline_data`].
    pub fn max_inline(&self) -> u32 {
        self.inner.max_inline
    }

    /// `Ok` while the QP can carry traffic; otherwise [`Error::QpInError`] with the first
    /// failed completion seen on it (or the state the device reports).
    ///
    /// # Errors
    /// [`Error::QpInError`], [`Error::QueryQp`].
    pub fn check(&self) -> Result<(), Error> {
        if let Some(cause) = self.inner.shared.error() {
            return Err(Error::QpInError {
                qpn: self.inner.qpn,
                cause,
            });
        }
        match self.state()? {
            QpState::Error | QpState::Sqe => Err(Error::QpInError {
                qpn: self.inner.qpn,
                cause: "the device reports the queue pair in the error state".into(),
            }),
            _ => Ok(()),
        }
    }

    fn check_posting(&self, need: QpState) -> Result<(), Error> {
        if let Some(cause) = self.inner.shared.error() {
            return Err(Error::QpInError {
                qpn: self.inner.qpn,
                cause,
            });
        }
        let s = self.cached_state();
        let ok = match need {
            QpState::Rts => s == QpState::Rts,
            _ => matches!(s, QpState::Init | QpState::Rtr | QpState::Rts),
        };
        if !ok {
            return Err(Error::QpState {
                qpn: self.inner.qpn,
                state: s.name(),
                expected: need.name(),
            });
        }
        Ok(())
    }

    /// Send-queue requests posted and not yet retired by a polled completion.
    pub fn outstanding_sends(&self) -> usize {
        self.inner.shared.queue(false).outstanding()
    }

    /// Receive requests posted and not yet completed.
    pub fn outstanding_recvs(&self) -> usize {
        self.inner.shared.queue(true).outstanding()
    }
}

/// A raw work request of a list (send or receive): its SGE count, its list pointers.
trait RawWr: Sized {
    fn num_sge(&self) -> usize;
    fn point(&mut self, sg_list: *mut ffi::ibv_sge, next: *mut Self);
}

impl RawWr for ffi::ibv_send_wr {
    fn num_sge(&self) -> usize {
        self.num_sge as usize
    }
    fn point(&mut self, sg_list: *mut ffi::ibv_sge, next: *mut Self) {
        self.sg_list = sg_list;
        self.next = next;
    }
}

impl RawWr for ffi::ibv_recv_wr {
    fn num_sge(&self) -> usize {
        self.num_sge as usize
    }
    fn point(&mut self, sg_list: *mut ffi::ibv_sge, next: *mut Self) {
        self.sg_list = sg_list;
        self.next = next;
    }
}

/// Link a list of work requests and point each at its SGEs, in order (`raw` and `sges` stay
/// where they are, on the stack or in their heap buffers, until the post returns).
fn link<W: RawWr>(raw: &mut [W], sges: &mut [ffi::ibv_sge]) {
    let mut at = 0;
    let n = raw.len();
    for i in 0..n {
        let k = raw[i].num_sge();
        let sg = if k == 0 {
            std::ptr::null_mut()
        } else {
            sges[at..].as_mut_ptr()
        };
        at += k;
        let next = if i + 1 < n {
            &mut raw[i + 1] as *mut W
        } else {
            std::ptr::null_mut()
        };
        raw[i].point(sg, next);
    }
}

/// Index of `bad` in the array starting at `base`. When the provider did not say which
/// request failed, all of them are taken as posted: their regions then stay busy until a
/// later completion (or the QP's destruction) retires them, which is safe, while releasing
/// a request the device may still execute would not be.
fn bad_index<T>(base: *const T, bad: *const T, len: usize) -> usize {
    let off = (bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<T>().max(1);
    if bad.is_null() || off >= len {
        len
    } else {
        off
    }
}

#[cfg(test)]
mod tests {
    use super::{Endpoint, Gid, Mtu};

    /// An endpoint as an older kvrail sends it (no `rd_atomic`).
    #[derive(serde::Serialize)]
    struct Older {
        qpn: u32,
        psn: u32,
        gid: Gid,
        lid: u16,
        mtu: Mtu,
    }

    #[test]
    fn an_endpoint_without_outstanding_reads_decodes_as_unsaid() {
        let old = Older {
            qpn: 7,
            psn: 9,
            gid: Gid::default(),
            lid: 0,
            mtu: Mtu::Mtu4096,
        };
        let ep: Endpoint = rmp_serde::from_slice(&rmp_serde::to_vec(&old).unwrap()).unwrap();
        assert_eq!(
            (ep.qpn, ep.psn, ep.mtu, ep.rd_atomic),
            (7, 9, Mtu::Mtu4096, 0)
        );
        let new = Endpoint {
            rd_atomic: 128,
            ..ep
        };
        let back: Endpoint = rmp_serde::from_slice(&rmp_serde::to_vec(&new).unwrap()).unwrap();
        assert_eq!(back, new);
    }

    /// The state a QP keeps as a byte comes back as the same state, for every state (the
    /// table and the declaration order agree).
    #[test]
    fn a_state_stored_as_its_index_reads_back() {
        use super::QpState;
        for s in QpState::ALL {
            assert_eq!(QpState::from_index(s as u8), s, "{}", s.name());
        }
        assert_eq!(QpState::from_index(200), QpState::Unknown);
    }
}
