//! The bounce driver: link state, the send pump (device → slot → RDMA), the receive path
//! (slot → device → acknowledgement), and the thread that reacts to notifications and
//! chunk completions.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, Decoded, Part, Piece, Tag, Wire};
use super::{part, DevDesc, Shared};
use crate::agent::{AgentError, Desc, RegionId, RemoteAccess, XferId, XferOp, XferStatus};
use crate::mem::{DeviceMemory, HostBuffer, MemError};

/// The peer's staging region we write into.
pub(crate) struct PeerStage {
    region: RegionId,
    /// Distance between its slots (its slot size).
    stride: u64,
    /// Largest chunk: the smaller slot size of the two sides.
    cap: u64,
}

/// One linked peer.
pub(crate) struct Link {
    out_stage: RegionId,
    out_buf: Arc<HostBuffer>,
    in_stage: RegionId,
    in_buf: Arc<HostBuffer>,
    pub(crate) peer: Option<PeerStage>,
    /// The peer's device regions: id → size.
    pub(crate) peer_regions: HashMap<u32, u64>,
    /// Slots of the peer's staging region we may write now.
    free: VecDeque<u32>,
    /// Work waiting for a slot, in order.
    pub(crate) queue: VecDeque<Job>,
}

/// Pieces to send under one tag.
pub(crate) struct Job {
    pub(crate) tag: Tag,
    pub(crate) pieces: VecDeque<Piece>,
    pub(crate) notif: Option<Vec<u8>>,
    /// Chunks sent so far.
    pub(crate) sent: u32,
}

/// A transfer created here.
pub(crate) struct Xfer {
    pub(crate) op: XferOp,
    pub(crate) peer: String,
    local: Vec<DevDesc>,
    remote: Vec<DevDesc>,
    pub(crate) notif: Option<Vec<u8>>,
    pub(crate) status: XferStatus,
    /// Which post this is (see [`Tag::gen`]).
    pub(crate) gen: u32,
    /// WRITE: chunks sent / acknowledged; all packed.
    sent: u32,
    acked: u32,
    packed: bool,
    last_progress: Instant,
}

impl Xfer {
    pub(crate) fn new(
        op: XferOp,
        peer: &str,
        local: Vec<DevDesc>,
        remote: Vec<DevDesc>,
        notif: Option<Vec<u8>>,
    ) -> Self {
        Self {
            op,
            peer: peer.into(),
            local,
            remote,
            notif,
            status: XferStatus::NotPosted,
            gen: 0,
            sent: 0,
            acked: 0,
            packed: false,
            last_progress: Instant::now(),
        }
    }

    pub(crate) fn reset(&mut self) {
        self.status = XferStatus::InProgress;
        self.gen = self.gen.wrapping_add(1);
        (self.sent, self.acked, self.packed) = (0, 0, false);
        self.last_progress = Instant::now();
    }

    /// The (local → remote) pieces, zero-length ones dropped.
    pub(crate) fn pieces(&self) -> Vec<Piece> {
        self.local
            .iter()
            .zip(&self.remote)
            .filter(|(l, _)| l.len > 0)
            .map(|(l, r)| Piece {
                src: part(l),
                dst: part(r),
            })
            .collect()
    }
}

/// What the receiver has of one incoming transfer.
#[derive(Default)]
struct Recv {
    done: u32,
    total: Option<u32>,
    notif: Option<Vec<u8>>,
    error: Option<String>,
}

/// A chunk's RDMA WRITE in the agent.
struct Inflight {
    axid: XferId,
    peer: String,
    tag: Tag,
    slot: u32,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) devices: HashMap<u32, Arc<dyn DeviceMemory>>,
    pub(crate) next_dev: u32,
    pub(crate) links: HashMap<String, Link>,
    pub(crate) xfers: HashMap<u64, Xfer>,
    pub(crate) next_xid: u64,
    recvs: HashMap<(String, Tag), Recv>,
    inflight: Vec<Inflight>,
    pub(crate) user_notifs: VecDeque<(String, Vec<u8>)>,
    pub(crate) stats: super::BounceStats,
}

pub(crate) fn send(sh: &Shared, peer: &str, w: &Wire) {
    if let Err(e) = sh.agent.send_notif(peer, w.encode()) {
        tracing::warn!(%peer, "host bounce: sending {w:?} failed: {e}");
    }
}

