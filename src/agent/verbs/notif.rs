//! Notifications over verbs. Each attach connection (initiator → target) gets a message
//! channel ([`MsgChannel`]: SEND/RECV with credit flow control, so a burst never meets a
//! missing receive and never triggers RNR) on a queue pair of its own on the first paired
//! rail. A transfer's notification is handed to it only after every slice of the transfer
//! completed on every rail, so the bytes are in the peer's memory before the notification
//! can arrive.
//!
//! Every message carries a sequence number (8 bytes, little endian) ahead of its bytes. The
//! sender keeps each message until the channel reports it delivered. When the channel fails
//! (its rail's port left ACTIVE, retries ran out), the undelivered messages and all later
//! ones go over the TCP connection instead (`SeqNotif`), and the receiver delivers by
//! sequence number: each message once, in the order sent. Once the channel's port is ACTIVE
//! again, a new channel is opened on it (`ChanOpen` on the attach connection, with a
//! backoff between attempts) and the numbering goes on there; the receiver keeps delivering
//! by number across both paths.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::polling::Poller;
use super::Host;
use super::{lock, Engine, Verbs};
use crate::transport::notif::rdma::MsgChannel;
use crate::transport::verbs::{Access, Completion, ConnectOptions, Endpoint, Qp};

/// Receive (and send) slots of a channel.
const SLOTS: u32 = 64;
/// Bytes per slot; longer notifications go in several frames.
const SLOT_SIZE: usize = 1024;
/// Sequence number bytes ahead of each message.
const SEQ: usize = 8;
/// Bytes of a frame the channel asks to post inline.
const INLINE: u32 = 256;
/// Polls of the completion queue (each up to its batch) before a closed connection's
/// receiving channel goes.
const DRAIN_ON_CLOSE: usize = 64;

/// Which channel a queue pair carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum ChanKey {
    /// Ours to a peer (we send), by its id in the engine's `outs`.
    Out(u64),
    /// A peer's to us, by target connection id (we receive).
    In(u64),
}

/// The sending end.
pub(super) struct OutChan {
    peer: String,
    ch: MsgChannel,
    rail: usize,
    next_seq: u64,
    /// Handed to the channel, not yet delivered: (sequence number, bytes).
    unacked: VecDeque<(u64, Vec<u8>)>,
    /// Messages counted delivered so far.
    acked: u64,
    dead: bool,
}

/// The receiving end.
pub(super) struct InChan {
    ch: MsgChannel,
    from: String,
    dead: bool,
}

impl Engine {
    /// The sending channel to `peer`.
    fn out(&self, peer: &str) -> Option<&OutChan> {
        self.outs.get(self.out_ids.get(peer)?)
    }

    /// The sending channel to `peer`, to change. The channel of the last send is tried
    /// first, by comparing its peer's name: notifications tend to go to the peer of the one
    /// before (a ping-pong, a decode instance answering its prefill one), and the name's
    /// SipHash in `out_ids` was ~210 instructions of each send (callgrind, lab). A channel
    /// is in `outs` under its peer's id in `out_ids` only, so a name that matches is the
    /// answer `out_ids` would give.
    fn out_mut(&mut self, peer: &str) -> Option<&mut OutChan> {
        let last = self.last_out;
        let id = if self.outs.get(&last).is_some_and(|o| o.peer == peer) {
            last
        } else {
            let id = *self.out_ids.get(peer)?;
            self.last_out = id;
            id
        };
        self.outs.get_mut(&id)
    }
}

impl OutChan {
    /// Waiting for deliveries (the progress thread keeps watching the ports meanwhile).
    pub(super) fn busy(&self) -> bool {
        !self.dead && !self.unacked.is_empty()
    }

    /// Failed: its notifications go over TCP until it is rebuilt.
    pub(super) fn dead(&self) -> bool {
        self.dead
    }
}

/// A sending end being rebuilt: its rail, queue pair and channel, until the peer answers.
pub(super) struct NewChan {
    rail: usize,
    qp: Qp,
    ch: MsgChannel,
}

