//! The bounce driver: link state, the send pump (region → slot → RDMA), the receive path
//! (slot → region → acknowledgement), and the thread that reacts to bounce messages and
//! chunk completions. Lock order: the engine's state, then the agent's maps (the agent never
//! calls in here with its maps held).

mod sending;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, Decoded, Part, Piece, Tag, Wire};
use super::Core;
use crate::agent::{
    error::AgentError, error::XferError, region::RegionId, region::RemoteAccess, xfer::Desc,
    xfer::XferId, xfer::XferOp, xfer::XferStatus, Agent,
};
use crate::mem::{HostBuffer, MemError};

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
    peer: Option<PeerStage>,
    /// When our Hello asking for the peer's went out (resent after a second unanswered).
    hello_sent: Option<Instant>,
    /// Slots of the peer's staging region we may write now.
    free: VecDeque<u32>,
    /// Work waiting for a slot, in order.
    queue: VecDeque<Job>,
    /// READ requests waiting for the link (sent once the peer's Hello arrived).
    reads: Vec<Wire>,
}

/// Pieces to send under one tag.
struct Job {
    tag: Tag,
    pieces: VecDeque<Piece>,
    notif: Option<Vec<u8>>,
    /// Chunks sent so far.
    sent: u32,
}

/// An agent transfer this engine moves.
struct Xfer {
    op: XferOp,
    peer: String,
    notif: Option<Vec<u8>>,
    active: bool,
    /// Which post this is (see [`Tag::gen`]).
    gen: u32,
    /// WRITE: chunks sent / acknowledged; all packed.
    sent: u32,
    acked: u32,
    packed: bool,
    last_progress: Instant,
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
    pub(crate) links: HashMap<String, Link>,
    xfers: HashMap<u64, Xfer>,
    recvs: HashMap<(String, Tag), Recv>,
    inflight: Vec<Inflight>,
    pub(crate) stats: super::BounceStats,
}

fn send(agent: &Agent, peer: &str, w: &Wire) {
    if let Err(e) = agent.send_notif(peer, w.encode()) {
        tracing::warn!(%peer, message = ?w, error = %e, "host bounce: sending failed");
    }
}

/// Our Hello for `peer`'s link.
fn hello(core: &Core, agent: &Agent, st: &State, peer: &str, reply: bool) -> Wire {
    Wire::Hello {
        addr: agent.side_channel_addr().to_string(),
        in_stage: st.links.get(peer).map_or(u32::MAX, |l| l.in_stage.0),
        slots: core.config.slots,
        slot_size: core.config.slot_size,
        reply,
    }
}

/// Register `peer`'s staging regions unless they exist.
fn ensure_link(core: &Core, agent: &Agent, st: &mut State, peer: &str) -> Result<(), AgentError> {
    if st.links.contains_key(peer) {
        return Ok(());
    }
    let len = usize::try_from(u64::from(core.config.slots) * core.config.slot_size)
        .map_err(|_| AgentError::Unsupported("bounce: staging size overflows".into()))?;
    let out_stage = agent.register(len, RemoteAccess::NONE, vec![])?;
    let in_stage = agent.register(len, RemoteAccess::WRITE, vec![])?;
    st.links.insert(
        peer.to_owned(),
        Link {
            out_buf: agent.region_buffer(out_stage)?,
            in_buf: agent.region_buffer(in_stage)?,
            out_stage,
            in_stage,
            peer: None,
            hello_sent: None,
            free: VecDeque::new(),
            queue: VecDeque::new(),
            reads: Vec::new(),
        },
    );
    Ok(())
}

/// Ask `peer` for its staging region (again, when the last ask went unanswered for 1 s).
fn greet(core: &Core, agent: &Agent, st: &mut State, peer: &str) {
    let due = st.links.get(peer).is_some_and(|l| {
        l.peer.is_none()
            && l.hello_sent
                .is_none_or(|t| t.elapsed() > Duration::from_secs(1))
    });
    if due {
        let h = hello(core, agent, st, peer, true);
        if let Some(l) = st.links.get_mut(peer) {
            l.hello_sent = Some(Instant::now());
        }
        send(agent, peer, &h);
    }
}

