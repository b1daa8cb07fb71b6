//! Messages of the TCP data path and side channel: msgpack inside length-prefixed frames
//! (`proto::frame`), read with a size bound.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use crate::proto::frame::FrameDecoder;
use crate::proto::handshake::HandshakeInfo;

/// Largest frame (data travels raw after its header frame; metadata is the largest).
pub(crate) const MAX_FRAME: usize = CHUNK + 4096;
/// Data moves in chunks of at most this many bytes.
pub(crate) const CHUNK: usize = 4 << 20;

// a notification travels in one chunk
const _: () = assert!(crate::agent::xfer::MAX_NOTIF_LEN <= CHUNK);

/// What [`Reader::next`] says when its stream's read timeout passed without a message.
pub(crate) const TIMED_OUT: &str = "timed out";

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
    ///
    /// `frames` is the initiator's frame layout (`transport::notif::FRAME_FORMAT`; absent
    /// from builds before it was sent: 1).
    #[cfg(feature = "verbs")]
    ChanOpen {
        rail: u32,
        ep: crate::transport::verbs::Endpoint,
        #[serde(default = "frame_format_before")]
        frames: u8,
    },
    /// Verbs: the target's channel endpoint, connected, and its frame layout.
    #[cfg(feature = "verbs")]
    ChanOpened {
        ep: crate::transport::verbs::Endpoint,
        #[serde(default = "frame_format_before")]
        frames: u8,
    },
    /// Attach refused, or a request that cannot be served at all.
    Refused { message: String },
    /// `len` bytes of a WRITE for `region` at `offset`; the bytes follow the frame raw.
    WriteData {
        xfer: u64,
        region: u32,
        offset: u64,
        len: u32,
        /// The grant it goes through (fenced memory; 0: none).
        #[serde(default)]
        grant: u64,
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
        /// The grant it goes through (fenced memory; 0: none).
        #[serde(default)]
        grant: u64,
    },
    /// `len` bytes of descriptor `idx`, starting `at` bytes into it; the bytes follow the
    /// frame raw.
    ReadData {
        xfer: u64,
        idx: u32,
        at: u64,
        len: u32,
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
    /// Side channel, with a cluster secret: the connecting side's nonce (`auth`).
    AuthHello {
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
    },
    /// The agent's nonce and its proof of the secret.
    AuthChallenge {
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        #[serde(with = "serde_bytes")]
        proof: Vec<u8>,
    },
    /// The connecting side's proof of the secret.
    AuthProof {
        #[serde(with = "serde_bytes")]
        proof: Vec<u8>,
    },
    /// Side channel: load this metadata (the sender's own, NIXL's `sendLocalMD`) and
    /// connect back; `partial`: add its regions to what is known of the sender.
    PutMetadata {
        #[serde(with = "serde_bytes")]
        metadata: Vec<u8>,
        partial: bool,
    },
    /// Side channel: forget agent `name` (NIXL's `invalidateLocalMD`), sent from its host.
    Forget { name: String },
    /// PutMetadata or Forget done, for agent `name`.
    Taken { name: String },
}

/// The notification frame layout of a peer that does not say (builds before the layout was
/// agreed on: the 8-byte header).
#[cfg(feature = "verbs")]
fn frame_format_before() -> u8 {
    1
}

/// Append one message's frame to `out` (to be written later, with others): the body is
/// encoded in place behind room for its length, which is filled in after (no body vector
/// of its own, grown and copied for every message of a batch). On an error `out` is as it
/// was.
pub(crate) fn encode_into(out: &mut Vec<u8>, m: &Msg) -> std::io::Result<()> {
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    let len = rmp_serde::encode::write(out, m)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        .and_then(|()| {
            u32::try_from(out.len() - at - 4)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        });
    match len {
        Ok(len) => {
            out[at..at + 4].copy_from_slice(&len.to_be_bytes());
            Ok(())
        }
        Err(e) => {
            out.truncate(at);
            Err(e)
        }
    }
}

/// Write one message (its frame as [`encode_into`] makes it).
pub(crate) fn send(w: &mut impl Write, m: &Msg) -> std::io::Result<()> {
    let mut f = Vec::new();
    encode_into(&mut f, m)?;
    w.write_all(&f)
}

