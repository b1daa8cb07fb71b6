//! Messages of the TCP data path and side channel: msgpack inside length-prefixed frames
//! (`proto::frame`), read with a size bound.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use crate::proto::frame::{self, FrameDecoder};
use crate::proto::handshake::HandshakeInfo;

/// Largest frame: a data chunk plus headers.
pub(crate) const MAX_FRAME: usize = CHUNK + 4096;
/// Data moves in chunks of at most this many bytes.
pub(crate) const CHUNK: usize = 4 << 20;

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Msg {
    /// Side channel: send me your metadata.
    GetMetadata,
    /// Side channel: the metadata.
    Metadata(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Data path: agent `info.agent` attaches; the target checks the handshake too.
    Attach { info: HandshakeInfo },
    /// Attach accepted.
    Attached,
    /// Verbs: create queue pairs for (initiator rail, target rail, initiator endpoint).
    #[cfg(feature = "verbs")]
    QpOpen {
        pairs: Vec<(u32, u32, crate::transport::verbs::Endpoint)>,
    },
    /// Verbs: the target's endpoints, in request order, already connected.
    #[cfg(feature = "verbs")]
    QpOpened {
        endpoints: Vec<crate::transport::verbs::Endpoint>,
    },
    /// Verbs: open the receiving end of a notification channel on target rail `rail`,
    /// connected to the initiator's endpoint.
    #[cfg(feature = "verbs")]
    ChanOpen {
        rail: u32,
        ep: crate::transport::verbs::Endpoint,
    },
    /// Verbs: the target's channel endpoint, connected.
    #[cfg(feature = "verbs")]
    ChanOpened {
        ep: crate::transport::verbs::Endpoint,
    },
    /// Attach refused, or a request that cannot be served at all.
    Refused { message: String },
    /// Bytes of a WRITE for `region` at `offset`.
    Write {
        xfer: u64,
        region: u32,
        offset: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// All WRITE bytes of `xfer` were sent; deliver `notif` once they are in place, then ack.
    WriteEnd {
        xfer: u64,
        #[serde(with = "serde_bytes")]
        notif: Option<Vec<u8>>,
    },
    /// READ `len` bytes of `region` at `offset` for descriptor `idx`.
    ReadReq {
        xfer: u64,
        idx: u32,
        region: u32,
        offset: u64,
        len: u64,
    },
    /// Bytes of descriptor `idx`, starting `at` bytes into it.
    ReadResp {
        xfer: u64,
        idx: u32,
        at: u64,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// A notification.
    Notif(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A numbered notification (after the verbs notification channel failed; numbers
    /// continue the channel's, so the target delivers each once, in order).
    SeqNotif {
        seq: u64,
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// `xfer`'s WRITE landed (and its notification, if any, was delivered).
    Ack { xfer: u64 },
    /// `xfer` failed on the target.
    Fail { xfer: u64, message: String },
}

/// Write one message.
pub(crate) fn send(w: &mut impl Write, m: &Msg) -> std::io::Result<()> {
    let body = rmp_serde::to_vec(m)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let f = frame::encode(&body)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    w.write_all(&f)
}

/// Reads messages from a stream, bounded.
pub(crate) struct Reader<R> {
    r: R,
    dec: FrameDecoder,
    buf: Vec<u8>,
}

impl<R: Read> Reader<R> {
    pub(crate) fn new(r: R) -> Self {
        Self {
            r,
            dec: FrameDecoder::new(MAX_FRAME),
            buf: vec![0u8; 256 << 10],
        }
    }

    /// The next message; `Ok(None)` at a clean end of stream.
    pub(crate) fn next(&mut self) -> Result<Option<Msg>, String> {
        loop {
            if let Some(body) = self.dec.next_frame().map_err(|e| e.to_string())? {
                return rmp_serde::from_slice(&body)
                    .map(Some)
                    .map_err(|e| format!("malformed message: {e}"));
            }
            let n = self.r.read(&mut self.buf).map_err(|e| e.to_string())?;
            if n == 0 {
                return self.dec.finish().map(|()| None).map_err(|e| e.to_string());
            }
            self.dec.push(&self.buf[..n]);
        }
    }
}