/// Start agent transfer `id`.
pub(crate) fn post(core: &Core, agent: &Agent, req: super::Post) -> Result<(), AgentError> {
    let super::Post {
        id,
        op,
        peer,
        pieces,
        notif,
    } = req;
    let peer = peer.as_str();
    let mut st = core.lock();
    ensure_link(core, agent, &mut st, peer)?;
    let x = st.xfers.entry(id).or_insert_with(|| {
        core.tracked.fetch_add(1, Ordering::AcqRel);
        Xfer {
            op,
            peer: peer.to_owned(),
            notif: None,
            active: false,
            gen: 0,
            sent: 0,
            acked: 0,
            packed: false,
            last_progress: Instant::now(),
        }
    });
    x.gen = x.gen.wrapping_add(1);
    (x.active, x.sent, x.acked, x.packed) = (true, 0, 0, false);
    x.last_progress = Instant::now();
    x.notif = notif.clone();
    let gen = x.gen;
    let pieces: Vec<Piece> = pieces.into_iter().filter(|p| p.src.len > 0).collect();
    let Some(l) = st.links.get_mut(peer) else {
        return Ok(());
    };
    match op {
        XferOp::Write => l.queue.push_back(Job {
            tag: Tag {
                xid: id,
                read: false,
                gen,
            },
            pieces: pieces.into(),
            notif,
            sent: 0,
        }),
        XferOp::Read => {
            // the peer sends src (its memory) → dst (ours): swap the roles
            let pieces = pieces
                .into_iter()
                .map(|p| Piece {
                    src: p.dst,
                    dst: p.src,
                })
                .collect();
            let req = Wire::ReadReq {
                xid: id,
                gen,
                pieces,
            };
            if l.peer.is_some() {
                send(agent, peer, &req);
            } else {
                l.reads.push(req);
            }
        }
    }
    greet(core, agent, &mut st, peer);
    st.pump(core, agent, peer);
    Ok(())
}

