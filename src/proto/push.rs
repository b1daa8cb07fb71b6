//! Push mode (SPEC §3, seed 000), in virtual time.
//!
//! P side, [`PushMatcher`]: D's registrations and P's finished prefills may arrive in either
//! order; each is matched against the other first by exact request id, then by base id (the
//! per-engine 8-hex suffix removed). A match becomes a WRITE of P's blocks into D's blocks,
//! D's logical block ids expanded to physical ones with the ratio learned in the handshake.
//! Without a handshake the WRITE is deferred behind one; a failed handshake or WRITE drops
//! the work and counts it (the lease and D's watchdog clean up; no retry loops). Finished
//! blocks stay matchable (a D with a larger TP registers once per rank) until evicted.
//! With `push_stream` a prefill is matchable while it runs: each step's closed blocks go to
//! the matched registrations at once, the rest when it finishes.
//!
//! D side, [`PushReceiver`]: each registration is armed with a watchdog
//! (`push_registration_timeout`); completions `<d_request_id>:<p_tp_size>` finish it (one
//! per P rank when P's TP is larger); a failed handshake or registration send marks the
//! receive failed; the next `get_finished` reports both.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::kvmsg::{base_request_id, Completion, PushReg};

/// Something P's writer must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAction {
    /// Handshake with D engine `engine` (at `host:port`); report with
    /// [`PushMatcher::handshake_done`].
    Handshake {
        /// D's engine id.
        engine: String,
        /// D's side-channel host.
        host: String,
        /// D's side-channel port.
        port: u16,
    },
    /// WRITE P's `local_blocks` into D's physical `remote_blocks` (pair for pair; the first
    /// pair is block `first_block` of the request). When `last`, D gets the completion
    /// (`<reg.request_id>:<p_tp_size>`) once every WRITE of this registration has landed;
    /// when also `only` (nothing was streamed before), it rides on this WRITE.
    Write {
        /// P's request id.
        request_id: String,
        /// P's blocks (physical).
        local_blocks: Vec<u64>,
        /// D's physical blocks.
        remote_blocks: Vec<u64>,
        /// The request block index of the first pair.
        first_block: usize,
        /// The registration's last WRITE.
        last: bool,
        /// Its only WRITE.
        only: bool,
        /// The registration (boxed: it is large next to the other variant).
        reg: Box<PushReg>,
    },
}

/// A prefill P holds (or is still computing, with `push_stream`).
struct Prefill {
    /// Blocks whose KV is complete, a prefix of the request's blocks (all when `done`).
    blocks: Vec<u64>,
    /// The request's block count when done.
    total: usize,
    done: bool,
    matched: bool,
}

/// A registration matched to a prefill, past its handshake: P blocks written so far.
struct Active {
    request_id: String,
    reg: PushReg,
    sent: usize,
}

/// P's writer-local matching tables.
pub struct PushMatcher {
    /// P request id → its prefill.
    finished: HashMap<String, Prefill>,
    /// Registrations waiting for their prefill, with their arrival time.
    regs: Vec<PushReg>,
    arrived: HashMap<String, Instant>,
    /// How long an unmatched registration is kept.
    reg_ttl: Duration,
    /// D engine → physical blocks per logical block (known after a handshake).
    ratio: HashMap<String, u32>,
    handshaking: HashSet<String>,
    /// Matches waiting for a handshake.
    deferred: Vec<(String, PushReg)>,
    /// Matches writing (streamed prefills still growing).
    active: Vec<Active>,
    actions: VecDeque<PushAction>,
    /// Work dropped: a handshake or WRITE failed, or a registration expired unmatched.
    pub dropped: u64,
    /// Registrations that found no prefill within `reg_ttl`, for the writer to refuse to D
    /// (drained by it).
    pub expired: Vec<PushReg>,
}

impl PushMatcher {
    /// Empty tables; a registration that finds no prefill within `reg_ttl` is dropped
    /// (the request never reached this P, or was aborted there).
    pub fn new(reg_ttl: Duration) -> Self {
        Self {
            finished: HashMap::new(),
            regs: Vec::new(),
            arrived: HashMap::new(),
            reg_ttl,
            ratio: HashMap::new(),
            handshaking: HashSet::new(),
            deferred: Vec::new(),
            active: Vec::new(),
            actions: VecDeque::new(),
            dropped: 0,
            expired: Vec::new(),
        }
    }

