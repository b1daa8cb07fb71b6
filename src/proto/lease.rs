//! P's block leases and D's heartbeats (SPEC §3, seed 003), in virtual time.
//!
//! P pins a finished request's blocks for `kv_lease_duration`. Each heartbeat naming the
//! request sets its expiry to `max(old, now + duration * 2 / 3)` (never shorter); unknown ids
//! are ignored. The blocks are freed on the completion notification(s) or at expiry. D tracks
//! each remote-prefill request from the moment it enters its scheduler, and every
//! `duration / 6` sends one batched heartbeat per P engine with P's request ids; it
//! handshakes first with an engine it has not met (the heartbeat follows the handshake).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::kvmsg::{base_request_id, encode_heartbeat, Completion};

/// Why P freed a request's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeReason {
    /// Every completion notification it waited for arrived.
    Completed,
    /// The lease ran out (D gone, or the request abandoned).
    Expired,
}

/// Something P must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseEvent {
    /// Free the request's blocks.
    Free {
        /// P's request id.
        request_id: String,
        /// The blocks.
        blocks: Vec<u64>,
        /// Why.
        reason: FreeReason,
    },
}

struct Lease {
    expiry: Instant,
    blocks: Vec<u64>,
    completions: u32,
}

/// P's leases.
pub struct Leases {
    duration: Duration,
    /// P's tensor-parallel size (a D with a larger TP sends one completion per D rank per P
    /// rank: `d_tp / p_tp`).
    tp_size: u32,
    leases: HashMap<String, Lease>,
    events: VecDeque<LeaseEvent>,
    /// Heartbeat ids that named no pinned request (ignored, counted).
    pub unknown_heartbeats: u64,
}

impl Leases {
    /// Leases of `duration` on a P worker of TP size `tp_size`.
    pub fn new(duration: Duration, tp_size: u32) -> Self {
        Self {
            duration,
            tp_size: tp_size.max(1),
            leases: HashMap::new(),
            events: VecDeque::new(),
            unknown_heartbeats: 0,
        }
    }

    /// The extension a heartbeat grants: `duration * 2 / 3`.
    pub fn extension(&self) -> Duration {
        self.duration * 2 / 3
    }

    /// Pin `blocks` of finished request `id` until `now + duration`.
    pub fn pin(&mut self, id: &str, blocks: Vec<u64>, now: Instant) {
        self.leases.insert(
            id.to_owned(),
            Lease {
                expiry: now + self.duration,
                blocks,
                completions: 0,
            },
        );
    }

    /// Pin `blocks` of request `id` until `now + keep`, a duration of their own (D keeping
    /// a decoded turn for a read-back: `decoder_kv_blocks_ttl`). Heartbeats extend it as any
    /// lease.
    pub fn pin_for(&mut self, id: &str, blocks: Vec<u64>, now: Instant, keep: Duration) {
        self.leases.insert(
            id.to_owned(),
            Lease {
                expiry: now + keep,
                blocks,
                completions: 0,
            },
        );
    }

    /// Whether a request `id` names (exactly, or by base id) is pinned.
    pub fn holds(&self, id: &str) -> bool {
        self.find(id).is_some()
    }

    /// When `id`'s lease runs out (`None`: not pinned).
    pub fn expiry(&self, id: &str) -> Option<Instant> {
        self.leases.get(id).map(|l| l.expiry)
    }

    /// Pinned requests.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// True when nothing is pinned.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// The pinned request an id names: exactly, or by base id.
    fn find(&self, id: &str) -> Option<String> {
        if self.leases.contains_key(id) {
            return Some(id.to_owned());
        }
        let base = base_request_id(id);
        self.leases
            .keys()
            .find(|k| base_request_id(k) == base)
            .cloned()
    }

    /// A heartbeat: renew every request it names; returns how many were renewed.
    pub fn handle_heartbeat(&mut self, ids: &[String], now: Instant) -> usize {
        let ext = self.extension();
        let mut n = 0;
        for id in ids {
            match self.find(id) {
                Some(k) => {
                    if let Some(l) = self.leases.get_mut(&k) {
                        l.expiry = l.expiry.max(now + ext);
                        n += 1;
                    }
                }
                None => self.unknown_heartbeats += 1,
            }
        }
        n
    }

    /// A completion notification `<request_id>:<d_tp_size>`: the blocks go once every D rank
    /// that reads from this P rank has reported (`d_tp / p_tp` when D's TP is larger, else 1).
    /// Returns false for an unknown id (already freed, or never pinned).
    pub fn handle_completion(&mut self, c: &Completion) -> bool {
        let Some(k) = self.find(&c.request_id) else {
            return false;
        };
        let needed = if c.tp_size > self.tp_size {
            c.tp_size / self.tp_size
        } else {
            1
        };
        let Some(l) = self.leases.get_mut(&k) else {
            return false;
        };
        l.completions += 1;
        if l.completions >= needed {
            self.free(&k, FreeReason::Completed);
        }
        true
    }

