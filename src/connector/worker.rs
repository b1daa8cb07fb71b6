//! The worker side (one per TP rank, its agent named [`rank_agent_name`]): owns the agent
//! and the registered KV cache; P holds finished requests under leases and frees them on
//! completions or expiry; D READs (pull) or registers and waits for P's WRITEs (push), from
//! or by every P rank whose heads it shares, and sends heartbeats to them. Handshakes run
//! on helper threads and never block a step.

mod recv;
mod serve;

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::caches::KvCaches;
use super::config::KvTransferConfig;
use super::fence::{post, Fence, Post};
use super::layout::{peer_kv, physical, KvLayout, LayerAt, Select};
use super::linkwatch::{exit_process, LinkDownAction, LinkMonitor};
use super::meta::{ConnectorMetadata, Finished, RecvReq};
use super::recent::Recent;
use super::tp::{head_slices, rank_agent_name, HeadSlice};
use super::writer::{Writer, WriterEvent};
use crate::agent::{Agent, AgentError, RegionId, RemoteAccess, XferId, XferOp, XferStatus};
use crate::proto::handshake::Direction;
use crate::proto::kvmsg::{Completion, GrantReq, KvMsg};
use crate::proto::lease::{LeaseEvent, Leases};
use crate::proto::push::PushReceiver;
use crate::proto::select::chunk_tokens;
use crate::rails::SysfsRoot;

/// Receives remembered as reported to the engine (a withdrawal after one reports nothing).
const REPORTED_MEMORY: usize = 4096;
/// D ranks remembered as heard from (their first heartbeat is logged).
const HEARD_MEMORY: usize = 1024;

/// A finished handshake: the peer agent, and the outcome.
type Handshake = (String, Result<(), String>);

/// A peer agent's connection state.
enum Conn {
    Connecting,
    Up,
    Failed(String),
}

/// Why D withdrew a push registration: the engine aborted the request (its blocks come
/// back in `sending`), or the registration saw no completion in time (the request's receive
/// failed: `failed_recving`).
#[derive(Clone, Copy, Debug)]
enum Withdrawn {
    Aborted,
    Expired,
}

/// Where D stands with a fenced P rank's grant for a pull receive (or, for a read-back
/// with an expiry, any keeper rank's answer: it carries the keeper's clock).
enum Granted {
    /// Asked (at this host's clock, microseconds); given up on at the instant.
    Asked(Instant, i64),
    /// The token.
    Token(Vec<u8>),
    /// Refused, and why.
    Refused(String),
}

/// A pull receive: one READ from each P rank whose heads this worker holds.
struct Recv {
    req: RecvReq,
    /// (P rank's agent, the heads it gives us).
    sources: Vec<(String, HeadSlice)>,
    /// P's heads per block.
    peer_heads: u64,
    /// The READs in flight.
    xfers: Vec<XferId>,
    posted: bool,
    /// The first failure: reported once no READ still writes into the blocks.
    error: Option<String>,
    /// Fenced P ranks' grants (asked once every rank is connected).
    grants: HashMap<String, Granted>,
    /// A read-back: each keeper rank's clock against ours, from its answer (offset, error),
    /// microseconds.
    offsets: HashMap<String, (i64, i64)>,
}

