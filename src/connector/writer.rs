//! The push writer: one thread per worker that owns every push-side network operation —
//! taking the agent's notifications, sending `PUSH_REG`, matching registrations with
//! finished prefills, and posting the WRITEs. It sleeps on a wake event when idle; new work,
//! every `get_finished` and handshake completions wake it; it self-polls every 1 ms only
//! while finished blocks wait for a registration or WRITEs or handshakes are in flight.
//! Handshakes run on helper threads and re-queue their deferred work (registrations to
//! send, matched WRITEs) instead of blocking the writer.

mod registrations;
mod write;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::layout::{peer_kv, KvLayout, LayerAt, Select};
use super::meta::RecvReq;
use super::tp::{head_slices, rank_agent_name};
use crate::agent::{Agent, AgentError, XferId, XferOp, XferStatus};
use crate::proto::kvmsg::{Completion, GrantNone, KvMsg, PushCancel, PushCancelled, PushReg};
use crate::proto::push::{PushAction, PushMatcher};
use crate::threads::lock;

/// What the writer reports to its worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WriterEvent {
    /// A `PUSH_` message that does not parse (the worker counts it malformed), and its
    /// sender.
    Unparsed(String, Vec<u8>),
    /// P: a WRITE of this request (and its completion notification) is done, into a D
    /// worker of this TP size.
    Pushed(String, u32),
    /// D: the handshake with P or the `PUSH_REG` send failed.
    RegistrationFailed(String, String),
    /// P: a well-formed `PUSH_REG` that is not for this engine (dropped; counted malformed).
    Refused,
    /// D: every P rank confirmed the withdrawal of this aborted request's registration.
    Cancelled(String),
}

#[derive(Default)]
struct Inbox {
    woken: bool,
    /// D: registrations to send, each with D's grant over its blocks (fenced cache).
    regs: VecDeque<(RecvReq, Option<Vec<u8>>)>,
    finished: VecDeque<(String, Vec<u64>, u64)>,
    stream: VecDeque<(String, Vec<u64>, u64)>,
    evict: VecDeque<String>,
    /// D: registrations to withdraw (request id, report the confirmation).
    cancel: VecDeque<(String, bool)>,
    /// D: receives that ended (done or failed): their registrations are no longer watched.
    ended: VecDeque<String>,
    handshakes: VecDeque<(String, Result<(), String>)>,
}

struct Shared {
    /// P: request id → (WRITEs in flight, retired). A retired request's blocks may be freed
    /// once no WRITE reads them, and no new WRITE starts.
    writing: Mutex<HashMap<String, (u32, bool)>>,
    agent: Arc<Agent>,
    /// The push protocol's notifications (`PUSH_REG:`, `PUSH_CANCEL:`, `PUSH_CANCELLED:`):
    /// routed here by the agent, in order, never to the worker.
    regs: crate::agent::NotifRoute,
    layout: KvLayout,
    regions: Vec<LayerAt>,
    /// This worker's (TP rank, TP size).
    tp: (u32, u32),
    inbox: Mutex<Inbox>,
    wake: Condvar,
    stop: AtomicBool,
    events: Mutex<VecDeque<WriterEvent>>,
    dropped: AtomicU64,
    /// Bytes of the WRITEs posted.
    bytes: AtomicU64,
    /// What of a request moves (`chunk_mode`, `swa_window_mode`; tokens per request).
    sel: Select,
}

