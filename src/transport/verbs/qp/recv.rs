//! Posting receive requests on a queue pair.

use super::*;

impl Qp {
    /// Post a list of receive requests with one `ibv_post_recv`; validated like
    /// [`Qp::post_send`] (every buffer must be locally writable).
    ///
    /// # Errors
    /// [`Error::InvalidWr`], [`Error::QueueFull`], [`Error::QpInError`], [`Error::QpState`],
    /// [`Error::Post`].
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), Error> {
        self.check_posting(QpState::Init)?;
        for (i, wr) in wrs.iter().enumerate() {
            let fail = |reason: String| {
                Err(Error::InvalidWr {
                    op: OpKind::Recv,
                    index: i,
                    wr_id: wr.wr_id,
                    reason,
                })
            };
            let max = (self.inner.opts.max_recv_sge, "max_recv_sge");
            if let Some(r) = self.check_local(&wr.local, max, true) {
                return fail(r);
            }
        }
        let mut q = self.inner.shared.queue(true);
        if q.outstanding() + wrs.len() > q.depth {
            return Err(Error::QueueFull {
                queue: "receive",
                qpn: self.inner.qpn,
                outstanding: q.outstanding(),
                posting: wrs.len(),
                depth: q.depth,
            });
        }
        let nsge: usize = wrs.iter().map(|w| w.local.len()).sum();
        let mut sges: SmallVec<[ffi::ibv_sge; INLINE_RECVS]> = SmallVec::with_capacity(nsge);
        let mut raw: SmallVec<[ffi::ibv_recv_wr; INLINE_RECVS]> =
            SmallVec::with_capacity(wrs.len());
        // Pending before it is posted (the queue stays locked until the post returns, so no
        // completion can look for it earlier); what the device did not take is given back.
        let mark = q.mark();
        for wr in wrs {
            let (seq, _) = q.next(true);
            let mut refs = SmallVec::with_capacity(wr.local.len());
            for s in &wr.local {
                sges.push(ffi::ibv_sge {
                    addr: s.mr.addr() + s.offset as u64,
                    length: s.len as u32,
                    lkey: s.mr.lkey(),
                });
                refs.push(MrRef::new(s.mr.inner()));
            }
            raw.push(ffi::ibv_recv_wr {
                wr_id: seq | RECV_BIT,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: wr.local.len() as i32,
            });
            q.push(Pending {
                seq,
                wr_id: wr.wr_id,
                op: OpKind::Recv,
                report: true,
                _refs: refs,
            });
        }
        link(&mut raw, &mut sges);
        if raw.is_empty() {
            return Ok(());
        }
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; the list and SGEs are valid for the call; every buffer lies in a
        // locally writable region kept alive by its pending entry until its completion is
        // polled (or the entry is given back below, when the device did not take it).
        let ret = unsafe { ffi::ibv_post_recv(self.inner.qp.as_ptr(), raw.as_mut_ptr(), &mut bad) };
        if ret != 0 {
            // (a failure that names no request leaves them all counted, as posted)
            let posted = bad_index(raw.as_ptr(), bad, raw.len());
            q.unwind(mark.after_receives(posted));
            return Err(Error::Post {
                verb: "ibv_post_recv",
                qpn: self.inner.qpn,
                index: posted,
                source: from_ret(ret),
            });
        }
        Ok(())
    }
}
