//! The agent's errors, typed and grouped by fault: [`AgentError`] for calls (what to fix),
//! [`XferError`] for a transfer that failed after it was posted, and [`Fault`], the group
//! either belongs to — API misuse, the peer, the connection, the RDMA fabric, memory, or a
//! missing capability — so an engine decides what to do (fix the call, reload the peer,
//! retry, give up) without reading messages.

use super::metadata::MetadataError;
use crate::proto::handshake::HandshakeError;
use crate::store::StoreError;

/// Which side of the system an error comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The caller's: a bad argument, an unknown id, a call in the wrong state.
    Misuse,
    /// The peer's: it refused the handshake, sent unusable metadata, or failed its part.
    Peer,
    /// The side channel or data connection: closed, unreachable, lost.
    Connection,
    /// The RDMA fabric: work completions in error, no rail left.
    Rdma,
    /// Memory: it cannot be registered, or a copy (a device runtime's) failed.
    Memory,
    /// This build or host cannot do it (no RDMA, a missing capability, configuration).
    Unavailable,
    /// Nothing was heard from the peer within the bound.
    Timeout,
}

/// An agent error. Variants name what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// No such local region.
    #[error("no registered region {0}")]
    NoRegion(u32),
    /// A byte range outside a region.
    #[error("range [{offset}, {offset}+{len}) is outside region {region} ({size} bytes)")]
    OutOfRange {
        /// Region id.
        region: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region size.
        size: u64,
    },
    /// Deregistration refused: active transfers use the region.
    #[error("region {region} is used by {transfers} active transfer(s); wait for them (or release them) first")]
    RegionBusy {
        /// Region id.
        region: u32,
        /// Active transfers.
        transfers: usize,
    },
    /// Deregistration could not finish in time: chunks of peers' transfers (TCP) or work
    /// requests (verbs) still reached the region. It stays registered.
    #[error(
        "region {region} is still reached by {holders} after {waited_ms} ms; it stays \
         registered: try again, or invalidate the peers whose transfers hold it"
    )]
    DeregisterTimeout {
        /// Region id.
        region: u32,
        /// What still reached it.
        holders: String,
        /// How long deregistration waited.
        waited_ms: u64,
    },
    /// A descriptor list is unusable; nothing was posted.
    #[error("{side} descriptor #{index}: {reason}")]
    InvalidDesc {
        /// "local" or "remote".
        side: &'static str,
        /// Index in the list.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The two lists differ in length.
    #[error("descriptor lists differ in length: {local} local, {remote} remote")]
    LengthMismatch {
        /// Local count.
        local: usize,
        /// Remote count.
        remote: usize,
    },
    /// A notification over [`crate::agent::xfer::MAX_NOTIF_LEN`] bytes; nothing was queued.
    #[error("a notification of {len} bytes is over the limit of {max} bytes")]
    NotifTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// No such peer (load its metadata first).
    #[error("unknown peer {0:?}: load its metadata first")]
    UnknownPeer(String),
    /// No such transfer.
    #[error("no transfer {0}")]
    NoXfer(u64),
    /// The transfer is in progress.
    #[error("transfer {0} is in progress: wait until it is done or failed")]
    Active(u64),
    /// The peer was refused in the handshake.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// The peer's metadata is unusable.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The side channel or data connection failed.
    #[error("{what} {addr}: {message}")]
    Connection {
        /// What was attempted.
        what: &'static str,
        /// The address tried.
        addr: String,
        /// The error.
        message: String,
    },
    /// The configuration asks for something this build cannot do.
    #[error("{0}")]
    Unsupported(String),
    /// Memory handed to [`super::Agent::register_memory`] cannot be registered (overlap, layers
    /// outside it, an empty or invalid range); nothing was registered.
    #[error("memory: {0}")]
    InvalidMemory(String),
    /// No grant with this id (never made here, or revoked already).
    #[error("no grant {0:#x} (never made by this agent, or revoked already)")]
    NoGrant(u64),
    /// A grant cannot be made or used as asked (a region that is not fenced, a range
    /// outside a region, rights the region does not give, a token that does not fit the
    /// peer's metadata or does not decode).
    #[error("grant: {0}")]
    InvalidGrant(String),
    /// The metadata store (etcd) could not be reached, failed, or has no such agent.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl AgentError {
    /// The fault group.
    pub fn fault(&self) -> Fault {
        match self {
            Self::NoRegion(_)
            | Self::OutOfRange { .. }
            | Self::RegionBusy { .. }
            | Self::InvalidDesc { .. }
            | Self::LengthMismatch { .. }
            | Self::UnknownPeer(_)
            | Self::NoXfer(_)
            | Self::Active(_)
            | Self::NotifTooLarge { .. }
            | Self::NoGrant(_)
            | Self::InvalidGrant(_) => Fault::Misuse,
            Self::Handshake(_) | Self::Metadata(_) => Fault::Peer,
            Self::DeregisterTimeout { .. } => Fault::Timeout,
            Self::Connection { .. } => Fault::Connection,
            Self::InvalidMemory(_) => Fault::Memory,
            Self::Unsupported(_) => Fault::Unavailable,
            // (here, not in the store: the store sits below the agent and knows no Fault)
            Self::Store(StoreError::Unreachable { .. } | StoreError::Failed { .. }) => {
                Fault::Connection
            }
            Self::Store(StoreError::NotFound(_)) => Fault::Misuse,
            Self::Store(StoreError::Unavailable(_)) => Fault::Unavailable,
        }
    }
}

/// Why a posted transfer failed. Nothing reports success for bytes that did not land.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum XferError {
    /// The connection to the peer ended (closed, lost, or the peer was invalidated).
    #[error("connection to {peer} lost: {why}")]
    ConnectionLost {
        /// The peer.
        peer: String,
        /// What ended it.
        why: String,
    },
    /// The connection to the peer was already closed when the transfer was posted.
    #[error("the connection to the peer is closed")]
    Closed,
    /// The peer refused or failed its part (its own words).
    #[error("{peer}: {message}")]
    Peer {
        /// The peer.
        peer: String,
        /// What it said.
        message: String,
    },
    /// The peer sent what the protocol does not allow (bytes outside a descriptor).
    #[error("{0}")]
    Protocol(String),
    /// RDMA failed on every rail that could carry the transfer.
    #[error("{0}")]
    Rdma(String),
    /// Local memory could not be read or written (a device runtime refused a copy).
    #[error("{0}")]
    Memory(String),
    /// Posting it failed.
    #[error("{0}")]
    Post(String),
    /// No progress from the peer within the bound.
    #[error("{0}")]
    Timeout(String),
    /// The peer refused access through the grant the transfer named: it revoked the grant
    /// (gave the memory back) before the transfer reached it. No byte of the fenced memory
    /// was read or written.
    #[error("grant revoked by {peer}: {why}")]
    GrantRevoked {
        /// The peer that owns the memory.
        peer: String,
        /// What refused it (the completion status, or the peer's words).
        why: String,
    },
}

impl XferError {
    /// The fault group.
    pub fn fault(&self) -> Fault {
        match self {
            Self::ConnectionLost { .. } | Self::Closed => Fault::Connection,
            Self::Peer { .. } | Self::Protocol(_) | Self::GrantRevoked { .. } => Fault::Peer,
            Self::Rdma(_) => Fault::Rdma,
            Self::Memory(_) => Fault::Memory,
            Self::Post(_) => Fault::Misuse,
            Self::Timeout(_) => Fault::Timeout,
        }
    }
}
