//! Ordered messages over SEND/RECV on an RC queue pair, with the credits of [`super`]: the
//! receiver never runs out of posted receives, so no frame is ever answered with RNR.

use std::collections::VecDeque;

use smallvec::SmallVec;

use super::{fragments, Assembler, Credits, Header, NotifFrameError, HEADER, MAX_MESSAGE};
use crate::transport::verbs::{Access, Completion, Error, Mr, OpKind, Pd, Qp, RecvWr, SendWr, Sge};

/// A failure of the message channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] Error),
    /// The peer sent something that is not a valid frame sequence.
    #[error("malformed frame from the peer: {0}")]
    Frame(#[from] NotifFrameError),
    /// A send or receive completed with an error; the channel is dead.
    #[error("message channel failed: {0}")]
    Failed(String),
    /// The message is larger than [`MAX_MESSAGE`].
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
}

/// Ordered, flow-controlled messages over one queue pair. Create it before the queue pair
/// is connected (it posts its receives right away), feed it every SEND/RECV completion of
/// that QP ([`MsgChannel::handle`]), and read messages with [`MsgChannel::recv`].
///
/// Uses `slots` receives and up to `slots` sends of the QP's queues (size them for that plus
/// any other traffic), and one region of `2 × slots × slot_size` bytes. wr_ids: receive slot
/// `i` is `i`, send slot `i` is `slots + i`.
///
/// The receives of arrived frames are posted again in batches of `slots / 8` (1 to 8), one
/// `post_recv` for the batch, and their credits go back only once they are posted: a post
/// per message was ~1,300 instructions of a notification's round trip of ~7,000 (callgrind,
/// lab). The batch is at most half the slots, so the credit rules' guarantee holds: a sender
/// left with its last credit means the receiver owes at least half the slots and returns them.
#[derive(Debug)]
pub struct MsgChannel {
    qp: Qp,
    mr: Mr,
    slots: u32,
    slot: usize,
    credits: Credits,
    free_send: Vec<u32>,
    /// Per send slot: the frame in it ends a message.
    ends: Vec<bool>,
    /// Messages whose last frame's SEND completed (the peer's queue pair has them).
    delivered: u64,
    backlog: VecDeque<Vec<u8>>,
    /// Bytes of the front backlog message already framed.
    cursor: usize,
    asm: Assembler,
    /// The frame being read out of its receive slot (reused).
    frame: Vec<u8>,
    /// Receive slots whose frames were read, to be posted again (see the type's comment).
    unposted: Vec<u32>,
    /// How many of those make a post.
    batch: usize,
    inbox: VecDeque<Vec<u8>>,
    failed: Option<String>,
    sent_frames: u64,
    credit_frames: u64,
}

impl MsgChannel {
    /// A channel with `slots` receive and send slots (at least [`Credits::MIN_SLOTS`]) of
    /// `slot_size` bytes (at least 64).
    ///
    /// # Errors
    /// Registration or posting the receives failed.
    pub fn new(pd: &Pd, qp: Qp, slots: u32, slot_size: usize) -> Result<Self, ChannelError> {
        let slots = slots.max(Credits::MIN_SLOTS);
        let slot = slot_size.max(64);
        let mr = Mr::alloc(pd, 2 * slots as usize * slot, Access::LOCAL_WRITE)?;
        let recvs: Vec<RecvWr<'_>> = (0..slots)
            .map(|i| RecvWr {
                wr_id: u64::from(i),
                local: smallvec::smallvec![Sge::new(&mr, i as usize * slot, slot)],
            })
            .collect();
        qp.post_recv(&recvs)?;
        drop(recvs); // they borrow `mr`, which moves into the channel
        Ok(Self {
            qp,
            slots,
            slot,
            credits: Credits::new(slots),
            free_send: (0..slots).rev().collect(),
            ends: vec![false; slots as usize],
            delivered: 0,
            backlog: VecDeque::new(),
            cursor: 0,
            asm: Assembler::default(),
            frame: Vec::with_capacity(slot),
            unposted: Vec::with_capacity(slots as usize),
            batch: (slots / 8).clamp(1, 8) as usize,
            inbox: VecDeque::new(),
            failed: None,
            sent_frames: 0,
            credit_frames: 0,
            mr,
        })
    }

