//! Errors of the verbs layer: one variant per failed verb (with the OS error), plus the
//! semantic failures the safe layer detects itself before anything reaches the device.

use std::io;

use super::op::OpKind;

/// Why RDMA cannot be used on this host at all. The agent falls back to TCP on these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unavailable {
    /// `libibverbs.so.1` could not be loaded (errno 95, `EOPNOTSUPP`, from the dlopen shim):
    /// install rdma-core (`apt-get install libibverbs1 ibverbs-providers`).
    NoLibrary,
    /// libibverbs is there but the kernel has no RDMA support (errno 38, `ENOSYS`).
    NoKernelSupport,
    /// RDMA works but the host has no RDMA device.
    NoDevice,
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NoLibrary => {
                "libibverbs.so.1 could not be loaded (install rdma-core / libibverbs1)"
            }
            Self::NoKernelSupport => {
                "the kernel has no RDMA support (ENOSYS from ibv_get_device_list)"
            }
            Self::NoDevice => "no RDMA device found",
        })
    }
}

/// An error of the verbs layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// RDMA cannot be used on this host; the caller should use another transport.
    #[error("RDMA unavailable: {0}")]
    Unavailable(Unavailable),
    /// `ibv_get_device_list` failed for another reason.
    #[error("ibv_get_device_list failed: {0}")]
    GetDeviceList(#[source] io::Error),
    /// No device of that name exists.
    #[error("RDMA device {name:?} not found (devices: {available})")]
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The names that exist, comma separated.
        available: String,
    },
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({device}) failed: {source}")]
    OpenDevice {
        /// Device name.
        device: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device({device}) failed: {source}")]
    QueryDevice {
        /// Device name.
        device: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_port` failed.
    #[error("ibv_query_port({device}, port {port}) failed: {source}")]
    QueryPort {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// Reading the GID table failed.
    #[error("GID table query of {device} port {port} failed: {source}")]
    QueryGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// No usable GID on the port (see [`crate::rails::gid::select_gid`]).
    #[error("{device} port {port}: {reason}")]
    NoUsableGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// What was found instead.
        reason: String,
    },
    /// The port is not ACTIVE, so no queue pair on it can reach a peer.
    #[error("{device} port {port} is not ACTIVE (state {state})")]
    PortNotActive {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// The state the port is in.
        state: String,
    },
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd({device}) failed: {source}")]
    AllocPd {
        /// Device name.
        device: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// Allocating host memory for a region failed.
    #[error("allocating {len} bytes of host memory failed: {source}")]
    AllocMemory {
        /// Bytes asked for.
        len: usize,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_reg_mr` failed.
    #[error("ibv_reg_mr({len} bytes, access {access}) failed: {source}")]
    RegisterMemory {
        /// Region length.
        len: usize,
        /// Access flags asked for.
        access: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// A byte range outside a local region.
    #[error("range [{offset}, {offset}+{len}) is outside the {region_len}-byte region")]
    OutOfRange {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// `ibv_dereg_mr` failed.
    #[error("ibv_dereg_mr failed: {0}")]
    DeregisterMemory(#[source] io::Error),
    /// The region is used by posted work requests whose completions have not been polled.
    #[error("memory region is busy: {in_flight} posted work request(s) still use it; poll their completions first")]
    RegionBusy {
        /// Work requests still holding the region.
        in_flight: usize,
    },
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel failed: {0}")]
    CreateCompChannel(#[source] io::Error),
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq({entries} entries) failed: {source}")]
    CreateCq {
        /// Entries asked for.
        entries: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_req_notify_cq` failed.
    #[error("ibv_req_notify_cq failed: {0}")]
    ReqNotifyCq(#[source] io::Error),
    /// Waiting for / reading a completion event failed.
    #[error("waiting for a completion event failed: {0}")]
    CqEvent(#[source] io::Error),
    /// This CQ was created without a completion channel.
    #[error("the completion queue has no completion channel (create it with Cq::with_channel)")]
    NoCompChannel,
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed (returned {0})")]
    PollCq(i32),
    /// `ibv_create_qp` failed.
    #[error("ibv_create_qp(RC, send {send_wr}, recv {recv_wr}) failed: {source}")]
    CreateQp {
        /// Send queue depth asked for.
        send_wr: u32,
        /// Receive queue depth asked for.
        recv_wr: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_modify_qp` failed.
    #[error("ibv_modify_qp(qpn {qpn}) to {to} failed: {source}")]
    ModifyQp {
        /// Queue pair number.
        qpn: u32,
        /// Target state.
        to: &'static str,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// `ibv_query_qp` failed.
    #[error("ibv_query_qp(qpn {qpn}) failed: {source}")]
    QueryQp {
        /// Queue pair number.
        qpn: u32,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// The queue pair must be connected first.
    #[error("queue pair {qpn} is in state {state}, expected {expected}")]
    QpState {
        /// Queue pair number.
        qpn: u32,
        /// Current state.
        state: &'static str,
        /// State the operation needs.
        expected: &'static str,
    },
    /// The queue pair went into the error state; nothing more can be posted on it.
    #[error("queue pair {qpn} is in the error state: {cause}")]
    QpInError {
        /// Queue pair number.
        qpn: u32,
        /// The first failed completion, or what was observed.
        cause: String,
    },
    /// The peer's endpoint cannot be used with this queue pair.
    #[error("invalid peer endpoint for qpn {qpn}: {reason}")]
    BadEndpoint {
        /// Local queue pair number.
        qpn: u32,
        /// What is wrong.
        reason: String,
    },
    /// A work request was rejected before posting (nothing of its list was posted).
    #[error("{op} work request #{index} (wr_id {wr_id}): {reason}")]
    InvalidWr {
        /// The operation.
        op: OpKind,
        /// Position in the posted list.
        index: usize,
        /// The caller's wr_id.
        wr_id: u64,
        /// What is wrong.
        reason: String,
    },
    /// Posting would exceed the queue depth.
    #[error("{queue} queue of qpn {qpn} full: {outstanding} outstanding + {posting} new > depth {depth}")]
    QueueFull {
        /// "send" or "receive".
        queue: &'static str,
        /// Queue pair number.
        qpn: u32,
        /// Work requests not yet completed.
        outstanding: usize,
        /// Work requests in this call.
        posting: usize,
        /// The queue's depth.
        depth: usize,
    },
    /// `ibv_post_send` / `ibv_post_recv` failed; WRs from `index` on were not posted.
    #[error("{verb}(qpn {qpn}) failed at work request #{index}: {source}")]
    Post {
        /// `ibv_post_send` or `ibv_post_recv`.
        verb: &'static str,
        /// Queue pair number.
        qpn: u32,
        /// First work request not posted.
        index: usize,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// The operation is not supported by the device (`EOPNOTSUPP`).
    #[error("{what} is not supported by this device")]
    Unsupported {
        /// What was attempted.
        what: String,
    },
}

impl From<crate::mem::MemError> for Error {
    fn from(e: crate::mem::MemError) -> Self {
        match e {
            crate::mem::MemError::Alloc { len, source } => Self::AllocMemory { len, source },
            crate::mem::MemError::OutOfRange { offset, len, size } => Self::OutOfRange {
                offset,
                len,
                region_len: size,
            },
            crate::mem::MemError::Device(what) => Self::Unsupported { what },
        }
    }
}

/// The last OS error (`errno`) as an `io::Error`.
pub(crate) fn last_os_error() -> io::Error {
    io::Error::last_os_error()
}

/// An `io::Error` from a verbs return code: some verbs return the errno itself, some
/// return -1 and set errno.
pub(crate) fn from_ret(ret: i32) -> io::Error {
    if ret > 0 {
        io::Error::from_raw_os_error(ret)
    } else if ret < -1 {
        io::Error::from_raw_os_error(-ret)
    } else {
        io::Error::last_os_error()
    }
}

/// Classify the errno of a failed `ibv_get_device_list` (NULL return).
pub fn classify_device_list_errno(errno: i32) -> Error {
    match errno {
        libc::EOPNOTSUPP => Error::Unavailable(Unavailable::NoLibrary),
        libc::ENOSYS => Error::Unavailable(Unavailable::NoKernelSupport),
        e => Error::GetDeviceList(io::Error::from_raw_os_error(e)),
    }
}

impl Error {
    /// True when RDMA cannot be used on this host at all (fall back to TCP).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}