    /// True while finished blocks wait for any registration (the writer self-polls at 1 ms
    /// only then).
    pub fn has_unmatched_blocks(&self) -> bool {
        self.finished.values().any(|p| !p.matched)
    }

    /// Registrations waiting for their prefill.
    pub fn pending_registrations(&self) -> usize {
        self.regs.len()
    }

    /// A prefill finished with `blocks` (P's physical block ids).
    pub fn on_finished(&mut self, request_id: &str, blocks: Vec<u64>) {
        let total = blocks.len();
        self.on_progress(request_id, blocks, total, true);
    }

    /// `push_stream`: a prefill step closed blocks: `blocks` (a prefix of the request's
    /// `total` blocks) hold their final KV. Matched registrations get them at once; the rest
    /// goes with [`PushMatcher::on_finished`].
    pub fn on_stream(&mut self, request_id: &str, blocks: Vec<u64>, total: usize) {
        self.on_progress(request_id, blocks, total, false);
    }

    fn on_progress(&mut self, request_id: &str, blocks: Vec<u64>, total: usize, done: bool) {
        if let Some(p) = self.finished.get_mut(request_id) {
            if blocks.len() >= p.blocks.len() {
                p.blocks = blocks;
            }
            p.total = total;
            p.done |= done;
            let ids: Vec<usize> = (0..self.active.len())
                .filter(|i| self.active[*i].request_id == request_id)
                .collect();
            for i in ids.into_iter().rev() {
                self.advance(i);
            }
            return;
        }
        self.finished.insert(
            request_id.to_owned(),
            Prefill {
                blocks,
                total,
                done,
                matched: false,
            },
        );
        // exact ids first, then base ids
        let base = base_request_id(request_id);
        let mut hits: Vec<PushReg> = Vec::new();
        self.regs.retain(|r| {
            let hit = r.remote_request_id == request_id;
            if hit {
                hits.push(r.clone());
            }
            !hit
        });
        self.regs.retain(|r| {
            let hit = base_request_id(&r.remote_request_id) == base;
            if hit {
                hits.push(r.clone());
            }
            !hit
        });
        for r in hits {
            self.matched(request_id, r);
        }
    }

    /// A registration arrived from D.
    pub fn on_registration(&mut self, reg: PushReg, now: Instant) {
        let key = if self.finished.contains_key(&reg.remote_request_id) {
            Some(reg.remote_request_id.clone())
        } else {
            let base = base_request_id(&reg.remote_request_id);
            let mut keys: Vec<&String> = self
                .finished
                .keys()
                .filter(|k| base_request_id(k) == base)
                .collect();
            keys.sort();
            keys.first().map(|k| (*k).clone())
        };
        match key {
            Some(k) => self.matched(&k, reg),
            None => {
                self.arrived.insert(reg.request_id.clone(), now);
                self.regs.push(reg);
            }
        }
    }

    fn matched(&mut self, request_id: &str, reg: PushReg) {
        if let Some(f) = self.finished.get_mut(request_id) {
            f.matched = true;
        }
        if self.ratio.contains_key(&reg.engine_id) {
            self.activate(request_id, reg);
            return;
        }
        if self.handshaking.insert(reg.engine_id.clone()) {
            self.actions.push_back(PushAction::Handshake {
                engine: reg.engine_id.clone(),
                host: reg.host.clone(),
                port: reg.port,
            });
        }
        self.deferred.push((request_id.to_owned(), reg));
    }

    fn activate(&mut self, request_id: &str, reg: PushReg) {
        if !self.finished.contains_key(request_id) {
            self.dropped += 1; // evicted meanwhile
            return;
        }
        self.active.push(Active {
            request_id: request_id.to_owned(),
            reg,
            sent: 0,
        });
        self.advance(self.active.len() - 1);
    }