    /// Queue a message; frames go out as credits allow (call [`MsgChannel::handle`] with
    /// completions to make progress).
    ///
    /// # Errors
    /// [`ChannelError::TooLarge`], [`ChannelError::Failed`], or a posting error.
    pub fn send(&mut self, msg: Vec<u8>) -> Result<(), ChannelError> {
        self.check()?;
        if msg.len() > MAX_MESSAGE {
            return Err(ChannelError::TooLarge(msg.len()));
        }
        self.backlog.push_back(msg);
        self.pump()
    }

    /// [`MsgChannel::send`] of the message `head` followed by `body`. When nothing waits
    /// ahead of it and it fits one frame, it is written straight into a send slot (no
    /// message buffer built and freed: a notification's sequence number and bytes).
    ///
    /// # Errors
    /// As [`MsgChannel::send`].
    pub fn send_parts(&mut self, head: &[u8], body: &[u8]) -> Result<(), ChannelError> {
        self.check()?;
        let len = head.len() + body.len();
        if len > MAX_MESSAGE {
            return Err(ChannelError::TooLarge(len));
        }
        if self.backlog.is_empty()
            && HEADER + len <= self.slot
            && self.credits.can_send_data()
            && !self.free_send.is_empty()
        {
            // everything owed rides on this frame: no credit-only frame can be due after it
            return self.post_frame(true, true, false, &[head, body]);
        }
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(head);
        msg.extend_from_slice(body);
        self.backlog.push_back(msg);
        self.pump()
    }

    /// The next complete message, in the order the peer sent them.
    pub fn recv(&mut self) -> Option<Vec<u8>> {
        self.inbox.pop_front()
    }

    /// The queue pair the channel runs on.
    pub fn qp(&self) -> &Qp {
        &self.qp
    }

    /// Messages queued and not yet fully framed onto the wire.
    pub fn backlog(&self) -> usize {
        self.backlog.len()
    }

    /// Messages the peer's queue pair has received whole (their last frame's SEND
    /// completed), counted from the first [`MsgChannel::send`]; RC completes sends in order,
    /// so these are the oldest messages sent.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// (data and credit frames sent, credit-only frames among them).
    pub fn frames_sent(&self) -> (u64, u64) {
        (self.sent_frames, self.credit_frames)
    }

    fn check(&self) -> Result<(), ChannelError> {
        match &self.failed {
            Some(e) => Err(ChannelError::Failed(e.clone())),
            None => Ok(()),
        }
    }

    /// Take one completion of this QP. Returns false for completions that are not the
    /// channel's (RDMA WRITE/READ of the same QP), which the caller handles itself.
    ///
    /// # Errors
    /// A failed SEND/RECV (the channel is then dead), a malformed frame, or a posting error.
    pub fn handle(&mut self, c: &Completion) -> Result<bool, ChannelError> {
        let slots = u64::from(self.slots);
        let ours = match c.op {
            OpKind::Send => (slots..2 * slots).contains(&c.wr_id),
            OpKind::Recv => c.wr_id < slots,
            _ => false,
        };
        if !ours {
            return Ok(false);
        }
        if let Err(e) = &c.status {
            self.failed.get_or_insert_with(|| e.to_string());
            return Err(ChannelError::Failed(e.to_string()));
        }
        match c.op {
            OpKind::Send => {
                let s = (c.wr_id - u64::from(self.slots)) as u32;
                if std::mem::take(&mut self.ends[s as usize]) {
                    self.delivered += 1;
                }
                self.free_send.push(s);
            }
            _ => {
                let i = c.wr_id as usize;
                let len = (c.byte_len as usize).min(self.slot);
                // one buffer for every frame (a frame's bytes leave it in the message the
                // assembler builds)
                let frame = &mut self.frame;
                frame.resize(len, 0);
                self.mr.read(i * self.slot, frame)?;
                // posted again (with the batch) before its credit can be handed back
                self.unposted.push(i as u32);
                if self.unposted.len() >= self.batch {
                    self.repost()?;
                }
                let frame = &self.frame;
                let h = Header::decode(frame).inspect_err(|e| {
                    self.failed.get_or_insert_with(|| e.to_string());
                })?;
                self.credits.arrived(h.credits.into())?;
                if !h.credit_only {
                    if let Some(msg) = self.asm.push(&h, &frame[HEADER..])? {
                        self.inbox.push_back(msg);
                    }
                }
            }
        }
        self.pump()?;
        Ok(true)
    }