/// The worker side of a connector.
pub struct Worker {
    agent: Arc<Agent>,
    cfg: KvTransferConfig,
    layout: KvLayout,
    /// Where each layer's cache lies (layout order).
    layers: Vec<LayerAt>,
    /// The regions registered for the cache.
    regions: Vec<RegionId>,
    tp_rank: u32,
    tp_size: u32,
    leases: Leases,
    /// By peer agent (one per P rank).
    conns: HashMap<String, Conn>,
    handshakes: (mpsc::Sender<Handshake>, mpsc::Receiver<Handshake>),
    /// Pull, D: receives by request id.
    recvs: HashMap<String, Recv>,
    /// Notifications waiting for their peer's handshake: heartbeats to P ranks, grant
    /// answers to D ranks: (agent, message).
    deferred: Vec<(String, Vec<u8>)>,
    /// P: the D ranks whose heartbeats reached this rank (each said once in the log, so an
    /// operator sees every P rank renewing leases; bounded, a D rank forgotten is said
    /// again).
    heard: Recent,
    /// Grants over this worker's blocks (`fence_blocks`).
    fence: Fence,
    /// This worker's series in its agent's registry.
    stats: super::worker_stats::WorkerStats,
    /// Push, P: requests whose lease ended while a WRITE still reads their blocks.
    retiring: Vec<String>,
    /// Push, D.
    receiver: PushReceiver,
    writer: Option<Writer>,
    done: Finished,
    /// `chunk_mode`'s chunk (tokens), when on.
    chunk: Option<u64>,
    /// Bytes of the READs this worker posted.
    read_bytes: u64,
    /// `link_down_exit_s`: the monitor of this worker's local links.
    links: Option<LinkMonitor>,
    /// D, push: aborted requests whose registration is being withdrawn, with the time after
    /// which their blocks are given back unconfirmed (P unreachable).
    cancels: HashMap<String, (Instant, Withdrawn)>,
    /// D: receives already reported to the engine (arrived or failed). A withdrawal of one
    /// of them (the engine finished it in the step that reported it) reports nothing more:
    /// vLLM freed the request on that report and asserts on any later one.
    reported: Recent,
    /// Notifications dropped: they did not parse, or a `PUSH_REG` named another engine.
    pub malformed: u64,
    /// Read-backs declined because the keeper's blocks expire before the READ would end.
    pub expired_reads: u64,
    /// Read-backs whose every READ ended (a previous turn's KV reused).
    pub read_backs: u64,
    /// Leases that ran out before their peer finished (no completion, no heartbeat).
    pub leases_expired: u64,
    /// Added to this host's clock (tests: a worker whose clock is skewed).
    clock_skew_us: i64,
}

impl Worker {
    /// The worker of TP rank 0 over `agent` (named after the engine), registering one region
    /// per layer of `layout`.
    ///
    /// # Errors
    /// What registering the KV cache returns.
    pub fn new(
        agent: Arc<Agent>,
        cfg: KvTransferConfig,
        layout: KvLayout,
        tp_size: u32,
    ) -> Result<Self, AgentError> {
        Self::with_rank(agent, cfg, layout, 0, tp_size)
    }

    /// The worker of TP rank `tp_rank` of `tp_size` over `agent`, which must be named
    /// [`rank_agent_name`]`(engine, tp_rank)` (peers find rank `k` under that name at the
    /// port the scheduler advertises for it); `layout` is this rank's share of the cache
    /// (`kv_heads` per rank). kvrail allocates the cache ([`KvCaches::Allocate`]).
    ///
    /// # Errors
    /// A rank not below the size; what registering the KV cache returns.
    pub fn with_rank(
        agent: Arc<Agent>,
        cfg: KvTransferConfig,
        layout: KvLayout,
        tp_rank: u32,
        tp_size: u32,
    ) -> Result<Self, AgentError> {
        Self::with_caches(agent, cfg, layout, (tp_rank, tp_size), KvCaches::Allocate)
    }

