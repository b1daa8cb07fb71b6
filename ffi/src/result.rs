//! Result codes and error messages.

use std::cell::RefCell;
use std::ffi::{c_char, CStr};

use kvrail::agent::AgentError;

/// The outcome of a call. Values are stable; ranges: 0 success, 1xx misuse of the API,
/// 2xx agent errors, 3xx transfer outcomes, 9xx internal.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvrail_result {
    /// Success.
    Ok = 0,
    /// A required pointer was NULL.
    NullParameter = 100,
    /// An argument is invalid (see `kvrail_last_error`).
    InvalidArgument = 101,
    /// An output buffer is too small; nothing was written or consumed.
    BufferTooSmall = 102,
    /// A string is not UTF-8.
    InvalidUtf8 = 103,
    /// A configuration key or value is not accepted (the message names the key).
    InvalidConfig = 104,
    /// No such local region.
    NoRegion = 200,
    /// A byte range outside a region.
    OutOfRange = 201,
    /// The region is used by active transfers.
    RegionBusy = 202,
    /// A descriptor is unusable (the message names the side and index).
    InvalidDesc = 203,
    /// Local and remote descriptor lists differ in length.
    LengthMismatch = 204,
    /// No such peer: load its metadata first.
    UnknownPeer = 205,
    /// No such transfer.
    NoXfer = 206,
    /// The transfer is in progress.
    XferActive = 207,
    /// The peer was refused in the handshake.
    Handshake = 208,
    /// Peer metadata is unusable.
    Metadata = 209,
    /// The side channel or data connection failed.
    Connection = 210,
    /// Not supported by this build or configuration.
    Unsupported = 211,
    /// Memory cannot be registered: it overlaps a registration, its layers lie outside it,
    /// or it is not what its kind says (an NPU address outside every allocation).
    InvalidMemory = 212,
    /// The transfer failed (see `kvrail_xfer_error`).
    XferFailed = 300,
    /// The wait timed out; the transfer is still in progress.
    Timeout = 301,
    /// A Rust panic was caught at the boundary (a kvrail bug).
    Panic = 900,
}

impl From<&AgentError> for kvrail_result {
    fn from(e: &AgentError) -> Self {
        match e {
            AgentError::NoRegion(_) => Self::NoRegion,
            AgentError::OutOfRange { .. } => Self::OutOfRange,
            AgentError::RegionBusy { .. } => Self::RegionBusy,
            AgentError::DeregisterTimeout { .. } => Self::Timeout,
            AgentError::InvalidDesc { .. } => Self::InvalidDesc,
            AgentError::LengthMismatch { .. } => Self::LengthMismatch,
            AgentError::UnknownPeer(_) => Self::UnknownPeer,
            AgentError::NoXfer(_) => Self::NoXfer,
            AgentError::Active(_) => Self::XferActive,
            AgentError::Handshake(_) => Self::Handshake,
            AgentError::Metadata(_) => Self::Metadata,
            AgentError::Connection { .. } => Self::Connection,
            AgentError::InvalidMemory(_) => Self::InvalidMemory,
            AgentError::NotifTooLarge { .. }
            | AgentError::NoGrant(_)
            | AgentError::InvalidGrant(_) => Self::InvalidArgument,
            AgentError::Store(_) => match e.fault() {
                kvrail::agent::Fault::Connection => Self::Connection,
                kvrail::agent::Fault::Misuse => Self::UnknownPeer,
                _ => Self::Unsupported,
            },
            _ => Self::Unsupported,
        }
    }
}

/// A failed call inside the library: its code and the full message.
pub(crate) struct Failure(pub(crate) kvrail_result, pub(crate) String);

impl From<AgentError> for Failure {
    fn from(e: AgentError) -> Self {
        Self((&e).into(), e.to_string())
    }
}

impl Failure {
    pub(crate) fn new(code: kvrail_result, msg: impl Into<String>) -> Self {
        Self(code, msg.into())
    }
}

thread_local! {
    static LAST: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn set_last(msg: &str) {
    LAST.with(|l| *l.borrow_mut() = msg.to_owned());
}

impl kvrail_result {
    /// Every code, for lookups from a raw value.
    const ALL: [Self; 22] = [
        Self::Ok,
        Self::NullParameter,
        Self::InvalidArgument,
        Self::BufferTooSmall,
        Self::InvalidUtf8,
        Self::InvalidConfig,
        Self::NoRegion,
        Self::OutOfRange,
        Self::RegionBusy,
        Self::InvalidDesc,
        Self::LengthMismatch,
        Self::UnknownPeer,
        Self::NoXfer,
        Self::XferActive,
        Self::Handshake,
        Self::Metadata,
        Self::Connection,
        Self::Unsupported,
        Self::InvalidMemory,
        Self::XferFailed,
        Self::Timeout,
        Self::Panic,
    ];
}

/// The library's version, "MAJOR.MINOR.PATCH" (a static NUL-terminated string).
#[no_mangle]
pub extern "C" fn kvrail_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// A static, NUL-terminated name for a `kvrail_result` value (never NULL; unknown values
/// get "unknown result code"). Takes the raw value, so any integer is safe to pass.
#[no_mangle]
pub extern "C" fn kvrail_result_message(result: u32) -> *const c_char {
    let Some(result) = kvrail_result::ALL.into_iter().find(|r| *r as u32 == result) else {
        return c"unknown result code".as_ptr();
    };
    let s: &'static CStr = match result {
        kvrail_result::Ok => c"ok",
        kvrail_result::NullParameter => c"a required pointer was NULL",
        kvrail_result::InvalidArgument => c"invalid argument",
        kvrail_result::BufferTooSmall => c"output buffer too small",
        kvrail_result::InvalidUtf8 => c"string is not UTF-8",
        kvrail_result::InvalidConfig => c"configuration not accepted",
        kvrail_result::NoRegion => c"no such region",
        kvrail_result::OutOfRange => c"range outside the region",
        kvrail_result::RegionBusy => c"region used by active transfers",
        kvrail_result::InvalidDesc => c"invalid descriptor",
        kvrail_result::LengthMismatch => c"descriptor lists differ in length",
        kvrail_result::UnknownPeer => c"unknown peer (load its metadata first)",
        kvrail_result::NoXfer => c"no such transfer",
        kvrail_result::XferActive => c"transfer in progress",
        kvrail_result::Handshake => c"handshake refused",
        kvrail_result::Metadata => c"peer metadata unusable",
        kvrail_result::Connection => c"connection failed",
        kvrail_result::Unsupported => c"not supported",
        kvrail_result::InvalidMemory => c"memory cannot be registered",
        kvrail_result::XferFailed => c"transfer failed",
        kvrail_result::Timeout => c"timed out",
        kvrail_result::Panic => c"internal error (panic caught)",
    };
    s.as_ptr()
}

/// Copy the calling thread's last error message (empty after successes only if no error
/// happened yet) into `buf` (`len` bytes, no NUL added); `*out_len` gets its length.
///
/// # Safety
/// `buf` must be valid for `len` bytes and `out_len` for a write.
#[no_mangle]
pub unsafe extern "C" fn kvrail_last_error(
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    crate::util::boundary(|| {
        let msg = LAST.with(|l| l.borrow().clone());
        // SAFETY: the caller promises `buf` is valid for `len` bytes and `out_len` for a write.
        unsafe { crate::util::write_bytes(msg.as_bytes(), buf, len, out_len) }
    })
}