    /// Post the receives of the read slots (`unposted`) again, with one call; their credits are
    /// owed to the peer from now on.
    fn repost(&mut self) -> Result<(), ChannelError> {
        let slot = self.slot;
        let wrs: SmallVec<[RecvWr<'_>; 8]> = (self.unposted.iter())
            .map(|&i| RecvWr {
                wr_id: u64::from(i),
                local: smallvec::smallvec![Sge::new(&self.mr, i as usize * slot, slot)],
            })
            .collect();
        self.qp.post_recv(&wrs)?;
        drop(wrs);
        self.credits.reposted(self.unposted.len() as u32);
        self.unposted.clear();
        Ok(())
    }

    /// Put frames on the wire while credits and send slots allow.
    fn pump(&mut self) -> Result<(), ChannelError> {
        while !self.backlog.is_empty() && self.credits.can_send_data() && !self.free_send.is_empty()
        {
            // taken out while its frame is posted (no copy of the frame's bytes), put back
            // unless this was its last frame
            let msg = std::mem::take(&mut self.backlog[0]);
            let (range, first, last) = fragments(msg.len() - self.cursor, self.slot)
                .next()
                .map(|(r, _, l)| {
                    (
                        self.cursor + r.start..self.cursor + r.end,
                        self.cursor == 0,
                        l,
                    )
                })
                .expect("one fragment at least");
            let posted = self.post_frame(first, last, false, &[&msg[range.clone()]]);
            self.cursor = range.end;
            if last {
                self.backlog.pop_front();
                self.cursor = 0;
            } else {
                self.backlog[0] = msg;
            }
            posted?;
        }
        if self.credits.should_return() && !self.free_send.is_empty() {
            self.post_frame(false, false, true, &[])?;
            self.credit_frames += 1;
        }
        Ok(())
    }

    /// Fault injection, for tests: post `frame` as it is (no header of ours, no credit or
    /// message counted), as a broken or foreign peer would. Not part of the API.
    ///
    /// # Errors
    /// No credit or send slot free ([`ChannelError::Failed`]), or a posting error.
    #[doc(hidden)]
    pub fn post_raw_frame(&mut self, frame: &[u8]) -> Result<(), ChannelError> {
        self.check()?;
        if !self.credits.can_send_data() || frame.len() > self.slot {
            return Err(ChannelError::Failed("no room for a raw frame".into()));
        }
        let Some(s) = self.free_send.pop() else {
            return Err(ChannelError::Failed("no send slot free".into()));
        };
        self.ends[s as usize] = false;
        self.credits.spend_without_returning();
        self.post_slot(s, &[frame])
    }

    fn post_frame(
        &mut self,
        first: bool,
        last: bool,
        credit_only: bool,
        payload: &[&[u8]],
    ) -> Result<(), ChannelError> {
        let s = self.free_send.pop().expect("checked by the caller");
        self.ends[s as usize] = last && !credit_only;
        let credits = self.credits.spend();
        let h = Header {
            credits,
            first,
            last,
            credit_only,
        };
        let header = h.encode();
        let mut parts: SmallVec<[&[u8]; 4]> = SmallVec::with_capacity(payload.len() + 1);
        parts.push(&header);
        parts.extend_from_slice(payload);
        self.post_slot(s, &parts)?;
        self.sent_frames += 1;
        Ok(())
    }

    /// Write `parts` back to back into send slot `s` and post them as one SEND. Inlined: it
    /// is on every notification's path, where under the lab's emulation a call to code not
    /// run a moment ago costs more than its instructions (README, "Where a notification's
    /// round trip goes").
    #[inline(always)]
    fn post_slot(&mut self, s: u32, parts: &[&[u8]]) -> Result<(), ChannelError> {
        let off = (self.slots + s) as usize * self.slot;
        // one range check and one lock for the whole frame (a lock per part was three a
        // notification, each ~27 ns in the lab)
        let len = self.mr.write_parts(off, parts)?;
        let mut wr = SendWr::send(u64::from(self.slots + s), Sge::new(&self.mr, off, len));
        if len <= self.qp.max_inline() as usize {
            // small frames ride in the work request (no fetch from memory by the device)
            wr = wr.inlined();
        }
        self.qp.post_send(&[wr])?;
        Ok(())
    }
}