/// The writer's handle (owned by the worker).
pub(crate) struct Writer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    pub(crate) fn start(
        agent: Arc<Agent>,
        layout: KvLayout,
        regions: Vec<LayerAt>,
        tp: (u32, u32),
        reg_ttl: Duration,
        sel: Select,
    ) -> Result<Self, AgentError> {
        let shared = Arc::new(Shared {
            writing: Mutex::new(HashMap::new()),
            regs: agent.notif_route(crate::proto::kvmsg::PUSH_PREFIX),
            agent,
            layout,
            regions,
            tp,
            inbox: Mutex::new(Inbox::default()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            events: Mutex::new(VecDeque::new()),
            dropped: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            sel,
        });
        let s = shared.clone();
        let thread = crate::threads::spawn("kvrail-push-writer", move || {
            let _span = tracing::info_span!("agent", name = %s.agent.name()).entered();
            Loop::new(s, reg_ttl).run();
        })
        .map_err(|e| AgentError::Unsupported(format!("spawning the push writer: {e}")))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    fn push(&self, f: impl FnOnce(&mut Inbox)) {
        let mut i = lock(&self.shared.inbox);
        f(&mut i);
        i.woken = true;
        self.shared.wake.notify_one();
    }

    pub(crate) fn register(&self, r: RecvReq, grant: Option<Vec<u8>>) {
        self.push(|i| i.regs.push_back((r, grant)));
    }

    pub(crate) fn finished(&self, id: &str, blocks: Vec<u64>, tokens: u64) {
        self.push(|i| i.finished.push_back((id.to_owned(), blocks, tokens)));
    }

    /// `push_stream`: `blocks` of running prefill `id` (of `tokens` prompt tokens) hold
    /// their final KV.
    pub(crate) fn stream(&self, id: &str, blocks: Vec<u64>, tokens: u64) {
        self.push(|i| i.stream.push_back((id.to_owned(), blocks, tokens)));
    }

    pub(crate) fn bytes_posted(&self) -> u64 {
        self.shared.bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn evict(&self, id: &str) {
        self.push(|i| i.evict.push_back(id.to_owned()));
    }

    /// D: withdraw registration `id` from every P rank it went to (`PUSH_CANCEL`); with
    /// `report`, [`WriterEvent::Cancelled`] once all of them confirmed.
    pub(crate) fn cancel(&self, id: &str, report: bool) {
        self.push(|i| i.cancel.push_back((id.to_owned(), report)));
    }

    /// D: receive `id` ended (its WRITEs landed, or it failed): stop watching the P ranks
    /// its registration went to.
    pub(crate) fn ended(&self, id: &str) {
        self.push(|i| i.ended.push_back(id.to_owned()));
    }

    pub(crate) fn wake(&self) {
        self.push(|_| {});
    }

    pub(crate) fn events(&self) -> Vec<WriterEvent> {
        lock(&self.shared.events).drain(..).collect()
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// P: the request is over (its lease ran out): no WRITE starts for it from now on.
    /// True when its blocks may be freed now; false while a WRITE still reads them (ask
    /// [`Writer::quiet`] again later).
    pub(crate) fn retire(&self, id: &str) -> bool {
        let mut w = lock(&self.shared.writing);
        let e = w.entry(id.to_owned()).or_insert((0, false));
        e.1 = true;
        if e.0 == 0 {
            w.remove(id);
            return true;
        }
        false
    }

    /// P: whether a retired request's last WRITE ended (then its blocks may be freed).
    pub(crate) fn quiet(&self, id: &str) -> bool {
        let mut w = lock(&self.shared.writing);
        match w.get(id) {
            Some((n, _)) if *n > 0 => false,
            _ => {
                w.remove(id);
                true
            }
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(PartialEq, Eq)]
enum Conn {
    Connecting,
    Up,
}

/// D: a registration waiting until every P rank it goes to is connected (so a rank that
/// cannot be reached fails it before any rank could WRITE into its blocks).
struct Waiting {
    reg: RecvReq,
    grant: Option<Vec<u8>>,
    peers: Vec<String>,
}

/// A streamed match: (P request id, D request id, D rank).
type PairKey = (String, String, u32);

fn pair_key(id: &str, reg: &PushReg) -> PairKey {
    (id.to_owned(), reg.request_id.clone(), reg.tp_rank)
}

/// A WRITE in flight: its transfer, P's request id, D's TP size, the streamed match it is
/// part of, and the registration it writes into (D rank agent, D request id).
type Inflight = (XferId, String, u32, Option<PairKey>, (String, String));

/// Which part of a match a WRITE is.
#[derive(Clone, Copy)]
struct Part {
    first_block: u64,
    last: bool,
    only: bool,
}

/// A match written in several parts (`push_stream`).
struct Streamed {
    engine: String,
    completion: Vec<u8>,
    d_tp: u32,
    last_posted: bool,
    failed: bool,
}

/// The writer thread's own state.
struct Loop {
    sh: Arc<Shared>,
    matcher: PushMatcher,
    conns: HashMap<String, Conn>,
    /// D: registrations waiting for the handshakes with their P ranks.
    waiting: Vec<Waiting>,
    /// P: WRITEs in flight (xfer, P request id, D's TP size, the streamed match it is part
    /// of).
    inflight: Vec<Inflight>,
    /// D: where each sent registration went (its P rank agents).
    sent_to: HashMap<String, Vec<String>>,
    /// D: withdrawals waiting for P ranks' confirmations (ranks left, report when done).
    withdrawing: HashMap<String, (Vec<String>, bool)>,
    /// P: withdrawals to confirm once no WRITE into them is in flight (D rank agent, D
    /// request id, D's side channel).
    cancelling: Vec<(String, String, String)>,
    /// P: registrations that found no prefill here, to refuse to D (D rank agent, D request
    /// id, D's side channel, why).
    refusing: Vec<(String, String, String, String)>,
    /// P: streamed matches (more than one WRITE): D is told once all of them landed.
    streamed: HashMap<PairKey, Streamed>,
    /// P: each finished request's prompt tokens.
    tokens: HashMap<String, u64>,
}

impl Loop {
    /// `reg_ttl`: how long an unmatched registration (or finished request) waits for its
    /// other half (`push_registration_timeout`).
    fn new(sh: Arc<Shared>, reg_ttl: Duration) -> Self {
        Self {
            sh,
            matcher: PushMatcher::new(reg_ttl),
            conns: HashMap::new(),
            waiting: Vec::new(),
            inflight: Vec::new(),
            sent_to: HashMap::new(),
            withdrawing: HashMap::new(),
            cancelling: Vec::new(),
            refusing: Vec::new(),
            streamed: HashMap::new(),
            tokens: HashMap::new(),
        }
    }

    /// D engine `engine`'s physical blocks per logical one (from its handshake).
    fn ratio(&self, engine: &str) -> u32 {
        self.sh
            .agent
            .remote_metadata(engine)
            .map_or(1, |m| m.handshake.physical_per_logical)
    }

    fn event(&self, e: WriterEvent) {
        lock(&self.sh.events).push_back(e);
    }

    fn handshake(&mut self, engine: &str, addr: String) {
        // an engine is connected while its connection is up at the address asked for; one
        // that died, or came back elsewhere (restarted), is loaded again
        let current = match self.conns.get(engine) {
            Some(Conn::Connecting) => true,
            Some(Conn::Up) => self.sh.agent.peer_current(engine, &addr),
            None => false,
        };
        if current {
            return;
        }
        self.conns.insert(engine.to_owned(), Conn::Connecting);
        let (sh, peer) = (self.sh.clone(), engine.to_owned());
        let spawned = crate::threads::spawn(format!("kvrail-load-{engine}"), move || {
            let r = sh.agent.load_peer(&peer, &addr);
            let mut i = lock(&sh.inbox);
            i.handshakes.push_back((peer, r));
            i.woken = true;
            sh.wake.notify_one();
        });
        if let Err(e) = spawned {
            // tried again when it is next needed
            self.conns.remove(engine);
            tracing::warn!(peer = %engine, error = %e, "no thread to connect to the peer");
        }
    }

    fn run(mut self) {
        loop {
            let work = {
                let mut i = lock(&self.sh.inbox);
                let busy = self.matcher.has_unmatched_blocks()
                    || !self.inflight.is_empty()
                    || self.conns.values().any(|c| *c == Conn::Connecting);
                // an unmatched registration expires on time even when nothing else happens
                let expiry = self.matcher.poll_timeout();
                while !i.woken && !self.sh.stop.load(Ordering::Acquire) {
                    let wait = match (busy, expiry) {
                        (true, _) => Some(Duration::from_millis(1)),
                        (false, Some(t)) => Some(t.saturating_duration_since(Instant::now())),
                        (false, None) => None,
                    };
                    if let Some(d) = wait {
                        i = self
                            .sh
                            .wake
                            .wait_timeout(i, d)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                        break;
                    }
                    i = self.sh.wake.wait(i).unwrap_or_else(|p| p.into_inner());
                }
                i.woken = false;
                std::mem::take(&mut *i)
            };
            if self.sh.stop.load(Ordering::Acquire) {
                return;
            }
            self.step(work, Instant::now());
        }
    }

    fn step(&mut self, mut w: Inbox, now: Instant) {
        for (engine, r) in w.handshakes.drain(..) {
            let ok = r.is_ok();
            match &r {
                Ok(()) => {
                    self.conns.insert(engine.clone(), Conn::Up);
                }
                Err(e) => {
                    tracing::warn!(%engine, error = %e, "push handshake failed");
                    self.conns.remove(&engine);
                    // P: withdrawals of this D cannot be confirmed (D gives its blocks back
                    // after its timeout)
                    self.cancelling.retain(|(d, ..)| d != &engine);
                    self.refusing.retain(|(d, ..)| d != &engine);
                }
            }
            // D: registrations that waited for this P rank go once every rank they go to is
            // up; one failed handshake fails them before any rank has them
            let mut i = 0;
            while i < self.waiting.len() {
                if !self.waiting[i].peers.contains(&engine) {
                    i += 1;
                    continue;
                }
                match &r {
                    Err(e) => {
                        let w = self.waiting.swap_remove(i);
                        self.event(WriterEvent::RegistrationFailed(
                            w.reg.request_id,
                            format!("handshake with {engine}: {e}"),
                        ));
                    }
                    Ok(()) if self.all_up(&self.waiting[i].peers) => {
                        let w = self.waiting.swap_remove(i);
                        self.send_regs(&w.peers, &w.reg, w.grant.as_deref());
                    }
                    Ok(()) => i += 1,
                }
            }
            // P: WRITEs that waited for this D, with its physical blocks per logical one
            if ok {
                let ratio = self.ratio(&engine);
                self.matcher.handshake_done(&engine, Ok(ratio));
            } else {
                let before = self.matcher.dropped;
                self.matcher
                    .handshake_done(&engine, Err("handshake failed".into()));
                self.sh
                    .dropped
                    .fetch_add(self.matcher.dropped - before, Ordering::Relaxed);
            }
        }
        for (id, report) in w.cancel.drain(..) {
            self.withdraw(&id, report);
        }
        for (reg, grant) in w.regs.drain(..) {
            // one registration to each P rank whose heads this worker takes
            let p = &reg.params;
            let (rank, tp) = self.sh.tp;
            let slices = match head_slices(self.sh.layout.kv_heads.max(1), rank, tp, p.p_tp()) {
                Ok((v, _)) => v,
                Err(e) => {
                    self.event(WriterEvent::RegistrationFailed(
                        reg.request_id,
                        e.to_string(),
                    ));
                    continue;
                }
            };
            let peers: Vec<String> = slices
                .iter()
                .map(|s| rank_agent_name(&p.remote_engine_id, s.peer_rank))
                .collect();
            if self.all_up(&peers) {
                self.send_regs(&peers, &reg, grant.as_deref());
                continue;
            }
            for s in &slices {
                let peer = rank_agent_name(&p.remote_engine_id, s.peer_rank);
                let addr = format!("{}:{}", p.remote_host, p.rank_port(s.peer_rank));
                self.handshake(&peer, addr);
            }
            self.waiting.push(Waiting { reg, grant, peers });
        }
        for (id, blocks, tokens) in w.stream.drain(..) {
            self.tokens.insert(id.clone(), tokens);
            let total = tokens.div_ceil(u64::from(self.sh.layout.block_size.max(1)));
            self.matcher.on_stream(&id, blocks, total as usize);
        }
        for (id, blocks, tokens) in w.finished.drain(..) {
            self.tokens.insert(id.clone(), tokens);
            let blocks = self.sh.layout.prompt_blocks(&blocks, tokens).to_vec();
            self.matcher.on_finished(&id, blocks);
        }
        for id in w.evict.drain(..) {
            self.tokens.remove(&id);
            self.matcher.evict(&id);
            // streamed matches of an evicted request never complete
            self.fail_streamed(|k, _| k.0 == id);
        }
        for (from, m) in self.sh.regs.get_new() {
            match KvMsg::decode(&m) {
                // the registration names the P engine it is for: this one, at this rank
                Ok(KvMsg::PushReg(r))
                    if rank_agent_name(&r.remote_engine_id, self.sh.tp.0)
                        == self.sh.agent.name() =>
                {
                    // a D engine that restarted registers from a new address (or its
                    // connection died): handshake with it again
                    let addr = format!("{}:{}", r.host, r.port);
                    if self.conns.get(&r.engine_id) == Some(&Conn::Up)
                        && !self.sh.agent.peer_current(&r.engine_id, &addr)
                    {
                        self.conns.remove(&r.engine_id);
                        self.matcher.forget_engine(&r.engine_id);
                    }
                    self.matcher.on_registration(r, now);
                }
                Ok(KvMsg::PushReg(r)) => {
                    tracing::warn!(
                        peer = %from,
                        request = %r.request_id,
                        "PUSH_REG for engine {:?} reached {}: refused",
                        r.remote_engine_id,
                        self.sh.agent.name()
                    );
                    self.event(WriterEvent::Refused);
                }
                Ok(KvMsg::PushCancel(c)) => {
                    // P: drop it wherever it is; streamed parts never tell D they are done
                    self.matcher.cancel(&c.engine_id, &c.request_id);
                    self.fail_streamed(|k, s| k.1 == c.request_id && s.engine == c.engine_id);
                    tracing::info!(peer = %from, request = %c.request_id, "push registration withdrawn");
                    let addr = format!("{}:{}", c.host, c.port);
                    self.cancelling.push((c.engine_id, c.request_id, addr));
                }
                Ok(KvMsg::PushCancelled(c)) => self.withdrawn(&from, &c.request_id),
                _ => self.event(WriterEvent::Unparsed(from, m)),
            }
        }
        let before = self.matcher.dropped;
        self.matcher.handle_timeout(now);
        for r in std::mem::take(&mut self.matcher.expired) {
            let why = format!(
                "{} holds no prefill {:?} (it never ran here, or its lease ended)",
                self.sh.agent.name(),
                r.remote_request_id
            );
            tracing::warn!(peer = %r.engine_id, request = %r.request_id, "PUSH_REG refused: {why}");
            let addr = format!("{}:{}", r.host, r.port);
            self.refusing.push((r.engine_id, r.request_id, addr, why));
        }
        self.sh
            .dropped
            .fetch_add(self.matcher.dropped - before, Ordering::Relaxed);
        while let Some(a) = self.matcher.poll_action() {
            match a {
                PushAction::Handshake { engine, host, port } => {
                    if self.conns.get(&engine) == Some(&Conn::Up) {
                        let ratio = self.ratio(&engine);
                        self.matcher.handshake_done(&engine, Ok(ratio));
                    } else {
                        self.handshake(&engine, format!("{host}:{port}"));
                    }
                }
                PushAction::Write {
                    request_id,
                    local_blocks,
                    remote_blocks,
                    first_block,
                    last,
                    only,
                    reg,
                } => {
                    let part = Part {
                        first_block: first_block as u64,
                        last,
                        only,
                    };
                    let r = self.write(&request_id, &local_blocks, &remote_blocks, part, &reg);
                    if let Err(e) = r {
                        tracing::warn!(request = %request_id, error = %e, "push WRITE not submitted");
                        self.matcher.write_failed();
                        self.sh.dropped.fetch_add(1, Ordering::Relaxed);
                        let key = pair_key(&request_id, &reg);
                        if let Some(s) = self.streamed.get_mut(&key) {
                            s.failed = true;
                        }
                        self.settle(&key);
                    }
                }
            }
        }
        let mut i = 0;
        while i < self.inflight.len() {
            let (x, id, d_tp, key, _) = self.inflight[i].clone();
            match self.sh.agent.status(x) {
                Ok(XferStatus::InProgress) => i += 1,
                Ok(XferStatus::Done) => {
                    let _ = self.sh.agent.release(x);
                    self.inflight.swap_remove(i);
                    self.ended(&id);
                    match key {
                        None => self.event(WriterEvent::Pushed(id, d_tp)),
                        Some(k) => self.settle(&k),
                    }
                }
                other => {
                    let _ = self.sh.agent.release(x);
                    self.inflight.swap_remove(i);
                    self.ended(&id);
                    tracing::warn!(request = %id, "push WRITE failed: {other:?}");
                    self.matcher.write_failed();
                    self.sh.dropped.fetch_add(1, Ordering::Relaxed);
                    if let Some(k) = key {
                        if let Some(s) = self.streamed.get_mut(&k) {
                            s.failed = true;
                        }
                        self.settle(&k);
                    }
                }
            }
        }
        self.confirm_cancels();
        self.refuse_unheld();
        for id in w.ended.drain(..) {
            self.sent_to.remove(&id);
        }
        self.fail_orphaned();
    }

    fn all_up(&self, peers: &[String]) -> bool {
        peers.iter().all(|p| self.conns.get(p) == Some(&Conn::Up))
    }
}