/// Our Hello for `peer`'s link.
pub(crate) fn hello(sh: &Shared, st: &State, peer: &str, reply: bool) -> Wire {
    let mut regions: Vec<(u32, u64)> = st.devices.iter().map(|(i, m)| (*i, m.size())).collect();
    regions.sort_unstable();
    Wire::Hello {
        addr: sh.agent.side_channel_addr().to_string(),
        in_stage: st.links.get(peer).map_or(u32::MAX, |l| l.in_stage.0),
        slots: sh.config.slots,
        slot_size: sh.config.slot_size,
        regions,
        reply,
    }
}

/// Register `peer`'s staging regions unless they exist.
pub(crate) fn ensure_link(sh: &Shared, st: &mut State, peer: &str) -> Result<(), AgentError> {
    if st.links.contains_key(peer) {
        return Ok(());
    }
    let len = usize::try_from(sh.config.slots as u64 * sh.config.slot_size)
        .map_err(|_| AgentError::Unsupported("staging size overflows".into()))?;
    let out_stage = sh.agent.register(len, RemoteAccess::NONE, vec![])?;
    let in_stage = sh.agent.register(len, RemoteAccess::WRITE, vec![])?;
    st.links.insert(
        peer.to_owned(),
        Link {
            out_buf: sh.agent.region_buffer(out_stage)?,
            in_buf: sh.agent.region_buffer(in_stage)?,
            out_stage,
            in_stage,
            peer: None,
            peer_regions: HashMap::new(),
            free: VecDeque::new(),
            queue: VecDeque::new(),
        },
    );
    Ok(())
}

/// The driver thread: notifications in, chunk completions polled, timeouts.
pub(crate) fn run(sh: &Arc<Shared>) {
    while !sh.stop.load(Ordering::Acquire) {
        let busy = {
            let st = sh.lock();
            !st.inflight.is_empty()
                || st
                    .xfers
                    .values()
                    .any(|x| x.status == XferStatus::InProgress)
        };
        let wait = if busy {
            Duration::from_micros(200)
        } else {
            Duration::from_millis(20)
        };
        let msgs = sh.agent.wait_notifs(wait);
        for (from, m) in msgs {
            match wire::decode(&m) {
                Decoded::Theirs => sh.lock().user_notifs.push_back((from, m)),
                Decoded::Malformed(e) => {
                    sh.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = %from, "host bounce: malformed message dropped: {e}");
                }
                Decoded::Ours(w) => handle(sh, &from, w),
            }
        }
        let mut st = sh.lock();
        poll_inflight(sh, &mut st);
        expire(sh, &mut st);
        let peers: Vec<String> = st.links.keys().cloned().collect();
        for p in peers {
            pump(sh, &mut st, &p);
        }
        drop(st);
        sh.cv.notify_all();
    }
}