/// First wait between attempts to rebuild a channel; it doubles up to [`CHAN_RETRY_MAX`].
const CHAN_RETRY: Duration = Duration::from_millis(500);
const CHAN_RETRY_MAX: Duration = Duration::from_secs(30);

/// How a channel's queue pair connects: `rnr_retry` 0, so a frame that found no receive
/// posted would fail the channel at once (credits make sure it never happens) instead of
/// being retried unseen; `retry_cnt` 6, so a frame that gets no answer (the receiver closed
/// its queue pair: a malformed frame) fails the channel after seven timeouts (~7.5 s at
/// the default 1.07 s) and the rest goes over TCP. At 7, the default, Soft-RoCE went on
/// retrying for the whole minute the lab test waited (`a_malformed_frame_closes_the_channel…`:
/// 7.3 s to the TCP path at 6), the sender filling a channel nobody read.
pub(crate) fn chan_connect_options() -> ConnectOptions {
    ConnectOptions {
        rnr_retry: 0,
        retry_cnt: 6,
        ..ConnectOptions::default()
    }
}

impl Verbs {
    /// The rail carrying notifications to `peer` on a verbs channel (None: over TCP).
    pub(crate) fn notif_rail(&self, peer: &str) -> Option<String> {
        let e = lock(&self.engine);
        let o = e.out(peer).filter(|o| !o.dead)?;
        Some(self.rails[o.rail].name.clone())
    }

    /// A queue pair for a channel on `rail`, with its channel (receives posted).
    pub(crate) fn new_chan(&self, rail: usize) -> Result<(Qp, MsgChannel), String> {
        let r = &self.rails[rail];
        let mut o = crate::transport::verbs::QpOptions::new(r.port, r.gid_index);
        o.max_send_wr = SLOTS + 1;
        o.max_recv_wr = SLOTS + 1;
        o.remote_access = Access::NONE;
        // small notifications go inline when the device can (most of them: a sequence
        // number, the frame header and a few dozen bytes); without it, as before
        o.max_inline_data = INLINE;
        let qp = match Qp::new(&r.pd, &r.cq, &r.cq, &o) {
            Ok(qp) => qp,
            Err(_) => {
                o.max_inline_data = 0;
                Qp::new(&r.pd, &r.cq, &r.cq, &o).map_err(|e| e.to_string())?
            }
        };
        let ch = MsgChannel::new(&r.pd, qp.clone(), SLOTS, SLOT_SIZE).map_err(|e| e.to_string())?;
        Ok((qp, ch))
    }

    /// Initiator: the channel to `peer` is connected; notifications to it go there.
    pub(crate) fn add_out_chan(&self, peer: &str, rail: usize, qp: &Qp, ch: MsgChannel) {
        let mut e = lock(&self.engine);
        let id = match e.out_ids.get(peer) {
            Some(&id) => id,
            None => {
                let id = e.next_out;
                e.next_out += 1;
                e.out_ids.insert(peer.to_owned(), id);
                id
            }
        };
        let key = ChanKey::Out(id);
        e.chan_qpn.retain(|_, k| *k != key);
        e.chan_qpn.insert((rail, qp.qpn()), key);
        e.outs.insert(
            id,
            OutChan {
                peer: peer.to_owned(),
                ch,
                rail,
                next_seq: 0,
                unacked: VecDeque::new(),
                acked: 0,
                dead: false,
            },
        );
    }