    /// `register_kv_caches`: the worker of TP rank `tp.0` of `tp.1` (as
    /// [`Worker::with_rank`]) over the engine's own KV cache, registered in place — the
    /// memory `kv_buffer_device` names, one allocation per layer or pooled allocations
    /// holding several (see [`KvCaches`]).
    ///
    /// # Errors
    /// A layout that fails [`KvLayout::validate`]; a rank not below the size; caches that
    /// do not match the layout or
    /// `kv_buffer_device` (naming the layer or the key); what registration returns.
    pub fn with_caches(
        agent: Arc<Agent>,
        cfg: KvTransferConfig,
        layout: KvLayout,
        tp: (u32, u32),
        caches: KvCaches,
    ) -> Result<Self, AgentError> {
        layout
            .validate()
            .map_err(|e| AgentError::Unsupported(format!("layout: {e}")))?;
        let (tp_rank, tp_size) = tp;
        let tp_size = tp_size.max(1);
        if tp_rank >= tp_size {
            return Err(AgentError::Unsupported(format!(
                "tp rank {tp_rank} is not below tp size {tp_size}"
            )));
        }
        // peers find this rank by the engine id: the agent must carry it
        if let Some(id) = &cfg.engine_id {
            let want = rank_agent_name(id, tp_rank);
            if agent.name() != want {
                return Err(AgentError::Unsupported(format!(
                    "engine_id: kv_transfer_config says {id:?}, so TP rank {tp_rank}'s agent \
                     must be named {want:?}, not {:?}",
                    agent.name()
                )));
            }
        }
        // (bidirectional_kv_xfer in push mode: the next turn READs back what D keeps)
        let access = match (cfg.direction, cfg.bidirectional_kv_xfer) {
            (Direction::Pull, _) => RemoteAccess::READ,
            (Direction::Push, false) => RemoteAccess::WRITE,
            (Direction::Push, true) => RemoteAccess::READ_WRITE,
        };
        // host caches are fenced; NPU caches move through the host bounce, which checks the
        // regions' access itself
        let fenced = cfg.fence_blocks && caches.npu_device().is_none();
        let (layers, regions) =
            super::caches::register(&agent, &cfg, &layout, caches, (access, fenced))?;
        let chunk = cfg.chunk_mode.then(|| {
            let bs = u64::from(layout.block_size);
            chunk_tokens(bs, cfg.chunk_tokens.unwrap_or(cfg.max_num_batched_tokens))
        });
        // P: how long a registration waits for its prefill. With push_stream D may register
        // before P starts it; otherwise D had its parameters from P's finished prefill,
        // which P holds under its lease: a registration that found none within a lease
        // finds none (D is told, instead of waiting out push_registration_timeout)
        let reg_ttl = if cfg.push_stream {
            cfg.push_registration_timeout_s
        } else {
            cfg.lease_duration_s
                .clamp(1, cfg.push_registration_timeout_s.max(1))
        };
        let writer = (cfg.direction == Direction::Push).then(|| {
            Writer::start(
                agent.clone(),
                layout.clone(),
                layers.clone(),
                (tp_rank, tp_size),
                Duration::from_secs(reg_ttl),
                Select {
                    chunk,
                    swa: cfg.swa_window_mode,
                    ..Select::default()
                },
            )
        });
        let stats = super::worker_stats::WorkerStats::new(&agent.metrics(), agent.name());
        let mut w = Self {
            leases: Leases::new(Duration::from_secs(cfg.lease_duration_s), tp_size),
            // the scheduler runs the registration watchdog; this one never fires first
            receiver: PushReceiver::new(
                Duration::from_secs(cfg.push_registration_timeout_s.saturating_mul(2)),
                tp_size,
            ),
            agent,
            cfg,
            layout,
            layers,
            regions,
            tp_rank,
            tp_size,
            conns: HashMap::new(),
            handshakes: mpsc::channel(),
            recvs: HashMap::new(),
            deferred: Vec::new(),
            heard: Recent::new(HEARD_MEMORY),
            fence: Fence::new(fenced),
            stats,
            retiring: Vec::new(),
            writer: writer.transpose()?,
            done: Finished::default(),
            chunk,
            read_bytes: 0,
            links: None,
            cancels: HashMap::new(),
            reported: Recent::new(REPORTED_MEMORY),
            malformed: 0,
            expired_reads: 0,
            read_backs: 0,
            leases_expired: 0,
            clock_skew_us: 0,
        };
        w.watch_links(SysfsRoot::system(), Duration::from_secs(1), exit_process());
        Ok(w)
    }

