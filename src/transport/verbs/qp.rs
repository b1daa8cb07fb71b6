//! RC queue pairs: creation, INIT → RTR → RTS, error-state detection and posting.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_mummy_sys as ffi;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::cq::{Cq, CqInner, WcError};
use super::device::{Mtu, PortState};
use super::error::{from_ret, last_os_error, Error};
use super::mr::{Access, MrRef};
use super::pd::{Pd, PdInner};
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

/// State shared between a QP and the CQs its completions land on.
pub(crate) struct QpShared {
    send: Mutex<WorkQueue>,
    recv: Mutex<WorkQueue>,
    error: Mutex<Option<String>>,
    /// `error` holds a cause: every post looks at this first, without the lock and the copy
    /// of the cause (a lock and an `Option<String>` clone per post before).
    failed: AtomicBool,
}

impl QpShared {
    pub(crate) fn queue(&self, recv: bool) -> MutexGuard<'_, WorkQueue> {
        let m = if recv { &self.recv } else { &self.send };
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn record_error(&self, e: &WcError) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        // Keep the first real cause; flushes only follow it.
        if g.is_none()
            || (!e.is_flush()
                && g.as_deref()
                    .is_some_and(|c| c.contains("IBV_WC_WR_FLUSH_ERR")))
        {
            *g = Some(e.to_string());
            self.failed.store(true, Ordering::Release);
        }
    }

    fn error(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
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
    /// Create an RC queue pair and move it to INIT on `opts.port`.
    ///
    /// # Errors
    /// [`Error::QueryPort`], [`Error::QueryGid`], [`Error::CreateQp`], [`Error::ModifyQp`].
    pub fn new(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, opts: &QpOptions) -> Result<Self, Error> {
        let ctx = super::device::Context {
            inner: pd.inner.ctx.clone(),
        };
        let port = ctx.query_port(opts.port)?;
        let dev = ctx.query_device()?;
        let gid = ctx
            .gid_table(opts.port)?
            .into_iter()
            .find(|e| e.index == opts.gid_index)
            .map(|e| e.gid)
            .ok_or_else(|| Error::NoUsableGid {
                device: ctx.name().to_owned(),
                port: opts.port,
                reason: format!("GID index {} is empty", opts.gid_index),
            })?;
        // SAFETY: plain old data; zeroed is valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.inner.raw();
        init.recv_cq = recv_cq.inner.raw();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = opts.max_send_wr;
        init.cap.max_recv_wr = opts.max_recv_wr;
        init.cap.max_send_sge = opts.max_send_sge;
        init.cap.max_recv_sge = opts.max_recv_sge;
        init.cap.max_inline_data = opts.max_inline_data;
        // SAFETY: live PD and CQs of the same context; `init` is fully initialized.
        let qp = unsafe { ffi::ibv_create_qp(pd.raw(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| Error::CreateQp {
            send_wr: opts.max_send_wr,
            recv_wr: opts.max_recv_wr,
            source: last_os_error(),
        })?;
        // SAFETY: just created.
        let qpn = unsafe { qp.as_ref().qp_num };
        // what the provider granted (it writes the capabilities back)
        let max_inline = init.cap.max_inline_data;
        let shared = Arc::new(QpShared {
            send: Mutex::new(WorkQueue::new(opts.max_send_wr as usize)),
            recv: Mutex::new(WorkQueue::new(opts.max_recv_wr as usize)),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
        });
        send_cq.inner.attach(qpn, shared.clone());
        recv_cq.inner.attach(qpn, shared.clone());
        // As many outstanding READs as the device takes (perftest's default too): on rxe
        // (128) a cap of 16 left 64 KiB READs at 32 in flight waiting on READ credits.
        let max_dest_rd_atomic = dev.max_qp_rd_atom.clamp(1, 255) as u8;
        let this = Self {
            inner: Arc::new(QpInner {
                qp,
                qpn,
                opts: opts.clone(),
                local: Endpoint {
                    qpn,
                    psn: random_psn(),
                    gid,
                    lid: port.lid,
                    mtu: {
                        let active = port.active_mtu.unwrap_or(Mtu::Mtu1024);
                        opts.max_mtu.map_or(active, |m| m.min(active))
                    },
                    rd_atomic: max_dest_rd_atomic,
                },
                link_layer: port.link_layer,
                max_rd_atomic: dev.max_qp_init_rd_atom.clamp(1, 255) as u8,
                max_dest_rd_atomic,
                max_inline,
                state: AtomicU8::new(QpState::Reset as u8),
                posting: Mutex::new(()),
                shared,
                send_cq: send_cq.inner.clone(),
                recv_cq: recv_cq.inner.clone(),
                pd: pd.inner.clone(),
            }),
        };
        if port.state != PortState::Active {
            tracing::warn!(
                device = ctx.name(),
                port = opts.port,
                "creating a QP on a port that is {}",
                port.state
            );
        }
        // SAFETY: zeroed is valid; only the masked fields are read.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = opts.port;
        a.qp_access_flags = opts.remote_access.bits();
        use ffi::ibv_qp_attr_mask as M;
        this.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            QpState::Init,
        )?;
        Ok(this)
    }

    fn modify(
        &self,
        a: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        to: QpState,
    ) -> Result<(), Error> {
        // SAFETY: live QP; `a` holds every attribute the mask names.
        let ret = unsafe { ffi::ibv_modify_qp(self.inner.qp.as_ptr(), a, mask.0 as i32) };
        if ret != 0 {
            return Err(Error::ModifyQp {
                qpn: self.inner.qpn,
                to: to.name(),
                source: from_ret(ret),
            });
        }
        self.set_state(to);
        Ok(())
    }

    fn set_state(&self, s: QpState) {
        self.inner.state.store(s as u8, Ordering::Release);
    }

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

    /// Connect to the peer's endpoint: INIT → RTR (path MTU = the smaller of both ports'
    /// active MTUs) → RTS.
    ///
    /// # Errors
    /// [`Error::BadEndpoint`] for an endpoint that cannot be valid; [`Error::QpState`] when
    /// the QP is not in INIT; [`Error::ModifyQp`] naming the state that failed.
    pub fn connect(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<(), Error> {
        let qpn = self.inner.qpn;
        let bad = |reason: String| Err(Error::BadEndpoint { qpn, reason });
        if remote.qpn == 0 || remote.qpn > 0x00ff_ffff {
            return bad(format!(
                "peer qpn {} is not a 24-bit non-zero QP number",
                remote.qpn
            ));
        }
        if remote.psn > 0x00ff_ffff {
            return bad(format!("peer psn {} exceeds 24 bits", remote.psn));
        }
        let roce = self.inner.link_layer == LinkLayer::Ethernet;
        if roce && remote.gid.is_zero() {
            return bad("peer GID is zero on a RoCE port".into());
        }
        let state = self.cached_state();
        if state != QpState::Init {
            return Err(Error::QpState {
                qpn,
                state: state.name(),
                expected: "INIT",
            });
        }
        let path_mtu = remote.mtu.min(self.inner.local.mtu);
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: zeroed is valid; only the masked fields are read.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = path_mtu as u32;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = self.inner.max_dest_rd_atomic;
        a.min_rnr_timer = opts.min_rnr_timer;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.inner.opts.port;
        a.ah_attr.is_global = u8::from(roce || !remote.gid.is_zero());
        a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid.0 };
        a.ah_attr.grh.sgid_index = self.inner.opts.gid_index as u8;
        a.ah_attr.grh.hop_limit = opts.hop_limit;
        a.ah_attr.grh.traffic_class = opts.traffic_class;
        a.ah_attr.grh.flow_label = 0;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            QpState::Rtr,
        )?;
        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = opts.timeout;
        a.retry_cnt = opts.retry_cnt;
        a.rnr_retry = opts.rnr_retry;
        a.sq_psn = self.inner.local.psn;
        // never more outstanding than the peer's responder serves
        let theirs = match remote.rd_atomic {
            0 => UNSAID_RD_ATOMIC,
            n => n,
        };
        a.max_rd_atomic = self.inner.max_rd_atomic.min(theirs);
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            QpState::Rts,
        )?;
        tracing::debug!(
            qpn,
            peer_qpn = remote.qpn,
            mtu = path_mtu.bytes(),
            "queue pair connected"
        );
        Ok(())
    }

    fn query(&self, mask: ffi::ibv_qp_attr_mask) -> Result<ffi::ibv_qp_attr, Error> {
        // SAFETY: zeroed PODs are valid out-parameters.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, valid out-pointers.
        let ret =
            unsafe { ffi::ibv_query_qp(self.inner.qp.as_ptr(), &mut a, mask.0 as i32, &mut init) };
        if ret != 0 {
            return Err(Error::QueryQp {
                qpn: self.inner.qpn,
                source: from_ret(ret),
            });
        }
        Ok(a)
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

    /// Post a list of send-queue requests with one `ibv_post_send`. Every request is
    /// validated first (local ranges inside their regions, regions of this QP's PD, READ
    /// destinations locally writable, remote ranges inside the peer's region, SGE count,
    /// queue depth); on any error nothing is posted. Each posted request keeps its regions
    /// busy until its completion (or a later one) is polled.
    ///
    /// # Errors
    /// [`Error::InvalidWr`] naming the request; [`Error::QueueFull`]; [`Error::QpInError`];
    /// [`Error::QpState`]; [`Error::Post`] (requests from its index on were not posted).
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), Error> {
        self.check_posting(QpState::Rts)?;
        for (i, wr) in wrs.iter().enumerate() {
            self.validate_send(i, wr)?;
        }
        let _posting = self.inner.posting.lock().unwrap_or_else(|p| p.into_inner());
        let mut q = self.inner.shared.queue(false);
        if q.outstanding() + wrs.len() > q.depth {
            return Err(Error::QueueFull {
                queue: "send",
                qpn: self.inner.qpn,
                outstanding: q.outstanding(),
                posting: wrs.len(),
                depth: q.depth,
            });
        }
        if let [wr] = wrs {
            if wr.local.len() <= INLINE_SGES {
                return self.post_one_send(wr, q);
            }
        }
        // On the stack for the usual list (a request or two of a few SGEs each: a
        // notification frame, a transfer's slice); the heap only for longer lists.
        let nsge: usize = wrs.iter().map(|w| w.local.len()).sum();
        let mut sges: SmallVec<[ffi::ibv_sge; INLINE_SGES]> = SmallVec::with_capacity(nsge);
        // where the queue stood before each request, to give back what a failed post left
        let mut marks: SmallVec<[Mark; INLINE_WRS]> = SmallVec::with_capacity(wrs.len());
        let mut raw: SmallVec<[ffi::ibv_send_wr; INLINE_WRS]> = SmallVec::with_capacity(wrs.len());
        for wr in wrs {
            marks.push(q.mark());
            raw.push(self.reserve_send(&mut q, wr, |s| sges.push(s)));
        }
        drop(q);
        link(&mut raw, &mut sges);
        if raw.is_empty() {
            return Ok(());
        }
        self.ring_send(&mut raw, |posted| marks.get(posted).copied())
    }

    /// [`Qp::post_send`] of one request of at most [`INLINE_SGES`] SGEs (a notification
    /// frame, a transfer's slice: most posts), without the list's bookkeeping.
    fn post_one_send(
        &self,
        wr: &SendWr<'_>,
        mut q: MutexGuard<'_, WorkQueue>,
    ) -> Result<(), Error> {
        let mark = q.mark();
        let mut sges = [ffi::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        }; INLINE_SGES];
        let mut n = 0;
        let mut r = self.reserve_send(&mut q, wr, |s| {
            sges[n] = s;
            n += 1;
        });
        drop(q);
        if n > 0 {
            r.sg_list = sges.as_mut_ptr();
        }
        self.ring_send(std::slice::from_mut(&mut r), |posted| {
            (posted == 0).then_some(mark)
        })
    }

    /// Reserve `wr`'s place in the send queue `q` (its pending entry, pushed before it is
    /// posted: its completion may come before the post returns) and make its raw request;
    /// its SGEs go to `sge`, in order (the caller points the request at them).
    fn reserve_send(
        &self,
        q: &mut WorkQueue,
        wr: &SendWr<'_>,
        mut sge: impl FnMut(ffi::ibv_sge),
    ) -> ffi::ibv_send_wr {
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of those).
        let mut r: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        let (seq, signaled) = q.next(wr.signaled);
        r.wr_id = seq;
        r.num_sge = wr.local.len() as i32;
        r.send_flags = if signaled {
            ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        if wr.inline {
            r.send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        let (opcode, imm) = match wr.op {
            SendOp::Write { .. } => (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, None),
            SendOp::WriteWithImm { imm, .. } => {
                (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, Some(imm))
            }
            SendOp::Read { .. } => (ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, None),
            SendOp::Send => (ffi::ibv_wr_opcode::IBV_WR_SEND, None),
            SendOp::SendWithImm { imm } => (ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, Some(imm)),
        };
        r.opcode = opcode;
        if let Some(imm) = imm {
            r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        if let Some((remote, off)) = wr.op.remote() {
            r.wr.rdma = ffi::rdma_t {
                remote_addr: remote.addr + off,
                rkey: remote.rkey,
            };
        }
        let mut refs = SmallVec::with_capacity(wr.local.len());
        for s in &wr.local {
            sge(ffi::ibv_sge {
                addr: s.mr.addr() + s.offset as u64,
                length: s.len as u32,
                lkey: s.mr.lkey(),
            });
            refs.push(MrRef::new(s.mr.inner()));
        }
        q.push(Pending {
            seq,
            wr_id: wr.wr_id,
            op: wr.op.kind(),
            report: wr.signaled,
            _refs: refs,
        });
        r
    }

    /// Hand a linked, reserved list to the device; when it takes only part of it, give
    /// back what it did not take (`mark_of(i)`: where the queue stood before request `i`).
    /// The caller holds `posting`.
    fn ring_send(
        &self,
        raw: &mut [ffi::ibv_send_wr],
        mark_of: impl FnOnce(usize) -> Option<Mark>,
    ) -> Result<(), Error> {
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP in RTS; the list and SGE arrays are valid for the call (the
        // device copies them); every SGE lies inside a registered region of this PD that
        // stays alive until its completion is polled (the MrRefs of the pending entries
        // pushed by `reserve_send`).
        let ret = unsafe { ffi::ibv_post_send(self.inner.qp.as_ptr(), raw.as_mut_ptr(), &mut bad) };
        if ret != 0 {
            let posted = bad_index(raw.as_ptr(), bad, raw.len());
            // Give back what was not posted: the newest entries (no other poster ran:
            // `posting` is held), which no completion can name.
            // (a failure that names no request leaves them all counted, as posted)
            if let Some(m) = mark_of(posted) {
                self.inner.shared.queue(false).unwind(m);
            }
            return Err(Error::Post {
                verb: "ibv_post_send",
                qpn: self.inner.qpn,
                index: posted,
                source: from_ret(ret),
            });
        }
        Ok(())
    }

    fn validate_send(&self, i: usize, wr: &SendWr<'_>) -> Result<(), Error> {
        let op = wr.op.kind();
        let fail = |reason: String| {
            Err(Error::InvalidWr {
                op,
                index: i,
                wr_id: wr.wr_id,
                reason,
            })
        };
        if wr.local.len() > self.inner.opts.max_send_sge as usize {
            return fail(format!(
                "{} SGEs > max_send_sge {}",
                wr.local.len(),
                self.inner.opts.max_send_sge
            ));
        }
        for (k, s) in wr.local.iter().enumerate() {
            if let Some(r) = self.check_sge(s, op == OpKind::Read) {
                return fail(format!("local element {k}: {r}"));
            }
        }
        if wr.inline {
            if !matches!(op, OpKind::Send | OpKind::Write) {
                return fail(format!("{op} cannot be posted inline (SEND and WRITE can)"));
            }
            if wr.len() > u64::from(self.inner.max_inline) {
                return fail(format!(
                    "{} bytes inline > the queue pair's max_inline {}",
                    wr.len(),
                    self.inner.max_inline
                ));
            }
        }
        if let Some((remote, off)) = wr.op.remote() {
            let len = wr.len();
            if !remote.contains(off, len) {
                return fail(format!(
                    "remote range [{off}, {off}+{len}) is outside the peer's {}-byte region (rkey {:#x})",
                    remote.len, remote.rkey
                ));
            }
            if len > u64::from(u32::MAX) {
                return fail(format!("{len} bytes exceed one message (2^32 - 1)"));
            }
        }
        Ok(())
    }

    /// Why a local element is unusable, or None.
    fn check_sge(&self, s: &super::wr::Sge<'_>, needs_write: bool) -> Option<String> {
        if !Arc::ptr_eq(s.mr.inner().pd(), &self.inner.pd) {
            return Some("memory region belongs to another protection domain".into());
        }
        if s.offset
            .checked_add(s.len)
            .is_none_or(|end| end > s.mr.len())
        {
            return Some(format!(
                "[{}, {}+{}) is outside the {}-byte region",
                s.offset,
                s.offset,
                s.len,
                s.mr.len()
            ));
        }
        if s.len > u32::MAX as usize {
            return Some(format!("{} bytes exceed an SGE (2^32 - 1)", s.len));
        }
        if needs_write && !s.mr.access().contains(Access::LOCAL_WRITE) {
            return Some(format!(
                "region registered {} lacks LOCAL_WRITE",
                s.mr.access()
            ));
        }
        None
    }

    /// Post a list of receive requests with one `ibv_post_recv`; validated like
    /// [`Qp::post_send`] (every buffer must be locally writable).
    ///
    /// # Errors
    /// [`Error::InvalidWr`], [`Error::QueueFull`], [`Error::QpInError`], [`Error::QpState`],
    /// [`Error::Post`].
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), Error> {
        self.check_posting(QpState::Init)?;
        for (i, wr) in wrs.iter().enumerate() {
            let fail = |reason: String| {
                Err(Error::InvalidWr {
                    op: OpKind::Recv,
                    index: i,
                    wr_id: wr.wr_id,
                    reason,
                })
            };
            if wr.local.len() > self.inner.opts.max_recv_sge as usize {
                return fail(format!(
                    "{} SGEs > max_recv_sge {}",
                    wr.local.len(),
                    self.inner.opts.max_recv_sge
                ));
            }
            for (k, s) in wr.local.iter().enumerate() {
                if let Some(r) = self.check_sge(s, true) {
                    return fail(format!("local element {k}: {r}"));
                }
            }
        }
        let mut q = self.inner.shared.queue(true);
        if q.outstanding() + wrs.len() > q.depth {
            return Err(Error::QueueFull {
                queue: "receive",
                qpn: self.inner.qpn,
                outstanding: q.outstanding(),
                posting: wrs.len(),
                depth: q.depth,
            });
        }
        let nsge: usize = wrs.iter().map(|w| w.local.len()).sum();
        let mut sges: SmallVec<[ffi::ibv_sge; INLINE_RECVS]> = SmallVec::with_capacity(nsge);
        let mut raw: SmallVec<[ffi::ibv_recv_wr; INLINE_RECVS]> =
            SmallVec::with_capacity(wrs.len());
        // Pending before it is posted (the queue stays locked until the post returns, so no
        // completion can look for it earlier); what the device did not take is given back.
        let mark = q.mark();
        for wr in wrs {
            let (seq, _) = q.next(true);
            let mut refs = SmallVec::with_capacity(wr.local.len());
            for s in &wr.local {
                sges.push(ffi::ibv_sge {
                    addr: s.mr.addr() + s.offset as u64,
                    length: s.len as u32,
                    lkey: s.mr.lkey(),
                });
                refs.push(MrRef::new(s.mr.inner()));
            }
            raw.push(ffi::ibv_recv_wr {
                wr_id: seq | RECV_BIT,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: wr.local.len() as i32,
            });
            q.push(Pending {
                seq,
                wr_id: wr.wr_id,
                op: OpKind::Recv,
                report: true,
                _refs: refs,
            });
        }
        link(&mut raw, &mut sges);
        if raw.is_empty() {
            return Ok(());
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; the list and SGEs are valid for the call; every buffer lies in a
        // locally writable region kept alive by its pending entry until its completion is
        // polled (or the entry is given back below, when the device did not take it).
        let ret = unsafe { ffi::ibv_post_recv(self.inner.qp.as_ptr(), raw.as_mut_ptr(), &mut bad) };
        if ret != 0 {
            // (a failure that names no request leaves them all counted, as posted)
            let posted = bad_index(raw.as_ptr(), bad, raw.len());
            q.unwind(mark.after_receives(posted));
            return Err(Error::Post {
                verb: "ibv_post_recv",
                qpn: self.inner.qpn,
                index: posted,
                source: from_ret(ret),
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
