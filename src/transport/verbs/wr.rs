//! Work requests: what can be posted, and the bookkeeping that keeps every memory region a
//! posted request references alive until its completion has been polled.

use std::collections::VecDeque;

use smallvec::SmallVec;

use super::mr::{Mr, MrRef, RemoteRegion};
pub use super::op::OpKind;

/// A local scatter/gather element: `len` bytes at `offset` of a registered region.
#[derive(Debug, Clone, Copy)]
pub struct Sge<'a> {
    /// The region.
    pub mr: &'a Mr,
    /// Offset in the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl<'a> Sge<'a> {
    /// `len` bytes at `offset` of `mr`.
    pub fn new(mr: &'a Mr, offset: usize, len: usize) -> Self {
        Self { mr, offset, len }
    }
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy)]
pub enum SendOp {
    /// RDMA WRITE the local data to `offset` of the peer's region.
    Write {
        /// The peer's region.
        remote: RemoteRegion,
        /// Offset in it.
        offset: u64,
    },
    /// RDMA WRITE with 32-bit immediate data delivered to a posted RECV on the peer.
    WriteWithImm {
        /// The peer's region.
        remote: RemoteRegion,
        /// Offset in it.
        offset: u64,
        /// Immediate data (host order; sent in network order).
        imm: u32,
    },
    /// RDMA READ from `offset` of the peer's region into the local elements.
    Read {
        /// The peer's region.
        remote: RemoteRegion,
        /// Offset in it.
        offset: u64,
    },
    /// SEND the local data to a posted RECV on the peer.
    Send,
    /// SEND with immediate data.
    SendWithImm {
        /// Immediate data (host order).
        imm: u32,
    },
}

impl SendOp {
    /// The operation's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Self::Write { .. } => OpKind::Write,
            Self::WriteWithImm { .. } => OpKind::WriteWithImm,
            Self::Read { .. } => OpKind::Read,
            Self::Send => OpKind::Send,
            Self::SendWithImm { .. } => OpKind::SendWithImm,
        }
    }

    /// The remote region and offset of a one-sided operation.
    pub fn remote(&self) -> Option<(RemoteRegion, u64)> {
        match *self {
            Self::Write { remote, offset }
            | Self::WriteWithImm { remote, offset, .. }
            | Self::Read { remote, offset } => Some((remote, offset)),
            Self::Send | Self::SendWithImm { .. } => None,
        }
    }
}

/// The local elements of a work request: up to two on the stack (the usual request has
/// one), the heap only for longer lists, so posting a request allocates nothing.
/// `vec![..].into()` builds one from a vector.
pub type Sges<'a> = SmallVec<[Sge<'a>; 2]>;

/// A send-queue work request.
#[derive(Debug, Clone)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local data (source of WRITE/SEND, destination of READ).
    pub local: Sges<'a>,
    /// Ask for a completion. Unsignaled requests complete silently when a later signaled
    /// one completes; the layer signals one by itself now and then (not reported) so an
    /// unsignaled stream cannot fill the queue.
    pub signaled: bool,
    /// Post the bytes inline (`IBV_SEND_INLINE`): the device takes them from the work
    /// request at post time, not from memory later (SEND and WRITE up to the queue pair's
    /// [`crate::transport::verbs::Qp::max_inline`] bytes; perftest's latency tests do the
    /// same for small messages).
    pub inline: bool,
}

impl<'a> SendWr<'a> {
    /// RDMA WRITE of one local element to `offset` of `remote`, signaled.
    pub fn write(wr_id: u64, local: Sge<'a>, remote: RemoteRegion, offset: u64) -> Self {
        Self {
            wr_id,
            op: SendOp::Write { remote, offset },
            local: smallvec::smallvec![local],
            signaled: true,
            inline: false,
        }
    }

    /// RDMA READ of `offset` of `remote` into one local element, signaled.
    pub fn read(wr_id: u64, local: Sge<'a>, remote: RemoteRegion, offset: u64) -> Self {
        Self {
            wr_id,
            op: SendOp::Read { remote, offset },
            local: smallvec::smallvec![local],
            signaled: true,
            inline: false,
        }
    }