    /// Drop `id` without a completion (P's engine aborted it).
    pub fn abort(&mut self, id: &str) -> bool {
        self.leases.remove(id).is_some()
    }

    fn free(&mut self, id: &str, reason: FreeReason) {
        if let Some(l) = self.leases.remove(id) {
            self.events.push_back(LeaseEvent::Free {
                request_id: id.to_owned(),
                blocks: l.blocks,
                reason,
            });
        }
    }

    /// Free every lease that ran out by `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut gone: Vec<String> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expiry <= now)
            .map(|(k, _)| k.clone())
            .collect();
        gone.sort();
        for k in gone {
            self.free(&k, FreeReason::Expired);
        }
    }

    /// The next expiry.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.expiry).min()
    }

    /// The next thing to do.
    pub fn poll_event(&mut self) -> Option<LeaseEvent> {
        self.events.pop_front()
    }
}

/// Something D must do to keep leases alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeartbeatAction {
    /// Handshake with this P engine (proactively; heartbeats to it wait for it).
    Handshake {
        /// P's engine id.
        engine: String,
    },
    /// Send this `HB:` notification to every worker of P engine `engine`.
    Send {
        /// P's engine id.
        engine: String,
        /// P's request ids it renews.
        ids: Vec<String>,
        /// The encoded notification.
        message: Vec<u8>,
    },
}

/// D's heartbeat tracking.
pub struct Heartbeats {
    interval: Duration,
    /// D request id → (P engine, P request id).
    tracked: HashMap<String, (String, String)>,
    connected: HashSet<String>,
    handshaking: HashSet<String>,
    next_due: Option<Instant>,
    actions: VecDeque<HeartbeatAction>,
}

impl Heartbeats {
    /// Heartbeats for leases of `lease_duration` (every `lease_duration / 6`).
    pub fn new(lease_duration: Duration) -> Self {
        Self {
            interval: (lease_duration / 6).max(Duration::from_millis(1)),
            tracked: HashMap::new(),
            connected: HashSet::new(),
            handshaking: HashSet::new(),
            next_due: None,
            actions: VecDeque::new(),
        }
    }

    /// The interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// A remote-prefill request entered the scheduler: heartbeat P's `p_request_id` on
    /// engine `p_engine` from now on (the first heartbeat goes at once).
    pub fn track(&mut self, d_request_id: &str, p_engine: &str, p_request_id: &str, now: Instant) {
        self.tracked.insert(
            d_request_id.to_owned(),
            (p_engine.to_owned(), p_request_id.to_owned()),
        );
        if self.next_due.is_none() {
            self.next_due = Some(now);
        }
    }

    /// Stop (the transfer completed, or the request finished or was aborted).
    pub fn untrack(&mut self, d_request_id: &str) {
        self.tracked.remove(d_request_id);
        if self.tracked.is_empty() {
            self.next_due = None;
        }
    }

    /// Requests tracked.
    pub fn tracked(&self) -> usize {
        self.tracked.len()
    }

    /// The handshake with `engine` finished: on success its heartbeat goes now.
    pub fn handshake_done(&mut self, engine: &str, ok: bool) {
        self.handshaking.remove(engine);
        if ok {
            self.connected.insert(engine.to_owned());
            if let Some(a) = self.send_for(engine) {
                self.actions.push_back(a);
            }
        }
    }

    /// The engine's connection is gone; the next round handshakes again.
    pub fn disconnected(&mut self, engine: &str) {
        self.connected.remove(engine);
    }

    fn send_for(&self, engine: &str) -> Option<HeartbeatAction> {
        let mut ids: Vec<String> = self
            .tracked
            .values()
            .filter(|(e, _)| e == engine)
            .map(|(_, r)| r.clone())
            .collect();
        if ids.is_empty() {
            return None;
        }
        ids.sort();
        Some(HeartbeatAction::Send {
            engine: engine.to_owned(),
            message: encode_heartbeat(&ids),
            ids,
        })
    }

    /// Time passed: a round of heartbeats when one is due.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(due) = self.next_due else {
            return;
        };
        if now < due {
            return;
        }
        let engines: BTreeMap<&String, ()> = self.tracked.values().map(|(e, _)| (e, ())).collect();
        let engines: Vec<String> = engines.into_keys().cloned().collect();
        for e in engines {
            if self.connected.contains(&e) {
                if let Some(a) = self.send_for(&e) {
                    self.actions.push_back(a);
                }
            } else if self.handshaking.insert(e.clone()) {
                self.actions
                    .push_back(HeartbeatAction::Handshake { engine: e });
            }
        }
        self.next_due = Some(now + self.interval);
    }

    /// When the next round is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_due
    }

    /// The next thing to do.
    pub fn poll_action(&mut self) -> Option<HeartbeatAction> {
        self.actions.pop_front()
    }
}