/// The driver thread: bounce messages in, chunk completions polled, timeouts. It holds the
/// agent only while it works, and ends when the agent is gone.
pub(crate) fn run(core: &Arc<Core>) {
    loop {
        let busy = {
            let st = core.lock();
            !st.inflight.is_empty() || st.xfers.values().any(|x| x.active)
        };
        let msgs: Vec<(String, Vec<u8>)> = {
            let mut q = core.inbox.lock().unwrap_or_else(|p| p.into_inner());
            if q.is_empty() && !core.stop.load(Ordering::Acquire) {
                let wait = if busy {
                    Duration::from_micros(200)
                } else {
                    Duration::from_secs(1)
                };
                q = core
                    .wake
                    .wait_timeout(q, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            q.drain(..).collect()
        };
        if core.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(agent) = core.agent.upgrade() else {
            return;
        };
        for (from, m) in msgs {
            match wire::decode(&m) {
                Decoded::Theirs => {}
                Decoded::Malformed(e) => {
                    core.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = %from, error = %e, "host bounce: malformed message dropped");
                }
                Decoded::Ours(w) => handle(core, &agent, &from, w),
            }
        }
        let mut st = core.lock();
        st.poll_inflight(core, &agent);
        st.expire(core, &agent);
        let peers: Vec<String> = st.links.keys().cloned().collect();
        for p in peers {
            greet(core, &agent, &mut st, &p);
            st.pump(core, &agent, &p);
        }
    }
}

fn handle(core: &Core, agent: &Agent, from: &str, w: Wire) {
    if let Wire::Hello {
        addr,
        in_stage,
        slots,
        slot_size,
        reply,
    } = w
    {
        return hello_from(core, agent, from, (addr, in_stage, slots, slot_size), reply);
    }
    let mut st = core.lock();
    match w {
        Wire::Hello { .. } => {}
        Wire::Chunk {
            tag,
            slot,
            parts,
            total,
            notif,
        } => receive(
            core,
            agent,
            &mut st,
            from,
            (tag, slot),
            &parts,
            total,
            notif,
        ),
        Wire::Ack { tag, slot, error } => {
            if let Some(l) = st.links.get_mut(from) {
                // a slot we never lent (or one already free) is not taken back twice
                if slot < core.config.slots && !l.free.contains(&slot) {
                    l.free.push_back(slot);
                }
            }
            if !tag.read {
                if let Some(x) = ours_mut(&mut st, tag) {
                    x.acked += 1;
                    x.last_progress = Instant::now();
                    if let Some(e) = error {
                        let e = peer_failed(from, format!("could not place a chunk: {e}"));
                        fail(agent, &mut st, tag, e);
                    } else if x.packed && x.acked == x.sent {
                        finish(agent, &mut st, tag, Ok(()));
                    }
                }
            }
            st.pump(core, agent, from);
        }
        Wire::ReadReq { xid, gen, pieces } => {
            let tag = Tag::read(xid, gen);
            let bad = pieces.iter().enumerate().find_map(|(i, p)| {
                match agent.local_region(RegionId(p.src.region)) {
                    Some((_, access)) if !access.read => Some(format!(
                        "piece #{i}: region {} does not allow remote READ",
                        p.src.region
                    )),
                    Some((len, _))
                        if p.src.offset.checked_add(p.src.len).is_none_or(|e| e > len) =>
                    {
                        Some(format!(
                            "piece #{i}: [{}, +{}) is outside region {} ({len} bytes)",
                            p.src.offset, p.src.len, p.src.region
                        ))
                    }
                    Some(_) => None,
                    None => Some(format!("piece #{i}: no region {}", p.src.region)),
                }
            });
            if let Some(error) = bad {
                send(agent, from, &Wire::ReadFail { xid, gen, error });
            } else if let Err(e) = ensure_link(core, agent, &mut st, from) {
                let error = format!("staging buffers: {e}");
                send(agent, from, &Wire::ReadFail { xid, gen, error });
            } else if let Some(l) = st.links.get_mut(from) {
                l.queue.push_back(Job {
                    tag,
                    pieces: pieces.into_iter().filter(|p| p.src.len > 0).collect(),
                    notif: None,
                    sent: 0,
                });
                greet(core, agent, &mut st, from);
                st.pump(core, agent, from);
            }
        }
        Wire::ReadFail { xid, gen, error } => {
            let tag = Tag::read(xid, gen);
            st.recvs.remove(&(from.to_owned(), tag));
            let e = peer_failed(from, format!("could not send: {error}"));
            fail(agent, &mut st, tag, e);
        }
        Wire::ReadDone { notif, .. } => {
            if let Some(n) = notif {
                agent.deliver_user_notif(from, n);
            }
        }
    }
}

/// The peer's Hello: (re)load its metadata if it lacks the staging region the peer made for
/// us, take that region, answer when asked.
fn hello_from(
    core: &Core,
    agent: &Agent,
    from: &str,
    (addr, in_stage, slots, slot_size): (String, u32, u32, u64),
    reply: bool,
) {
    if slots == 0 || slot_size == 0 {
        tracing::warn!(peer = %from, "host bounce: Hello with no staging slots ignored");
        return;
    }
    // (re)load the peer's metadata only when it lacks the staging region made for us
    let known = agent
        .remote_metadata(from)
        .is_some_and(|m| m.regions.iter().any(|r| r.id == in_stage));
    if !known {
        let loaded = addr
            .parse()
            .map_err(|_| format!("bad address {addr:?}"))
            .and_then(|a| agent.load_remote(a).map_err(|e| e.to_string()));
        if let Err(e) = loaded {
            tracing::warn!(peer = %from, error = %e, "host bounce: cannot link back");
            return;
        }
    }
    let mut st = core.lock();
    if let Err(e) = ensure_link(core, agent, &mut st, from) {
        tracing::warn!(peer = %from, error = %e, "host bounce: staging buffers");
        return;
    }
    let slots = slots.min(core.config.slots);
    let Some(l) = st.links.get_mut(from) else {
        return;
    };
    let fresh = l.peer.as_ref().is_none_or(|p| p.region.0 != in_stage);
    if fresh {
        l.peer = Some(PeerStage {
            region: RegionId(in_stage),
            stride: slot_size,
            cap: slot_size.min(core.config.slot_size),
        });
        l.free = (0..slots).collect();
    }
    let reads = std::mem::take(&mut l.reads);
    if reply {
        let h = hello(core, agent, &st, from, false);
        send(agent, from, &h);
    }
    for r in &reads {
        send(agent, from, r);
    }
    st.pump(core, agent, from);
}

/// This post of the local transfer `tag` names, while it is active.
fn ours_mut(st: &mut State, tag: Tag) -> Option<&mut Xfer> {
    st.xfers
        .get_mut(&tag.xid)
        .filter(|x| x.active && x.gen == tag.gen && (x.op == XferOp::Read) == tag.read)
}

/// The local transfer behind `tag` ended: the agent learns how.
fn finish(agent: &Agent, st: &mut State, tag: Tag, res: Result<(), XferError>) {
    if let Some(x) = ours_mut(st, tag) {
        x.active = false;
        agent.finish_xfer(tag.xid, res);
    }
}

fn fail(agent: &Agent, st: &mut State, tag: Tag, e: XferError) {
    finish(agent, st, tag, Err(e));
}

/// `peer` failed its part, in its words.
fn peer_failed(peer: &str, message: String) -> XferError {
    XferError::Peer {
        peer: peer.to_owned(),
        message,
    }
}

#[allow(clippy::too_many_arguments)]
fn receive(
    core: &Core,
    agent: &Agent,
    st: &mut State,
    from: &str,
    (tag, slot): (Tag, u32),
    parts: &[Part],
    total: Option<u32>,
    notif: Option<Vec<u8>>,
) {
    let ack = |error: Option<String>| Wire::Ack { tag, slot, error };
    if tag.read && ours_mut(st, tag).is_none() {
        // a chunk of a READ that is over (failed, released, or reposted): not placed
        send(agent, from, &ack(None));
        return;
    }
    let Some(l) = st.links.get(from) else {
        return;
    };
    let base = u64::from(slot) * core.config.slot_size;
    let mut error = None;
    let mut at = base;
    let end = base + core.config.slot_size;
    for p in parts {
        let placed = if slot >= core.config.slots || p.len > end - at {
            Err(format!("chunk parts overrun slot {slot}"))
        } else {
            let len = usize::try_from(p.len).unwrap_or(usize::MAX);
            l.in_buf
                .with_mut(at as usize, len, |s| {
                    // a WRITE into us needs the region to allow it; a READ's are ours
                    agent
                        .write_local(RegionId(p.region), p.offset, s, !tag.read)
                        .map_err(|e| MemError::Device(e.to_string()))
                })
                .map_err(|e| e.to_string())
        };
        if let Err(e) = placed {
            error = Some(e);
            break;
        }
        agent.count_payload_copy(p.len);
        at += p.len;
    }
    st.stats.chunks_received += 1;
    send(agent, from, &ack(error.clone()));
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
                agent.deliver_user_notif(from, n);
            }
        }
        return;
    }
    match r.error {
        Some(e) => {
            let e = XferError::Memory(format!("placing a chunk from {from}: {e}"));
            fail(agent, st, tag, e);
        }
        None => {
            let notif = ours_mut(st, tag).and_then(|x| x.notif.clone());
            finish(agent, st, tag, Ok(()));
            if let Some(n) = notif {
                let done = Wire::ReadDone {
                    xid: tag.xid,
                    notif: Some(n),
                };
                send(agent, from, &done);
            }
        }
    }
}

impl State {
    /// Forget the transfers the agent released.
    fn forget_released(&mut self, core: &Core) {
        let ids = std::mem::take(&mut *core.released.lock().unwrap_or_else(|p| p.into_inner()));
        for id in ids {
            if self.xfers.remove(&id).is_some() {
                core.tracked.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}