fn handle(sh: &Shared, from: &str, w: Wire) {
    if let Wire::Hello {
        addr,
        in_stage,
        slots,
        slot_size,
        regions,
        reply,
    } = w
    {
        if slots == 0 || slot_size == 0 {
            tracing::warn!(peer = %from, "host bounce: Hello with no staging slots ignored");
            return;
        }
        let need_load = sh.lock().links.get(from).is_none_or(|l| l.peer.is_none());
        if need_load {
            // (re)load the peer's metadata, which now holds the staging region it made for us
            let loaded = addr
                .parse()
                .map_err(|_| format!("bad address {addr:?}"))
                .and_then(|a| sh.agent.load_remote(a).map_err(|e| e.to_string()));
            if let Err(e) = loaded {
                tracing::warn!(peer = %from, "host bounce: cannot link back: {e}");
                return;
            }
        }
        let mut st = sh.lock();
        if let Err(e) = ensure_link(sh, &mut st, from) {
            tracing::warn!(peer = %from, "host bounce: staging buffers: {e}");
            return;
        }
        let slots = slots.min(sh.config.slots);
        let Some(l) = st.links.get_mut(from) else {
            return;
        };
        l.peer_regions = regions.into_iter().collect();
        if l.peer.is_none() {
            l.peer = Some(PeerStage {
                region: RegionId(in_stage),
                stride: slot_size,
                cap: slot_size.min(sh.config.slot_size),
            });
            l.free = (0..slots).collect();
        }
        if reply {
            let h = hello(sh, &st, from, false);
            send(sh, from, &h);
        }
        drop(st);
        sh.cv.notify_all();
        return;
    }
    let mut st = sh.lock();
    match w {
        Wire::Hello { .. } => {}
        Wire::Chunk {
            tag,
            slot,
            parts,
            total,
            notif,
        } => receive(sh, &mut st, from, tag, slot, &parts, total, notif),
        Wire::Ack { tag, slot, error } => {
            if let Some(l) = st.links.get_mut(from) {
                // a slot we never lent (or one already free) is not taken back twice
                if slot < sh.config.slots && !l.free.contains(&slot) {
                    l.free.push_back(slot);
                }
            }
            if !tag.read {
                if let Some(x) = ours_mut(&mut st, tag) {
                    if x.status == XferStatus::InProgress {
                        x.acked += 1;
                        x.last_progress = Instant::now();
                        if let Some(e) = error {
                            fail(
                                &mut st,
                                tag,
                                &format!("{from} could not place a chunk: {e}"),
                            );
                        } else if x.packed && x.acked == x.sent {
                            x.status = XferStatus::Done;
                        }
                    }
                }
            }
            pump(sh, &mut st, from);
        }
        Wire::ReadReq { xid, gen, pieces } => {
            let tag = Tag::read(xid, gen);
            let bad = pieces.iter().enumerate().find_map(|(i, p)| {
                let size = st.devices.get(&p.src.region).map(|m| m.size());
                let d = DevDesc::new(super::DevRegionId(p.src.region), p.src.offset, p.src.len);
                super::check_desc("remote", i, &d, size).err()
            });
            if let Some(e) = bad {
                send(
                    sh,
                    from,
                    &Wire::ReadFail {
                        xid,
                        gen,
                        error: e.to_string(),
                    },
                );
            } else if let Some(l) = st.links.get_mut(from) {
                l.queue.push_back(Job {
                    tag,
                    pieces: pieces.into_iter().filter(|p| p.src.len > 0).collect(),
                    notif: None,
                    sent: 0,
                });
                pump(sh, &mut st, from);
            }
        }
        Wire::ReadFail { xid, gen, error } => {
            let tag = Tag::read(xid, gen);
            st.recvs.remove(&(from.to_owned(), tag));
            fail(&mut st, tag, &format!("{from} could not send: {error}"));
        }
        Wire::ReadDone { notif, .. } => {
            if let Some(n) = notif {
                st.user_notifs.push_back((from.to_owned(), n));
            }
        }
    }
}

/// The local transfer `tag` names, if it is ours and this very post of it.
fn ours_mut(st: &mut State, tag: Tag) -> Option<&mut Xfer> {
    st.xfers
        .get_mut(&tag.xid)
        .filter(|x| x.gen == tag.gen && (x.op == XferOp::Read) == tag.read)
}