    /// SEND of one local element, signaled.
    pub fn send(wr_id: u64, local: Sge<'a>) -> Self {
        Self {
            wr_id,
            op: SendOp::Send,
            local: smallvec::smallvec![local],
            signaled: true,
            inline: false,
        }
    }

    /// The same request without a completion.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// The same request with its bytes posted inline (see [`SendWr::inline`]).
    pub fn inlined(mut self) -> Self {
        self.inline = true;
        self
    }

    /// Bytes the request moves.
    pub fn len(&self) -> u64 {
        self.local.iter().map(|s| s.len as u64).sum()
    }

    /// True when it moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A receive-queue work request.
#[derive(Debug, Clone)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Where received data lands (empty for WRITE_WITH_IMM-only receives).
    pub local: Sges<'a>,
}

/// The hardware wr_id: a per-queue sequence number, top bit set on receive queues (error
/// completions carry no valid opcode, so the queue must be known from the wr_id alone).
pub(crate) const RECV_BIT: u64 = 1 << 63;

/// One posted, not yet completed work request.
pub(crate) struct Pending {
    pub(crate) seq: u64,
    pub(crate) wr_id: u64,
    pub(crate) op: OpKind,
    /// False for requests the layer signaled on its own: their completion is not reported
    /// (unless it is an error).
    pub(crate) report: bool,
    /// Regions kept alive (and counted busy) until the completion is polled.
    pub(crate) _refs: SmallVec<[MrRef; 2]>,
}

/// The outstanding work requests of one queue, in post order (a queue completes in order).
pub(crate) struct WorkQueue {
    pub(crate) depth: usize,
    next_seq: u64,
    unsignaled_run: usize,
    pending: VecDeque<Pending>,
}

/// Where a queue stood before a request was reserved ([`WorkQueue::mark`]).
#[derive(Clone, Copy)]
pub(crate) struct Mark {
    next_seq: u64,
    unsignaled_run: usize,
}

impl Mark {
    /// Where the queue stood after `n` more receives were reserved from here (receives
    /// are all signaled: only the sequence moves).
    pub(crate) fn after_receives(self, n: usize) -> Self {
        Self {
            next_seq: self.next_seq + n as u64,
            unsignaled_run: 0,
        }
    }
}

/// What happened to a completion's sequence number.
pub(crate) enum Retired {
    /// Found: the request (and every unsignaled one before it) is retired.
    Found(Pending),
    /// Unknown sequence number (a bug, or a completion for a queue we no longer track).
    Unknown,
}

impl WorkQueue {
    pub(crate) fn new(depth: usize) -> Self {
        Self {
            depth,
            next_seq: 0,
            unsignaled_run: 0,
            pending: VecDeque::new(),
        }
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.pending.len()
    }