    /// Initiator: new channels for dead ones whose rail is ACTIVE (in `active`) again, due
    /// for an attempt, to peers with no other request out; returns what to ask each peer:
    /// (peer, the peer's rail, our endpoint).
    pub(super) fn start_chan_rebuilds(&self, active: &[usize]) -> Vec<(String, u32, Endpoint)> {
        let mut e = lock(&self.engine);
        let now = Instant::now();
        let due: Vec<(String, usize, usize)> = (e.outs.values())
            .filter(|o| {
                let p = o.peer.as_str();
                o.dead
                    && active.contains(&o.rail)
                    && !e.chan_rebuilding.contains_key(p)
                    && e.rebuilding.get(p).is_none_or(VecDeque::is_empty)
                    && e.chan_retry.get(p).is_none_or(|(t, _)| *t <= now)
            })
            .filter_map(|o| {
                let pr = e
                    .pairs
                    .get(&super::PairKey::new(&o.peer, o.rail))?
                    .peer_rail;
                Some((o.peer.clone(), o.rail, pr))
            })
            .collect();
        let mut out = Vec::new();
        for (peer, rail, peer_rail) in due {
            let (t, b) = e
                .chan_retry
                .entry(peer.clone())
                .or_insert((now, CHAN_RETRY));
            *t = now + *b;
            *b = (*b * 2).min(CHAN_RETRY_MAX);
            match self.new_chan(rail) {
                Ok((qp, ch)) => {
                    tracing::info!(%peer, rail = %self.rails[rail].name, "rail is ACTIVE again: rebuilding the notification channel");
                    out.push((peer.clone(), peer_rail as u32, qp.endpoint()));
                    e.chan_rebuilding.insert(peer, NewChan { rail, qp, ch });
                }
                Err(err) => {
                    tracing::warn!(%peer, rail = %self.rails[rail].name, error = %err, "cannot rebuild the notification channel");
                }
            }
        }
        out
    }

    /// Initiator: the peer answered the channel request: connect and send there from the
    /// next message on (the numbering goes on), or stay on TCP until the next attempt.
    pub(crate) fn chan_rebuilt(&self, peer: &str, answer: Result<Endpoint, String>) {
        let mut e = lock(&self.engine);
        let Some(NewChan { rail, qp, ch }) = e.chan_rebuilding.remove(peer) else {
            tracing::warn!(%peer, "channel answer without a channel request; ignored");
            return;
        };
        let connected = answer.and_then(|ep| {
            qp.connect(&ep, &chan_connect_options())
                .map_err(|err| err.to_string())
        });
        if let Err(why) = connected {
            tracing::warn!(%peer, rail = %self.rails[rail].name, error = %why, "notification channel not rebuilt");
            return;
        }
        e.chan_retry.remove(peer);
        let Some(&id) = e.out_ids.get(peer) else {
            return; // the peer went meanwhile
        };
        let key = ChanKey::Out(id);
        e.chan_qpn.retain(|_, k| *k != key);
        e.chan_qpn.insert((rail, qp.qpn()), key);
        if let Some(o) = e.outs.get_mut(&id) {
            *o = OutChan {
                peer: peer.to_owned(),
                ch,
                rail,
                next_seq: o.next_seq,
                unacked: VecDeque::new(),
                acked: 0,
                dead: false,
            };
            tracing::info!(%peer, rail = %self.rails[rail].name, next_seq = o.next_seq, "notification channel rebuilt; notifications go over verbs again");
        }
    }

    /// Target: open the receiving end of `from`'s channel (target connection `conn`) on
    /// `rail`, connected to the initiator's endpoint; returns ours.
    pub(crate) fn accept_chan(
        &self,
        conn: u64,
        from: &str,
        rail: u32,
        ep: &Endpoint,
    ) -> Result<Endpoint, String> {
        let rail = rail as usize;
        if rail >= self.rails.len() {
            return Err(format!("no rail {rail} here"));
        }
        let (qp, ch) = self.new_chan(rail)?;
        qp.connect(ep, &chan_connect_options())
            .map_err(|e| e.to_string())?;
        let mut e = lock(&self.engine);
        // (a rebuilt channel replaces the connection's dead one)
        e.chan_qpn.retain(|_, k| *k != ChanKey::In(conn));
        e.chan_qpn.insert((rail, qp.qpn()), ChanKey::In(conn));
        e.ins.insert(
            conn,
            InChan {
                ch,
                from: from.to_owned(),
                dead: false,
            },
        );
        Ok(qp.endpoint())
    }