    /// `link_down_exit_s` (a producer's setting; 0: off): (re)start the monitor of this
    /// worker's local links under `root`, read every `poll`, with `action` instead of the
    /// default (log and exit the process with
    /// [`LINK_DOWN_EXIT_CODE`](super::linkwatch::LINK_DOWN_EXIT_CODE)) — for an engine
    /// that shuts down its own way. On TCP there are no links: nothing is watched.
    pub fn watch_links(&mut self, root: SysfsRoot, poll: Duration, action: LinkDownAction) {
        self.links = None;
        if self.cfg.link_down_exit_s == 0 {
            return;
        }
        let links = self.agent.local_links();
        if links.is_empty() {
            tracing::warn!(
                "link_down_exit_s is set but the agent runs on TCP: no RDMA links to watch"
            );
            return;
        }
        self.links = Some(LinkMonitor::start(
            links,
            root,
            Duration::from_secs(self.cfg.link_down_exit_s),
            poll,
            action,
        ));
    }

    /// The `link_down_exit_s` monitor, when one runs.
    pub fn link_monitor(&self) -> Option<&LinkMonitor> {
        self.links.as_ref()
    }

    /// The agent.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// The layer regions (the engine's paged KV cache).
    pub fn regions(&self) -> &[RegionId] {
        &self.regions
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Requests P holds under a lease.
    pub fn leased(&self) -> usize {
        self.leases.len()
    }

    /// Bytes this worker asked the fabric to move (its READs, its writer's WRITEs).
    pub fn bytes_posted(&self) -> u64 {
        self.read_bytes + self.writer.as_ref().map_or(0, Writer::bytes_posted)
    }

    /// Push work dropped after a failed handshake or WRITE (P side).
    pub fn push_dropped(&self) -> u64 {
        self.writer.as_ref().map_or(0, Writer::dropped)
    }

    /// This worker's TP rank.
    pub fn tp_rank(&self) -> u32 {
        self.tp_rank
    }

    /// This step's work from the scheduler (call once per step).
    pub fn start_load_kv(&mut self, meta: &ConnectorMetadata, now: Instant) {
        // the scheduler names logical blocks; the writer WRITEs physical ones
        let own = self.layout.physical_per_logical;
        if let Some(w) = &self.writer {
            // push_stream: blocks earlier prefill steps closed (their KV is in the cache)
            let bs = u64::from(self.layout.block_size.max(1));
            for s in &meta.reqs_streaming {
                let ids = physical(&s.block_ids, own);
                let closed = ((s.computed.min(s.tokens) / bs) as usize).min(ids.len());
                w.stream(&s.request_id, ids[..closed].to_vec(), s.tokens);
            }
        }
        for s in &meta.reqs_to_send {
            match s.keep_s {
                // D keeping a decoded turn for a read-back: its TTL, READ in either mode
                Some(t) => (self.leases).pin_for(
                    &s.request_id,
                    s.block_ids.clone(),
                    now,
                    Duration::from_secs(t),
                ),
                None => self.leases.pin(&s.request_id, s.block_ids.clone(), now),
            }
            if self.fence.on && (self.cfg.direction == Direction::Pull || s.keep_s.is_some()) {
                // D ranks ask for it before they READ; revoked when the lease ends
                let blocks = physical(&s.block_ids, own);
                let geo = (&self.layout, self.layers.as_slice());
                if let Err(e) =
                    (self.fence).grant(&self.agent, geo, &s.request_id, &blocks, RemoteAccess::READ)
                {
                    tracing::warn!(request = %s.request_id, error = %e, "no grant over the blocks");
                }
            }
            if let Some(w) = self.writer.as_ref().filter(|_| s.keep_s.is_none()) {
                w.finished(&s.request_id, physical(&s.block_ids, own), s.tokens);
            }
        }
        for r in &meta.reqs_to_recv {
            let p = &r.params;
            let (sources, peer_heads) = match self.sources(&p.remote_engine_id, p.p_tp()) {
                Ok(v) => v,
                Err(e) => {
                    self.done.failed_recving.push(r.request_id.clone());
                    tracing::warn!(request = %r.request_id, error = %e, "KV receive failed");
                    continue;
                }
            };
            for (peer, s) in &sources {
                self.connect(peer, &p.remote_host, p.rank_port(s.peer_rank));
            }
            let read = r.read_back || self.cfg.direction == Direction::Pull;
            match if read {
                Direction::Pull
            } else {
                Direction::Push
            } {
                Direction::Pull => {
                    let recv = Recv {
                        req: r.clone(),
                        sources,
                        peer_heads,
                        xfers: Vec::new(),
                        posted: false,
                        error: None,
                        grants: HashMap::new(),
                        offsets: HashMap::new(),
                    };
                    self.recvs.insert(r.request_id.clone(), recv);
                }
                Direction::Push => {
                    // a fenced cache is written through D's grant over these blocks only,
                    // revoked when D takes them back
                    let grant = if self.fence.on {
                        let blocks = physical(&r.local_block_ids, own);
                        let geo = (&self.layout, self.layers.as_slice());
                        match (self.fence).grant(
                            &self.agent,
                            geo,
                            &r.request_id,
                            &blocks,
                            RemoteAccess::WRITE,
                        ) {
                            Ok(t) => Some(t),
                            Err(e) => {
                                tracing::warn!(request = %r.request_id, error = %e, "KV receive failed: no grant over the blocks");
                                self.done.failed_recving.push(r.request_id.clone());
                                continue;
                            }
                        }
                    } else {
                        None
                    };
                    self.receiver.registered(&r.request_id, now);
                    if let Some(w) = &self.writer {
                        w.register(r.clone(), grant);
                    }
                }
            }
        }
        for id in &meta.expired_registrations {
            // the scheduler's watchdog gave up: no longer watched, no longer re-sent; P is
            // told to drop it, and once it confirmed (or could not) the engine is told the
            // receive failed, so the request ends instead of waiting for ever
            self.receiver.forget(id);
            self.withdraw(id, Withdrawn::Expired, now);
        }
        for id in &meta.cancel_registrations {
            // the engine aborted it: its blocks are given back once P confirmed
            self.receiver.cancel(id);
            self.withdraw(id, Withdrawn::Aborted, now);
        }
        for hb in &meta.heartbeats {
            let p_tp = hb.ports.len().max(1) as u32;
            let Ok((sources, _)) = self.sources(&hb.engine, p_tp) else {
                continue;
            };
            for (peer, s) in sources {
                let port = hb
                    .ports
                    .get(s.peer_rank as usize)
                    .copied()
                    .unwrap_or(hb.port);
                self.connect(&peer, &hb.host, port);
                self.stats.heartbeats_out.inc();
                self.deferred.push((peer, hb.message.clone()));
            }
        }
        self.pump(now);
        if let Some(w) = &self.writer {
            if !meta.is_empty() {
                w.wake();
            }
        }
    }

    /// Pull layers are loaded as a whole before the request runs: nothing to wait for here.
    pub fn wait_for_layer_load(&self, _layer: &str) {}

    /// KV is written in place into registered memory: nothing to save.
    pub fn save_kv_layer(&self, _layer: &str) {}

    /// Nothing is in flight on the save path.
    pub fn wait_for_save(&self) {}

    /// What finished since the last call (call once per step): [`Worker::serve`], then what
    /// it gathered.
    pub fn get_finished(&mut self, now: Instant) -> Finished {
        self.serve(now);
        let step = super::worker_stats::Step {
            finished: &self.done,
            leases: self.leases.len(),
            grants: self.fence.live(),
            bytes_posted: self.bytes_posted(),
            push_dropped: self.push_dropped(),
            malformed: self.malformed,
        };
        self.stats.step(&step);
        for id in self.done.recving.iter().chain(&self.done.failed_recving) {
            self.reported.insert(id);
        }
        std::mem::take(&mut self.done)
    }

    /// Grants over this worker's blocks not revoked yet (`fence_blocks`).
    pub fn grants_live(&self) -> usize {
        self.fence.live()
    }

    /// Tests: this worker's clock runs `skew_us` ahead of the host's (behind, negative), as
    /// another host's would.
    #[doc(hidden)]
    pub fn skew_clock(&mut self, skew_us: i64) {
        self.clock_skew_us = skew_us;
    }

    /// This worker's clock (the host's monotonic one, skewed in tests), microseconds.
    fn clock_us(&self) -> i64 {
        super::clock::now_us() + self.clock_skew_us
    }
}