    /// Reserve the next sequence number; decide whether the request must be signaled
    /// (asked for, or forced so that unsignaled requests cannot fill the queue).
    pub(crate) fn next(&mut self, signaled: bool) -> (u64, bool) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let force = !signaled && self.unsignaled_run + 1 >= (self.depth / 2).max(1);
        if signaled || force {
            self.unsignaled_run = 0;
        } else {
            self.unsignaled_run += 1;
        }
        (seq, signaled || force)
    }

    pub(crate) fn push(&mut self, p: Pending) {
        self.pending.push_back(p);
    }

    /// Where the queue stands: [`WorkQueue::unwind`] returns it here.
    pub(crate) fn mark(&self) -> Mark {
        Mark {
            next_seq: self.next_seq,
            unsignaled_run: self.unsignaled_run,
        }
    }

    /// Give back every request reserved since `m` (a post that did not reach the device:
    /// they are the newest entries, and no completion names them).
    pub(crate) fn unwind(&mut self, m: Mark) {
        while self.pending.back().is_some_and(|p| p.seq >= m.next_seq) {
            self.pending.pop_back();
        }
        self.next_seq = m.next_seq;
        self.unsignaled_run = m.unsignaled_run;
    }

    /// Retire everything up to and including `seq`.
    pub(crate) fn retire(&mut self, seq: u64) -> Retired {
        while let Some(front) = self.pending.front() {
            if front.seq > seq {
                return Retired::Unknown;
            }
            let p = self.pending.pop_front().expect("front exists");
            if p.seq == seq {
                return Retired::Found(p);
            }
            // An earlier unsignaled request: completed successfully, in order.
        }
        Retired::Unknown
    }

    /// Drop every pending request (the QP is destroyed: the device no longer uses them).
    pub(crate) fn clear(&mut self) {
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(seq: u64) -> Pending {
        Pending {
            seq,
            wr_id: 100 + seq,
            op: OpKind::Write,
            report: true,
            _refs: SmallVec::new(),
        }
    }

    #[test]
    fn a_signaled_completion_retires_the_unsignaled_ones_before_it() {
        let mut q = WorkQueue::new(64);
        for s in 0..5 {
            let (seq, _) = q.next(s == 4);
            q.push(pending(seq));
        }
        match q.retire(4) {
            Retired::Found(p) => assert_eq!(p.wr_id, 104),
            Retired::Unknown => panic!("seq 4 not found"),
        }
        assert_eq!(q.outstanding(), 0);
        assert!(matches!(q.retire(4), Retired::Unknown));
    }

    /// A receive list the device refused from its third request on: the two before stay
    /// pending, the rest are given back from the list's one mark, and the numbers reused.
    #[test]
    fn a_receive_list_unwinds_from_its_one_mark() {
        let mut q = WorkQueue::new(8);
        let (s0, _) = q.next(true);
        q.push(pending(s0));
        let mark = q.mark();
        for _ in 0..4 {
            let (seq, _) = q.next(true);
            q.push(pending(seq));
        }
        q.unwind(mark.after_receives(2));
        assert_eq!(q.outstanding(), 3);
        assert_eq!(q.next(true), (3, true));
        q.unwind(mark.after_receives(0));
        assert_eq!(q.outstanding(), 1);
        assert_eq!(q.next(true), (1, true));
    }

    #[test]
    fn unknown_sequence_leaves_later_requests() {
        let mut q = WorkQueue::new(64);
        for _ in 0..3 {
            let (seq, _) = q.next(true);
            q.push(pending(seq + 10));
        }
        assert!(matches!(q.retire(5), Retired::Unknown));
        assert_eq!(q.outstanding(), 3);
    }

    /// A post the device refused from its second request on: the first stays pending, the
    /// rest are given back and their sequence numbers and signal count reused.
    #[test]
    fn unwind_gives_back_what_was_not_posted() {
        let mut q = WorkQueue::new(8);
        let (s0, _) = q.next(false);
        q.push(pending(s0));
        let mut marks = Vec::new();
        for _ in 0..3 {
            marks.push(q.mark());
            let (seq, _) = q.next(false);
            q.push(pending(seq));
        }
        q.unwind(marks[1]);
        assert_eq!(q.outstanding(), 2);
        // the next requests get the given-back numbers, with the same signal decisions as
        // when they were reserved the first time (the 4th unsignaled in a row: forced)
        assert_eq!(q.next(false), (2, false));
        q.push(pending(2));
        assert_eq!(q.next(false), (3, true));
        q.push(pending(3));
        match q.retire(3) {
            Retired::Found(p) => assert_eq!(p.wr_id, 103),
            Retired::Unknown => panic!("seq 3 not found"),
        }
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn long_unsignaled_runs_get_forced_signals() {
        let mut q = WorkQueue::new(8);
        let signals: Vec<bool> = (0..12).map(|_| q.next(false).1).collect();
        // every 4th (depth / 2) is signaled by the layer
        assert_eq!(
            signals,
            [false, false, false, true, false, false, false, true, false, false, false, true]
        );
        assert!(q.next(true).1);
    }

    #[test]
    fn op_names_are_what_operators_read() {
        assert_eq!(OpKind::Write.to_string(), "RDMA WRITE");
        assert_eq!(OpKind::Read.to_string(), "RDMA READ");
        assert_eq!(OpKind::WriteWithImm.to_string(), "RDMA WRITE_WITH_IMM");
    }
}
