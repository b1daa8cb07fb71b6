//! Ordered messages (notifications, heartbeats, registrations) between two peers over
//! fixed-size receive slots, with credit-based flow control so a burst never overruns the
//! receiver (no RNR retries on RDMA, no unbounded buffering anywhere).
//!
//! The pure parts live here — the frame header, fragmentation and reassembly, and the credit
//! accounting; [`rdma`] runs them over SEND/RECV on an RC queue pair.
//!
//! # Credits
//! Each side posts `slots` receives. A sender holds one credit per receive the peer has
//! posted for it and spends one per frame. The receiver hands credits back when it has
//! consumed (and reposted) frames: piggybacked on any frame it sends, or in a credit-only
//! frame once half its slots wait to be returned. Data frames never take the last credit;
//! it is kept for a credit-only frame, so two peers that both run low can always tell each
//! other about freed slots, and neither can deadlock.

#[cfg(feature = "verbs")]
pub mod rdma;

use std::fmt;

/// Size of the frame header in bytes.
///
/// Four, not eight (magic, flags, two reserved bytes and 32-bit credits before): with its
/// 8-byte sequence number a 64-byte notification made an 80-byte frame, and Soft-RoCE computes
/// the ICRC of a payload of 79 bytes or more with PCLMUL, saving the posting thread's FPU
/// state for it in every post (`save_fpregs_to_fpstate`, `crc32_pclmul_le` in a `perf`
/// profile of the lab's ping-pong; `ib_send_lat`'s 64-byte payload stays under it). At 76
/// bytes it stays under too; a larger message gains only the four bytes.
pub const HEADER: usize = 4;
/// Largest message accepted (reassembly stops with an error beyond it).
pub const MAX_MESSAGE: usize = 16 << 20;

const FIRST: u8 = 1;
const LAST: u8 = 2;
const CREDIT_ONLY: u8 = 4;
/// 'K'. Frames of the 8-byte header began with 'k' (0x6b): a frame of the other layout is
/// refused as malformed ("bad frame magic") instead of being read at the wrong width.
const MAGIC: u8 = 0x4b;

/// The frame layout this build speaks, which the two ends of a channel agree on before it
/// opens (the agent's `ChanOpen`): 1 was the 8-byte header, 2 is the 4-byte one. A receiver
/// refuses a frame of the other layout, but its queue pair has already acknowledged it and
/// the sender counted it delivered: agreeing first is what keeps such notifications from
/// being lost.
pub const FRAME_FORMAT: u8 = 2;

/// A frame header: credits handed back, and where the frame sits in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Credits the sender returns to the receiver of this frame.
    pub credits: u16,
    /// The first frame of a message.
    pub first: bool,
    /// The last frame of a message.
    pub last: bool,
    /// A frame that carries only credits (no message bytes).
    pub credit_only: bool,
}

impl Header {
    /// The 4 bytes on the wire: magic, flags, credits (little endian).
    pub fn encode(&self) -> [u8; HEADER] {
        let flags = (u8::from(self.first) * FIRST)
            | (u8::from(self.last) * LAST)
            | (u8::from(self.credit_only) * CREDIT_ONLY);
        let c = self.credits.to_le_bytes();
        [MAGIC, flags, c[0], c[1]]
    }

    /// Parse a frame's header.
    ///
    /// # Errors
    /// A short frame, a bad magic byte, or unknown flags.
    pub fn decode(frame: &[u8]) -> Result<Self, NotifFrameError> {
        if frame.len() < HEADER {
            return Err(NotifFrameError::Short(frame.len()));
        }
        if frame[0] != MAGIC {
            return Err(NotifFrameError::Magic(frame[0]));
        }
        let flags = frame[1];
        if flags & !(FIRST | LAST | CREDIT_ONLY) != 0 {
            return Err(NotifFrameError::Flags(flags));
        }
        let credit_only = flags & CREDIT_ONLY != 0;
        if credit_only && (frame.len() != HEADER || flags != CREDIT_ONLY) {
            return Err(NotifFrameError::Flags(flags));
        }
        Ok(Self {
            credits: u16::from_le_bytes([frame[2], frame[3]]),
            first: flags & FIRST != 0,
            last: flags & LAST != 0,
            credit_only,
        })
    }
}

/// A malformed notification-channel frame or message (the side channel's length-prefixed
/// frames have [`crate::proto::frame::FrameError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotifFrameError {
    /// Shorter than a header.
    #[error("frame of {0} bytes is shorter than the {HEADER}-byte header")]
    Short(usize),
    /// Not one of our frames.
    #[error("bad frame magic {0:#04x}")]
    Magic(u8),
    /// Unknown or inconsistent flags.
    #[error("bad frame flags {0:#04x}")]
    Flags(u8),
    /// A continuation without a first frame, or a first frame in the middle of a message.
    #[error("frame out of sequence: {0}")]
    Sequence(&'static str),
    /// The message grew past [`MAX_MESSAGE`].
    #[error("message longer than {MAX_MESSAGE} bytes")]
    TooLong,
    /// More credits returned than were ever spent.
    #[error("peer returned {returned} credit(s) with only {outstanding} outstanding")]
    Credits {
        /// Returned now.
        returned: u32,
        /// Frames sent and not yet returned.
        outstanding: u32,
    },
}