    /// WRITE what active match `i` has not written yet; a finished one is then done.
    fn advance(&mut self, i: usize) {
        let a = &self.active[i];
        let Some(p) = self.finished.get(&a.request_id) else {
            self.active.swap_remove(i);
            return;
        };
        let new = p.blocks.len();
        if new <= a.sent && !p.done {
            return;
        }
        let r = u64::from(*self.ratio.get(&a.reg.engine_id).unwrap_or(&1));
        let remote: Vec<u64> = a
            .reg
            .block_ids
            .iter()
            .flat_map(|&l| (0..r).map(move |i| l * r + i))
            .collect();
        // the two lists are aligned at their ends (D may hold a prefix already)
        let total = p.total.max(new);
        let skip = total.saturating_sub(remote.len());
        let (mut local_blocks, mut remote_blocks) = (Vec::new(), Vec::new());
        let mut first_block = None;
        for k in a.sent.max(skip)..new {
            let Some(&d) = remote.get(k - skip) else {
                break;
            };
            first_block.get_or_insert(k);
            local_blocks.push(p.blocks[k]);
            remote_blocks.push(d);
        }
        let last = p.done;
        if !last && local_blocks.is_empty() {
            self.active[i].sent = new; // D already holds these
            return;
        }
        self.actions.push_back(PushAction::Write {
            request_id: a.request_id.clone(),
            local_blocks,
            remote_blocks,
            first_block: first_block.unwrap_or(new),
            last,
            only: last && a.sent == 0,
            reg: Box::new(a.reg.clone()),
        });
        if last {
            self.active.swap_remove(i);
        } else {
            self.active[i].sent = new;
        }
    }

    /// D engine `engine`'s connection is gone (it died, or came back elsewhere): the next
    /// registration from it handshakes again instead of being written on the old one.
    pub fn forget_engine(&mut self, engine: &str) {
        self.ratio.remove(engine);
    }

    /// The handshake with D engine `engine` finished: `Ok(ratio)` (its physical blocks per
    /// logical block) replays the deferred WRITEs; `Err` drops them (counted).
    pub fn handshake_done(&mut self, engine: &str, result: Result<u32, String>) {
        self.handshaking.remove(engine);
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|(_, r)| r.engine_id == engine);
        self.deferred = rest;
        match result {
            Ok(ratio) => {
                self.ratio.insert(engine.to_owned(), ratio.max(1));
                for (id, reg) in mine {
                    self.activate(&id, reg);
                }
            }
            Err(_) => self.dropped += mine.len() as u64,
        }
    }

    /// D withdrew registration `d_request_id` of D agent `engine` (the request was aborted):
    /// drop it wherever it is — waiting for its prefill, for a handshake, matched and being
    /// written, or as a WRITE not yet taken. Returns whether anything was dropped; WRITEs
    /// already submitted are the caller's to wait for.
    pub fn cancel(&mut self, engine: &str, d_request_id: &str) -> bool {
        let is = |r: &PushReg| r.engine_id == engine && r.request_id == d_request_id;
        let before = self.regs.len() + self.deferred.len() + self.active.len() + self.actions.len();
        self.regs.retain(|r| !is(r));
        if !self.regs.iter().any(|r| r.request_id == d_request_id) {
            self.arrived.remove(d_request_id);
        }
        self.deferred.retain(|(_, r)| !is(r));
        self.active.retain(|a| !is(&a.reg));
        self.actions
            .retain(|a| !matches!(a, PushAction::Write { reg, .. } if is(reg)));
        before != self.regs.len() + self.deferred.len() + self.active.len() + self.actions.len()
    }

    /// A WRITE could not be submitted or failed: dropped and counted (no retry).
    pub fn write_failed(&mut self) {
        self.dropped += 1;
    }

    /// The request is over on P (completed or lease expired): forget its blocks and any
    /// registrations or deferred work for it.
    pub fn evict(&mut self, request_id: &str) {
        self.finished.remove(request_id);
        self.deferred.retain(|(id, _)| id != request_id);
        self.active.retain(|a| a.request_id != request_id);
    }

    /// Drop unmatched registrations older than the TTL (counted in `dropped`, and kept in
    /// `expired` for the writer to refuse).
    pub fn handle_timeout(&mut self, now: Instant) {
        let ttl = self.reg_ttl;
        let arrived = &mut self.arrived;
        let (keep, gone): (Vec<PushReg>, Vec<PushReg>) = std::mem::take(&mut self.regs)
            .into_iter()
            .partition(|r| arrived.get(&r.request_id).is_none_or(|t| now < *t + ttl));
        for r in &gone {
            arrived.remove(&r.request_id);
        }
        self.regs = keep;
        self.dropped += gone.len() as u64;
        self.expired.extend(gone);
    }

    /// When the oldest unmatched registration expires.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.regs
            .iter()
            .filter_map(|r| self.arrived.get(&r.request_id))
            .min()
            .map(|t| *t + self.reg_ttl)
    }

    /// The next thing to do.
    pub fn poll_action(&mut self) -> Option<PushAction> {
        self.actions.pop_front()
    }
}

