//! The operation of a work request or completion (what errors and completions name).

use std::fmt;

/// The operation of a work request or completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with immediate data (consumes a RECV on the peer).
    WriteWithImm,
    /// RDMA READ.
    Read,
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendWithImm,
    /// A receive that took a SEND.
    Recv,
    /// A receive consumed by an RDMA WRITE with immediate data.
    RecvRdmaWithImm,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Write => "RDMA WRITE",
            Self::WriteWithImm => "RDMA WRITE_WITH_IMM",
            Self::Read => "RDMA READ",
            Self::Send => "SEND",
            Self::SendWithImm => "SEND_WITH_IMM",
            Self::Recv => "RECV",
            Self::RecvRdmaWithImm => "RECV (RDMA WRITE_WITH_IMM)",
        })
    }
}
