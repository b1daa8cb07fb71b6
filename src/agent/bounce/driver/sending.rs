//! The sending side of the bounce's pipeline, as the [`State`]'s methods: queued pieces
//! staged and written as slots free up, what is in flight polled, jobs that fail, transfers
//! that run out of time.

use super::*;

impl State {
    /// Fill free slots of `peer` with queued pieces and WRITE them.
    pub(super) fn pump(&mut self, core: &Core, agent: &Agent, peer: &str) {
        let st = self;
        loop {
            let Some(l) = st.links.get_mut(peer) else {
                return;
            };
            let Some(ps) = &l.peer else {
                return;
            };
            if l.queue.is_empty() || l.free.is_empty() {
                return;
            }
            let (peer_region, cap, stride) = (ps.region, ps.cap, ps.stride);
            let slot = l.free.pop_front().unwrap_or_default();
            let Some(mut job) = l.queue.pop_front() else {
                return;
            };
            let out_at = u64::from(slot) * core.config.slot_size;
            let mut parts = Vec::new();
            let mut used = 0u64;
            let mut error = None;
            while used < cap {
                let Some(p) = job.pieces.front_mut() else {
                    break;
                };
                let n = p.src.len.min(cap - used);
                let copied = l
                    .out_buf
                    .with_mut((out_at + used) as usize, n as usize, |s| {
                        agent
                            .read_local(RegionId(p.src.region), p.src.offset, s)
                            .map_err(|e| MemError::Device(e.to_string()))
                    })
                    .map_err(|e| e.to_string());
                if let Err(e) = copied {
                    error = Some(e);
                    break;
                }
                agent.count_payload_copy(n);
                parts.push(Part {
                    region: p.dst.region,
                    offset: p.dst.offset,
                    len: n,
                });
                used += n;
                p.src.offset += n;
                p.src.len -= n;
                p.dst.offset += n;
                p.dst.len -= n;
                if p.src.len == 0 {
                    job.pieces.pop_front();
                }
            }
            if let Some(e) = error {
                l.free.push_front(slot);
                let why = format!("copying out of local memory: {e}");
                st.job_failed(agent, peer, job.tag, XferError::Memory(why));
                continue;
            }
            job.sent += 1;
            let last = job.pieces.is_empty();
            let chunk = Wire::Chunk {
                tag: job.tag,
                slot,
                parts,
                total: last.then_some(job.sent),
                notif: if last { job.notif.take() } else { None },
            };
            let (out_stage, tag) = (l.out_stage, job.tag);
            if !last {
                l.queue.push_front(job);
            }
            if !tag.read {
                if let Some(x) = ours_mut(st, tag) {
                    x.sent += 1;
                    x.packed = last;
                }
            }
            if used == 0 {
                // nothing to move (an empty transfer): the chunk message alone
                send(agent, peer, &chunk);
                continue;
            }
            let posted = agent
                .create_xfer(
                    XferOp::Write,
                    vec![Desc::new(out_stage, out_at, used)],
                    peer,
                    vec![Desc::new(peer_region, u64::from(slot) * stride, used)],
                    Some(chunk.encode()),
                )
                .and_then(|axid| agent.post(axid).map(|()| axid));
            match posted {
                Ok(axid) => {
                    st.inflight.push(Inflight {
                        axid,
                        peer: peer.to_owned(),
                        tag,
                        slot,
                    });
                    st.stats.chunks_sent += 1;
                    st.stats.bytes_sent += used;
                    st.stats.max_in_flight = st.stats.max_in_flight.max(st.inflight.len());
                }
                Err(e) => {
                    if let Some(l) = st.links.get_mut(peer) {
                        l.free.push_front(slot);
                    }
                    let why = XferError::Post(format!("posting a chunk: {e}"));
                    st.job_failed(agent, peer, tag, why);
                }
            }
        }
    }

    /// Sending under `tag` failed: drop what is queued, fail the transfer (ours) or tell the
    /// initiator (a READ we serve).
    pub(super) fn job_failed(&mut self, agent: &Agent, peer: &str, tag: Tag, why: XferError) {
        let st = self;
        if let Some(l) = st.links.get_mut(peer) {
            l.queue.retain(|j| j.tag != tag);
        }
        if tag.read {
            let error = why.to_string();
            let (xid, gen) = (tag.xid, tag.gen);
            send(agent, peer, &Wire::ReadFail { xid, gen, error });
        } else {
            fail(agent, st, tag, why);
        }
    }

    pub(super) fn poll_inflight(&mut self, _core: &Core, agent: &Agent) {
        let st = self;
        let mut i = 0;
        while i < st.inflight.len() {
            let f = &st.inflight[i];
            match agent.status(f.axid) {
                Ok(XferStatus::InProgress) => i += 1,
                Ok(XferStatus::Done) => {
                    let _ = agent.release(f.axid);
                    st.inflight.swap_remove(i);
                }
                other => {
                    let f = st.inflight.swap_remove(i);
                    let _ = agent.release(f.axid);
                    if let Some(l) = st.links.get_mut(&f.peer) {
                        l.free.push_back(f.slot);
                    }
                    let why = match other {
                        Ok(XferStatus::Error(e)) => e.to_string(),
                        Ok(s) => format!("chunk transfer ended {s:?}"),
                        Err(e) => e.to_string(),
                    };
                    let why = format!("RDMA of a chunk failed: {why}");
                    st.job_failed(agent, &f.peer, f.tag, XferError::Rdma(why));
                }
            }
        }
    }

    pub(super) fn expire(&mut self, core: &Core, agent: &Agent) {
        let st = self;
        st.forget_released(core);
        let limit = core.config.ack_timeout;
        let late: Vec<(u64, String)> = st
            .xfers
            .iter()
            .filter(|(_, x)| x.active && x.last_progress.elapsed() > limit)
            .map(|(id, x)| (*id, x.peer.clone()))
            .collect();
        for (id, peer) in late {
            if let Some(x) = st.xfers.get_mut(&id) {
                x.active = false;
            }
            agent.finish_xfer(
                id,
                Err(XferError::Timeout(format!(
                    "no progress from {peer} for {limit:?} (peer gone or stalled)"
                ))),
            );
        }
        // the agent may have ended an active transfer itself (peer lost): stop polling for it
        for (id, x) in st.xfers.iter_mut().filter(|(_, x)| x.active) {
            if !matches!(agent.status(XferId(*id)), Ok(XferStatus::InProgress)) {
                x.active = false;
            }
        }
    }
}