    /// Target: the connection `conn` ended; its channel goes — after what its queue pair
    /// received is dispatched. The sender counts a message delivered once our queue pair has
    /// it, and a dropped agent closes its connection once all are: those last messages may
    /// still sit in our completion queue, and went with the channel when it went first (a
    /// notification lost now and then when a sender was dropped under load).
    pub(crate) fn drop_in_chan(&self, shared: &dyn Host, conn: u64) {
        let key = ChanKey::In(conn);
        let rail = (lock(&self.engine).chan_qpn.iter())
            .find(|(_, k)| **k == key)
            .map(|((rail, _), _)| *rail);
        if let Some(rail) = rail {
            // bounded: on a busy rail the queue may never be empty for long
            for _ in 0..DRAIN_ON_CLOSE {
                if self.drain(shared, rail, Poller::Progress) == 0 {
                    break;
                }
            }
        }
        let mut e = lock(&self.engine);
        e.ins.remove(&conn);
        e.chan_qpn.retain(|_, k| *k != key);
    }

    /// Messages the notification channels still have on their way.
    pub(crate) fn notifs_in_flight(&self) -> usize {
        (lock(&self.engine).outs.values())
            .filter(|o| o.busy())
            .map(|o| o.unacked.len())
            .sum()
    }

    /// The agent is being dropped and its channels made no progress for a flush bound: every
    /// message still on one goes over TCP instead (in order, numbered, so the peer takes
    /// each once), where the TCP writers' own flush sends it. Never dropped silently.
    pub(crate) fn give_up_chans(&self, shared: &dyn Host, why: &str) {
        let mut e = lock(&self.engine);
        let peers: Vec<String> = (e.outs.values())
            .filter(|o| o.busy())
            .map(|o| o.peer.clone())
            .collect();
        for p in peers {
            self.fail_out_chan(shared, &mut e, &p, why);
        }
    }

    /// Send a notification to `peer`: on its channel, or over TCP (with its sequence number)
    /// once the channel failed, or plainly over TCP when there is no channel.
    pub(crate) fn notify(&self, shared: &dyn Host, peer: &str, bytes: Vec<u8>) {
        let mut e = lock(&self.engine);
        self.notify_locked(shared, &mut e, peer, bytes);
    }

    /// [`Verbs::notify`] when `peer` has a channel (live, or failed over to TCP); the bytes
    /// come back when it has none. A peer with a channel is known, so the caller need not
    /// look in the agent's peer table first (one hash of the name and a lock less a
    /// message).
    pub(crate) fn notify_on_chan(
        &self,
        shared: &dyn Host,
        peer: &str,
        bytes: Vec<u8>,
    ) -> Result<(), Vec<u8>> {
        let mut e = lock(&self.engine);
        self.notify_chan(shared, &mut e, peer, bytes)
    }

    pub(super) fn notify_locked(
        &self,
        shared: &dyn Host,
        e: &mut Engine,
        peer: &str,
        bytes: Vec<u8>,
    ) {
        if let Err(bytes) = self.notify_chan(shared, e, peer, bytes) {
            shared.send_tcp_notif(peer, None, bytes);
        }
    }

    fn notify_chan(
        &self,
        shared: &dyn Host,
        e: &mut Engine,
        peer: &str,
        bytes: Vec<u8>,
    ) -> Result<(), Vec<u8>> {
        let Some(o) = e.out_mut(peer) else {
            return Err(bytes);
        };
        let seq = o.next_seq;
        o.next_seq += 1;
        if o.dead {
            shared.send_tcp_notif(peer, Some(seq), bytes);
            return Ok(());
        }
        o.unacked.push_back((seq, bytes));
        let (_, bytes) = o.unacked.back().expect("pushed");
        // the sequence number and the bytes go straight into a send slot
        if let Err(err) = o.ch.send_parts(&seq.to_le_bytes(), bytes) {
            let why = format!("notification channel: {err}");
            self.fail_out_chan(shared, e, peer, &why);
        }
        Ok(())
    }