/// Fail the local transfer behind `tag` (if it is ours and in progress).
fn fail(st: &mut State, tag: Tag, why: &str) {
    if let Some(x) = ours_mut(st, tag) {
        if x.status == XferStatus::InProgress {
            x.status = XferStatus::Error(why.to_owned());
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn receive(
    sh: &Shared,
    st: &mut State,
    from: &str,
    tag: Tag,
    slot: u32,
    parts: &[Part],
    total: Option<u32>,
    notif: Option<Vec<u8>>,
) {
    if tag.read && ours_mut(st, tag).is_none_or(|x| x.status != XferStatus::InProgress) {
        // a chunk of a READ that is over (failed, released, or reposted): not placed
        send(
            sh,
            from,
            &Wire::Ack {
                tag,
                slot,
                error: None,
            },
        );
        return;
    }
    let Some(l) = st.links.get(from) else {
        return;
    };
    let base = u64::from(slot) * sh.config.slot_size;
    let mut error = None;
    let mut at = base;
    let end = base + sh.config.slot_size;
    for p in parts {
        let placed = match st.devices.get(&p.region) {
            _ if slot >= sh.config.slots || p.len > end - at => {
                Err(format!("chunk parts overrun slot {slot}"))
            }
            None => Err(format!("no device region {}", p.region)),
            Some(dev) => {
                let len = usize::try_from(p.len).unwrap_or(usize::MAX);
                l.in_buf
                    .with_mut(at as usize, len, |s| dev.copy_from_host(p.offset, s))
                    .map_err(|e: MemError| e.to_string())
            }
        };
        if let Err(e) = placed {
            error = Some(e);
            break;
        }
        at += p.len;
    }
    st.stats.chunks_received += 1;
    send(
        sh,
        from,
        &Wire::Ack {
            tag,
            slot,
            error: error.clone(),
        },
    );
    if tag.read {
        if let Some(x) = ours_mut(st, tag) {
            x.last_progress = Instant::now();
        }
    }
    let key = (from.to_owned(), tag);
    let r = st.recvs.entry(key.clone()).or_default();
    r.done += 1;
    r.total = r.total.or(total);
    r.notif = r.notif.take().or(notif);
    r.error = r.error.take().or(error);
    if r.total != Some(r.done) {
        return;
    }
    let Some(r) = st.recvs.remove(&key) else {
        return;
    };
    if !tag.read {
        // a WRITE into us is complete: the engine's notification, after every byte
        if r.error.is_none() {
            if let Some(n) = r.notif {
                st.user_notifs.push_back((from.to_owned(), n));
            }
        }
        return;
    }
    let Some(x) = ours_mut(st, tag) else {
        return;
    };
    if x.status != XferStatus::InProgress {
        return;
    }
    match r.error {
        Some(e) => x.status = XferStatus::Error(format!("placing a chunk from {from}: {e}")),
        None => {
            x.status = XferStatus::Done;
            if let Some(n) = x.notif.clone() {
                send(
                    sh,
                    from,
                    &Wire::ReadDone {
                        xid: tag.xid,
                        notif: Some(n),
                    },
                );
            }
        }
    }
}

/// Fill free slots of `peer` with queued pieces and WRITE them.
pub(crate) fn pump(sh: &Shared, st: &mut State, peer: &str) {
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
        let out_at = u64::from(slot) * sh.config.slot_size;
        let mut parts = Vec::new();
        let mut used = 0u64;
        let mut error = None;
        while used < cap {
            let Some(p) = job.pieces.front_mut() else {
                break;
            };
            let n = p.src.len.min(cap - used);
            let copied = match st.devices.get(&p.src.region) {
                None => Err(format!("no device region {}", p.src.region)),
                Some(dev) => l
                    .out_buf
                    .with_mut((out_at + used) as usize, n as usize, |s| {
                        dev.copy_to_host(p.src.offset, s)
                    })
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = copied {
                error = Some(e);
                break;
            }
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
            job_failed(
                sh,
                st,
                peer,
                job.tag,
                &format!("copying from device memory: {e}"),
            );
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
            send(sh, peer, &chunk);
            continue;
        }
        let posted = sh
            .agent
            .create_xfer(
                XferOp::Write,
                vec![Desc::new(out_stage, out_at, used)],
                peer,
                vec![Desc::new(peer_region, u64::from(slot) * stride, used)],
                Some(chunk.encode()),
            )
            .and_then(|axid| sh.agent.post(axid).map(|()| axid));
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
                job_failed(sh, st, peer, tag, &format!("posting a chunk: {e}"));
            }
        }
    }
}

/// Sending under `tag` failed: drop what is queued, fail the transfer (ours) or tell the
/// initiator (a READ we serve).
fn job_failed(sh: &Shared, st: &mut State, peer: &str, tag: Tag, why: &str) {
    if let Some(l) = st.links.get_mut(peer) {
        l.queue.retain(|j| j.tag != tag);
    }
    if tag.read {
        send(
            sh,
            peer,
            &Wire::ReadFail {
                xid: tag.xid,
                gen: tag.gen,
                error: why.to_owned(),
            },
        );
    } else {
        fail(st, tag, why);
    }
}

fn poll_inflight(sh: &Shared, st: &mut State) {
    let mut i = 0;
    while i < st.inflight.len() {
        let f = &st.inflight[i];
        match sh.agent.status(f.axid) {
            Ok(XferStatus::InProgress) => i += 1,
            Ok(XferStatus::Done) => {
                let _ = sh.agent.release(f.axid);
                st.inflight.swap_remove(i);
            }
            other => {
                let f = st.inflight.swap_remove(i);
                let _ = sh.agent.release(f.axid);
                if let Some(l) = st.links.get_mut(&f.peer) {
                    l.free.push_back(f.slot);
                }
                let why = match other {
                    Ok(XferStatus::Error(e)) => e,
                    Ok(s) => format!("chunk transfer ended {s:?}"),
                    Err(e) => e.to_string(),
                };
                job_failed(
                    sh,
                    st,
                    &f.peer,
                    f.tag,
                    &format!("RDMA of a chunk failed: {why}"),
                );
            }
        }
    }
}

fn expire(sh: &Shared, st: &mut State) {
    let limit = sh.config.ack_timeout;
    for x in st.xfers.values_mut() {
        if x.status == XferStatus::InProgress && x.last_progress.elapsed() > limit {
            x.status = XferStatus::Error(format!(
                "no progress from {} for {limit:?} (peer gone or stalled)",
                x.peer
            ));
        }
    }
}