/// Split `msg` into frame payloads of at most `slot - HEADER` bytes (one empty payload for an
/// empty message). Returns (payload range, first, last) per frame.
pub fn fragments(
    len: usize,
    slot: usize,
) -> impl Iterator<Item = (std::ops::Range<usize>, bool, bool)> {
    let per = slot.saturating_sub(HEADER).max(1);
    let n = len.div_ceil(per).max(1);
    (0..n).map(move |i| {
        let start = i * per;
        (start..(start + per).min(len), i == 0, i + 1 == n)
    })
}

/// Reassembles messages from frames, in order.
#[derive(Debug, Default)]
pub struct Assembler {
    partial: Option<Vec<u8>>,
}

impl Assembler {
    /// Feed one data frame's header and payload; a complete message comes back.
    ///
    /// # Errors
    /// Frames out of sequence or a message over [`MAX_MESSAGE`].
    pub fn push(&mut self, h: &Header, payload: &[u8]) -> Result<Option<Vec<u8>>, NotifFrameError> {
        let mut buf = match (h.first, self.partial.take()) {
            (true, None) => Vec::with_capacity(payload.len()),
            (true, Some(_)) => {
                return Err(NotifFrameError::Sequence("a first frame inside a message"))
            }
            (false, Some(b)) => b,
            (false, None) => {
                return Err(NotifFrameError::Sequence(
                    "a continuation without a first frame",
                ))
            }
        };
        if buf.len() + payload.len() > MAX_MESSAGE {
            return Err(NotifFrameError::TooLong);
        }
        buf.extend_from_slice(payload);
        if h.last {
            Ok(Some(buf))
        } else {
            self.partial = Some(buf);
            Ok(None)
        }
    }
}

/// Credit accounting of one direction pair (what we may send, what we owe back).
#[derive(Debug, Clone)]
pub struct Credits {
    slots: u32,
    /// Frames we may still send (the peer's posted receives we have not used).
    available: u32,
    /// Frames we received and reposted, not yet returned to the peer.
    owed: u32,
}

impl Credits {
    /// Smallest slot count: with fewer, returning credits takes one frame's worth, so each
    /// credit-only frame would be answered by another, forever.
    pub const MIN_SLOTS: u32 = 4;

    /// Both sides post `slots` receives (at least [`Credits::MIN_SLOTS`]; one is kept for
    /// credit-only frames).
    pub fn new(slots: u32) -> Self {
        let slots = slots.max(Self::MIN_SLOTS);
        Self {
            slots,
            available: slots,
            owed: 0,
        }
    }

    /// Receives each side posts.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Frames we may send now.
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Credits we owe the peer.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// True when a data frame may go (the last credit is kept for credit-only frames).
    pub fn can_send_data(&self) -> bool {
        self.available >= 2
    }

    /// True when a credit-only frame should go now: half the slots wait to be returned and
    /// a credit is there to carry it.
    pub fn should_return(&self) -> bool {
        self.owed >= (self.slots / 2).max(1) && self.available >= 1
    }

    /// A frame that carries no credits is being sent (fault injection).
    #[cfg(feature = "verbs")]
    pub(crate) fn spend_without_returning(&mut self) {
        self.available = self.available.saturating_sub(1);
    }

    /// A frame is being sent: spend a credit, and piggyback what is owed (up to the
    /// header's 16 bits; the rest rides on the next frame). Returns the credits to put in
    /// its header.
    pub fn spend(&mut self) -> u16 {
        debug_assert!(self.available > 0);
        self.available = self.available.saturating_sub(1);
        let give = u16::try_from(self.owed).unwrap_or(u16::MAX);
        self.owed -= u32::from(give);
        give
    }

    /// A frame arrived (and its receive is reposted): we owe a credit, and we got `returned`.
    ///
    /// # Errors
    /// [`NotifFrameError::Credits`] when the peer returns more than we spent.
    pub fn received(&mut self, returned: u32) -> Result<(), NotifFrameError> {
        self.arrived(returned)?;
        self.reposted(1);
        Ok(())
    }

    /// A frame arrived carrying `returned` credits; its receive is not posted again yet
    /// (we owe nothing for it until [`Credits::reposted`]).
    ///
    /// # Errors
    /// [`NotifFrameError::Credits`] when the peer returns more than we spent.
    pub fn arrived(&mut self, returned: u32) -> Result<(), NotifFrameError> {
        let outstanding = self.slots - self.available;
        if returned > outstanding {
            return Err(NotifFrameError::Credits {
                returned,
                outstanding,
            });
        }
        self.available += returned;
        Ok(())
    }

    /// `n` receives of arrived frames are posted again: we owe the peer `n` credits more.
    pub fn reposted(&mut self, n: u32) {
        self.owed += n;
    }
}

impl fmt::Display for Credits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} credits available, {} owed",
            self.available, self.slots, self.owed
        )
    }
}

#[cfg(test)]
mod tests;