    /// Fault injection, for tests: `frame` raw on the live channel to `peer`.
    pub(crate) fn inject_frame(&self, peer: &str, frame: &[u8]) -> Result<(), String> {
        let mut e = lock(&self.engine);
        let o = (e.out_mut(peer).filter(|o| !o.dead)).ok_or("no live notification channel")?;
        o.ch.post_raw_frame(frame).map_err(|e| e.to_string())
    }

    /// The channel to `peer` failed: every undelivered message goes over TCP, in order.
    pub(super) fn fail_out_chan(&self, shared: &dyn Host, e: &mut Engine, peer: &str, why: &str) {
        if let Some(&id) = e.out_ids.get(peer) {
            self.fail_out(shared, e, id, why);
        }
    }

    /// [`Verbs::fail_out_chan`] by the channel's id.
    fn fail_out(&self, shared: &dyn Host, e: &mut Engine, id: u64, why: &str) {
        let Some(o) = e.outs.get_mut(&id) else {
            return;
        };
        if o.dead {
            return;
        }
        o.dead = true;
        let peer = o.peer.as_str();
        // stop the device before its messages are sent again another way
        let _ = o.ch.qp().set_error();
        tracing::warn!(
            %peer, rail = %self.rails[o.rail].name, resent = o.unacked.len(),
            "notification channel failed ({why}); notifications go over TCP from now on"
        );
        for (seq, bytes) in o.unacked.drain(..) {
            shared.send_tcp_notif(peer, Some(seq), bytes);
        }
    }

    /// Fail the sending channels on `rail` (its port is not ACTIVE).
    pub(super) fn fail_chans_on(&self, shared: &dyn Host, e: &mut Engine, rail: usize, why: &str) {
        let ids: Vec<u64> = (e.outs.iter())
            .filter(|(_, o)| o.rail == rail && !o.dead)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.fail_out(shared, e, id, why);
        }
    }

    /// A completion of a channel's queue pair.
    pub(super) fn on_chan_completion(
        &self,
        shared: &dyn Host,
        e: &mut Engine,
        key: &ChanKey,
        c: &Completion,
    ) {
        match key {
            ChanKey::Out(id) => {
                let Some(o) = e.outs.get_mut(id) else {
                    return;
                };
                if o.dead {
                    return;
                }
                match o.ch.handle(c) {
                    Ok(_) => {
                        while o.acked < o.ch.delivered() {
                            o.unacked.pop_front();
                            o.acked += 1;
                        }
                    }
                    Err(err) => {
                        let why = err.to_string();
                        self.fail_out(shared, e, *id, &why);
                    }
                }
            }
            ChanKey::In(conn) => {
                let Some(i) = e.ins.get_mut(conn) else {
                    return;
                };
                if i.dead {
                    return;
                }
                if let Err(err) = i.ch.handle(c) {
                    // Our queue pair must stop acknowledging at once: the sender counts a
                    // frame delivered once acknowledged, and every frame from here on would
                    // be dropped unread. In the error state it answers nothing, so the
                    // sender's next frame fails there (retries run out) and it resends what
                    // is undelivered over TCP. (A failed completion has put it there already;
                    // a malformed frame had not: its sender went on filling a dead channel.)
                    tracing::warn!(from = %i.from, error = %err, "notification channel failed; closed");
                    i.dead = true;
                    let _ = i.ch.qp().set_error();
                }
                while let Some(mut m) = i.ch.recv() {
                    if m.len() < SEQ {
                        tracing::warn!(from = %i.from, "notification without a sequence number; channel closed");
                        i.dead = true;
                        let _ = i.ch.qp().set_error();
                        break;
                    }
                    let seq = u64::from_le_bytes(m[..SEQ].try_into().expect("8 bytes"));
                    m.drain(..SEQ); // the bytes move down in place: no second buffer
                    shared.deliver_seq_notif(*conn, &i.from, seq, m);
                }
            }
        }
    }
}