/// D's accounting of pushed receives.
pub struct PushReceiver {
    timeout: Duration,
    /// D's TP size.
    tp_size: u32,
    /// D request id → (watchdog deadline, completions seen).
    pending: HashMap<String, (Instant, u32)>,
    finished: Vec<String>,
    failed: Vec<String>,
    /// Registrations dropped by the watchdog (warned; the engine aborts the request).
    pub expired: Vec<String>,
    /// Completions that named no pending receive.
    pub unknown_completions: u64,
}

impl PushReceiver {
    /// Receives with a registration watchdog of `timeout` on a D worker of TP `tp_size`.
    pub fn new(timeout: Duration, tp_size: u32) -> Self {
        Self {
            timeout,
            tp_size: tp_size.max(1),
            pending: HashMap::new(),
            finished: Vec::new(),
            failed: Vec::new(),
            expired: Vec::new(),
            unknown_completions: 0,
        }
    }

    /// A registration was handed to the writer: arm its watchdog.
    pub fn registered(&mut self, d_request_id: &str, now: Instant) {
        self.pending
            .insert(d_request_id.to_owned(), (now + self.timeout, 0));
    }

    /// Whether a registration is still watched (and so still re-sent).
    pub fn is_pending(&self, d_request_id: &str) -> bool {
        self.pending.contains_key(d_request_id)
    }

    /// Stop watching `d_request_id` (a watchdog elsewhere gave up on it); not a failure.
    pub fn forget(&mut self, d_request_id: &str) {
        if self.pending.remove(d_request_id).is_some() {
            self.expired.push(d_request_id.to_owned());
        }
    }

    /// The engine aborted `d_request_id`: no longer watched, neither finished nor failed
    /// (a completion that still comes is ignored).
    pub fn cancel(&mut self, d_request_id: &str) {
        self.pending.remove(d_request_id);
    }

    /// The handshake with P or the `PUSH_REG` send failed: the receive failed.
    pub fn send_failed(&mut self, d_request_id: &str) {
        if self.pending.remove(d_request_id).is_some() {
            self.failed.push(d_request_id.to_owned());
        }
    }

    /// A completion from P (`<d_request_id>:<p_tp_size>`): done once every P rank that
    /// writes to this D rank reported (`p_tp / d_tp` when P's TP is larger, else 1).
    pub fn handle_completion(&mut self, c: &Completion) {
        let needed = if c.tp_size > self.tp_size {
            c.tp_size / self.tp_size
        } else {
            1
        };
        let Some(p) = self.pending.get_mut(&c.request_id) else {
            self.unknown_completions += 1;
            return;
        };
        p.1 += 1;
        if p.1 >= needed {
            self.pending.remove(&c.request_id);
            self.finished.push(c.request_id.clone());
        }
    }

    /// Drop registrations whose watchdog ran out (they are no longer re-sent).
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut gone: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, (d, _))| *d <= now)
            .map(|(k, _)| k.clone())
            .collect();
        gone.sort();
        for k in gone {
            self.pending.remove(&k);
            self.expired.push(k);
        }
    }

    /// The next watchdog deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pending.values().map(|(d, _)| *d).min()
    }

    /// What `get_finished` reports: (finished receives, failed receives), drained.
    pub fn get_finished(&mut self) -> (Vec<String>, Vec<String>) {
        (
            std::mem::take(&mut self.finished),
            std::mem::take(&mut self.failed),
        )
    }
}