impl Reader<std::net::TcpStream> {
    /// The `len` raw bytes that follow a data message's frame, straight into host memory
    /// `dst` at `offset`: what was already read with the frame, then from the socket into
    /// the buffer itself (`tcp_io`). Returns the bytes kvrail copied (those read with the
    /// frame).
    pub(crate) fn payload_into(
        &mut self,
        len: u32,
        dst: &crate::mem::HostBuffer,
        offset: usize,
    ) -> Result<u64, String> {
        let len = len as usize;
        if len > CHUNK {
            return Err(format!(
                "protocol error: a data message of {len} bytes (at most {CHUNK})"
            ));
        }
        let have = self.dec.buffered().min(len);
        dst.with_mut(offset, have, |b| {
            self.dec.take_raw(b);
            Ok(())
        })
        .map_err(|e| e.to_string())?;
        crate::agent::tcp_io::recv_into(&self.r, dst, offset + have, len - have)
            .map_err(|e| format!("inside a data message: {e}"))?;
        Ok(have as u64)
    }

    /// The next message if it is here whole, without waiting: what is buffered, then what
    /// the socket holds now (a non-blocking receive). `Ok(None)`: not yet; `Err` ends the
    /// connection as [`Reader::next`]'s would (its end of stream is "closed by the peer").
    pub(crate) fn try_next(&mut self) -> Result<Option<Msg>, String> {
        use std::os::fd::AsRawFd;
        loop {
            if let Some(m) = self.buffered_msg()? {
                return Ok(Some(m));
            }
            let fd = self.r.as_raw_fd();
            let got = self.dec.read_with(READ_AHEAD, |room| {
                nix::sys::socket::recv(fd, room, nix::sys::socket::MsgFlags::MSG_DONTWAIT)
            });
            match got {
                Ok(0) => {
                    return Err(self
                        .dec
                        .finish()
                        .map_or_else(|e| e.to_string(), |()| "closed by the peer".into()))
                }
                Ok(_) => {}
                Err(nix::errno::Errno::EAGAIN) => return Ok(None),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Bytes read past the last message taken (a data message's payload, or later frames).
    pub(crate) fn buffered(&self) -> usize {
        self.dec.buffered()
    }
}

/// Write a data message: `header` (a `WriteData` or `ReadData` of `len` bytes), then the
/// bytes `fill` puts in place — copied once, from registered memory into the buffer the
/// socket sends from (`frame`, reused between chunks).
pub(crate) fn send_data<E>(
    w: &mut impl Write,
    frame: &mut Vec<u8>,
    header: &Msg,
    len: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
) -> std::io::Result<Result<(), E>> {
    let body = rmp_serde::to_vec(header)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    frame.clear();
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    let at = frame.len();
    frame.resize(at + len, 0);
    if let Err(e) = fill(&mut frame[at..]) {
        return Ok(Err(e));
    }
    w.write_all(frame).map(Ok)
}

/// A receive asks for at most this many bytes: what is read ahead of a data message's
/// payload is copied once more (into place), so it stays small.
const READ_AHEAD: usize = 64 << 10;

/// Reads messages from a stream, bounded.
pub(crate) struct Reader<R> {
    r: R,
    dec: FrameDecoder,
    /// The raw bytes of the last data message (up to `CHUNK`).
    payload: Vec<u8>,
}

impl<R: Read> Reader<R> {
    pub(crate) fn new(r: R) -> Self {
        Self {
            r,
            dec: FrameDecoder::new(MAX_FRAME),
            payload: Vec::new(),
        }
    }

    /// The `len` raw bytes that follow a data message's frame: what was already read with
    /// the frame, then the rest straight from the stream.
    pub(crate) fn payload(&mut self, len: u32) -> Result<&[u8], String> {
        let len = len as usize;
        if len > CHUNK {
            return Err(format!(
                "protocol error: a data message of {len} bytes (at most {CHUNK})"
            ));
        }
        if self.payload.len() < len {
            self.payload.resize(len, 0);
        }
        let have = self.dec.take_raw(&mut self.payload[..len]);
        self.r
            .read_exact(&mut self.payload[have..len])
            .map_err(|e| format!("inside a data message: {e}"))?;
        Ok(&self.payload[..len])
    }

    /// Whether the next message is read already (`next` will not wait for the stream).
    pub(crate) fn has_frame(&self) -> bool {
        self.dec.has_frame()
    }

    /// The next message if its frame is read already.
    fn buffered_msg(&mut self) -> Result<Option<Msg>, String> {
        let m = self
            .dec
            .next_frame_with(|b| rmp_serde::from_slice::<Msg>(b));
        match m.map_err(|e| e.to_string())? {
            Some(m) => m.map(Some).map_err(|e| format!("malformed message: {e}")),
            None => Ok(None),
        }
    }

    /// The next message; `Ok(None)` at a clean end of stream.
    pub(crate) fn next(&mut self) -> Result<Option<Msg>, String> {
        loop {
            if let Some(m) = self.buffered_msg()? {
                return Ok(Some(m));
            }
            let r = &mut self.r;
            let n = (self.dec)
                .read_with(READ_AHEAD, |room| r.read(room))
                .map_err(|e| match e.kind() {
                    // a read timeout (the handshake's): said as what it is, not as EAGAIN
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                        TIMED_OUT.to_owned()
                    }
                    _ => e.to_string(),
                })?;
            if n == 0 {
                return self.dec.finish().map(|()| None).map_err(|e| e.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{encode_into, Msg, Reader};

    /// A batch's frames, encoded in place, are exactly the wire's frames one after another
    /// (`frame::encode` of the message's msgpack body), and a reader takes them back in order.
    #[test]
    fn frames_encoded_in_place_are_the_wire_frames() {
        let msgs = [
            Msg::WriteData {
                xfer: 7,
                region: 3,
                offset: 1 << 40,
                len: 4096,
                grant: 9,
            },
            Msg::WriteEnd {
                xfer: 7,
                notif: Some(b"done".to_vec()),
            },
            Msg::Notif(vec![0xab; 300]),
            Msg::SeqNotif {
                seq: u64::MAX,
                bytes: Vec::new(),
            },
        ];
        let mut batch = b"earlier".to_vec();
        let mut wire = b"earlier".to_vec();
        for m in &msgs {
            encode_into(&mut batch, m).unwrap();
            let body = rmp_serde::to_vec(m).unwrap();
            wire.extend(crate::proto::frame::encode(&body).unwrap());
        }
        assert_eq!(batch, wire);
        let mut r = Reader::new(&batch[b"earlier".len()..]);
        for m in &msgs {
            let got = r.next().unwrap().expect("a message");
            assert_eq!(format!("{got:?}"), format!("{m:?}"));
        }
        assert!(r.next().unwrap().is_none());
    }
}

/// The notification channel's frame layout is agreed on when it opens: a `ChanOpen` or
/// `ChanOpened` from a build that does not send its layout reads as layout 1 (the 8-byte
/// header), and an endpoint whose layout differs from ours is refused with both named.
#[cfg(all(test, feature = "verbs"))]
mod frame_layout {
    use serde::Serialize;

    use super::Msg;
    use crate::agent::control::qp_exchange::frames_agree;
    use crate::transport::notif::FRAME_FORMAT;
    use crate::transport::verbs::{Endpoint, Gid, Mtu};

    /// The messages as builds before the layout was sent wrote them (same variants, in the
    /// same order, up to the channel's).
    #[derive(Serialize)]
    #[allow(dead_code)]
    enum Before {
        GetMetadata,
        Metadata(Vec<u8>),
        Attach(u8),
        Attached,
        QpOpen(u8),
        QpOpened(u8),
        ChanOpen { rail: u32, ep: Endpoint },
        ChanOpened { ep: Endpoint },
    }

    fn ep() -> Endpoint {
        Endpoint {
            qpn: 0x12_3456,
            psn: 77,
            gid: Gid([9; 16]),
            lid: 0,
            mtu: Mtu::Mtu1024,
            rd_atomic: 16,
        }
    }

    #[test]
    fn an_older_peers_channel_is_refused_by_name() {
        let old = rmp_serde::to_vec(&Before::ChanOpen { rail: 3, ep: ep() }).unwrap();
        let Msg::ChanOpen {
            rail,
            ep: got,
            frames,
        } = rmp_serde::from_slice(&old).unwrap()
        else {
            panic!("not a ChanOpen");
        };
        assert_eq!((rail, got.qpn, frames), (3, 0x12_3456, 1));
        let e = frames_agree(frames).unwrap_err();
        assert!(e.contains("layout 1 there and 2 here"), "{e}");
        let old = rmp_serde::to_vec(&Before::ChanOpened { ep: ep() }).unwrap();
        let Msg::ChanOpened { frames, .. } = rmp_serde::from_slice(&old).unwrap() else {
            panic!("not a ChanOpened");
        };
        assert!(frames_agree(frames).is_err());
        // this build's answer carries its layout, and is taken
        let new = Msg::ChanOpened {
            ep: ep(),
            frames: FRAME_FORMAT,
        };
        let Msg::ChanOpened { ep: got, frames } =
            rmp_serde::from_slice(&rmp_serde::to_vec(&new).unwrap()).unwrap()
        else {
            panic!("not a ChanOpened");
        };
        frames_agree(frames).unwrap();
        assert_eq!(got.qpn, 0x12_3456);
    }
}
