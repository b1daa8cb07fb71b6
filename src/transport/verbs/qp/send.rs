//! Posting send requests (WRITE, READ, SEND) on a queue pair: checked against the queue's room and the memory regions, linked, rung with one doorbell.

use super::*;

impl Qp {
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
    pub(super) fn post_one_send(
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
    pub(super) fn reserve_send(
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
    pub(super) fn ring_send(
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

    pub(super) fn validate_send(&self, i: usize, wr: &SendWr<'_>) -> Result<(), Error> {
        let op = wr.op.kind();
        let fail = |reason: String| {
            Err(Error::InvalidWr {
                op,
                index: i,
                wr_id: wr.wr_id,
                reason,
            })
        };
        let max = (self.inner.opts.max_send_sge, "max_send_sge");
        if let Some(r) = self.check_local(&wr.local, max, op == OpKind::Read) {
            return fail(r);
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

    /// The checks of a work request's local SGEs, sends and receives alike: no more than the
    /// queue pair takes (`max`: its limit and the limit's name), each inside its memory region
    /// with the access the operation needs. Why not, or None.
    pub(super) fn check_local(
        &self,
        local: &[super::super::wr::Sge<'_>],
        (max, what): (u32, &str),
        needs_write: bool,
    ) -> Option<String> {
        if local.len() > max as usize {
            return Some(format!("{} SGEs > {what} {max}", local.len()));
        }
        (local.iter().enumerate()).find_map(|(k, s)| {
            Some(format!(
                "local element {k}: {}",
                self.check_sge(s, needs_write)?
            ))
        })
    }

    /// Why a local element is unusable, or None.
    pub(super) fn check_sge(
        &self,
        s: &super::super::wr::Sge<'_>,
        needs_write: bool,
    ) -> Option<String> {
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
}
