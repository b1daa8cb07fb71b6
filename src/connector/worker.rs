//! The worker side (one per TP rank, its agent named [`rank_agent_name`]): owns the agent
//! and the registered KV cache; P holds finished requests under leases and frees them on
//! completions or expiry; D READs (pull) or registers and waits for P's WRITEs (push), from
//! or by every P rank whose heads it shares, and sends heartbeats to them. Handshakes run
//! on helper threads and never block a step.

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
use super::tp::{head_slices, rank_agent_name, HeadSlice};
use super::writer::{Writer, WriterEvent};
use crate::agent::{Agent, AgentError, RegionId, RemoteAccess, XferId, XferOp, XferStatus};
use crate::proto::handshake::Direction;
use crate::proto::kvmsg::{Completion, GrantReq, KvMsg};
use crate::proto::lease::{LeaseEvent, Leases};
use crate::proto::push::PushReceiver;
use crate::proto::select::chunk_tokens;
use crate::rails::SysfsRoot;

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

/// Where D stands with a fenced P rank's grant for a pull receive.
enum Granted {
    /// Asked; given up on at the instant.
    Asked(Instant),
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
    /// Notifications dropped: they did not parse, or a `PUSH_REG` named another engine.
    pub malformed: u64,
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
        let access = match cfg.direction {
            Direction::Pull => RemoteAccess::READ,
            Direction::Push => RemoteAccess::WRITE,
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
        let writer = (cfg.direction == Direction::Push).then(|| {
            Writer::start(
                agent.clone(),
                layout.clone(),
                layers.clone(),
                (tp_rank, tp_size),
                Duration::from_secs(cfg.push_registration_timeout_s),
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
            fence: Fence::new(fenced),
            stats,
            retiring: Vec::new(),
            writer: writer.transpose()?,
            done: Finished::default(),
            chunk,
            read_bytes: 0,
            links: None,
            cancels: HashMap::new(),
            malformed: 0,
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

    /// The P ranks whose heads this worker shares when P runs TP `p_tp`, each with its
    /// agent name and head slice; and P's heads per block.
    fn sources(&self, engine: &str, p_tp: u32) -> Result<(Vec<(String, HeadSlice)>, u64), String> {
        let (slices, peer_heads) = head_slices(
            self.layout.kv_heads.max(1),
            self.tp_rank,
            self.tp_size,
            p_tp,
        )?;
        let v = slices
            .into_iter()
            .map(|s| (rank_agent_name(engine, s.peer_rank), s))
            .collect();
        Ok((v, peer_heads))
    }

    /// Start a handshake with peer agent `peer` at `host:port` on a helper thread (once);
    /// with a metadata store, by name through the store (P's `kv_transfer_params` may then
    /// name its engine only: no host, no ports).
    fn connect(&mut self, peer: &str, host: &str, port: u16) {
        let addr = format!("{host}:{port}");
        // up while its connection is, at the address asked for: a P that died, or came back
        // elsewhere (restarted), is loaded again
        let current = match self.conns.get(peer) {
            Some(Conn::Up) => self.agent.peer_current(peer, &addr),
            Some(_) => true,
            None => false,
        };
        if current {
            return;
        }
        self.conns.insert(peer.to_owned(), Conn::Connecting);
        let (agent, tx, name) = (
            self.agent.clone(),
            self.handshakes.0.clone(),
            peer.to_owned(),
        );
        let spawned = crate::threads::spawn(format!("kvrail-load-{peer}"), move || {
            let r = agent.load_peer(&name, &addr);
            let _ = tx.send((name, r));
        });
        if let Err(e) = spawned {
            // asked again at the next step
            self.conns.remove(peer);
            tracing::warn!(%peer, error = %e, "no thread to connect to the peer");
        }
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
            self.leases.pin(&s.request_id, s.block_ids.clone(), now);
            if self.fence.on && self.cfg.direction == Direction::Pull {
                // D ranks ask for it before they READ; revoked when the lease ends
                let blocks = physical(&s.block_ids, own);
                let geo = (&self.layout, self.layers.as_slice());
                if let Err(e) =
                    (self.fence).grant(&self.agent, geo, &s.request_id, &blocks, RemoteAccess::READ)
                {
                    tracing::warn!(request = %s.request_id, error = %e, "no grant over the blocks");
                }
            }
            if let Some(w) = &self.writer {
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
            match self.cfg.direction {
                Direction::Pull => {
                    let recv = Recv {
                        req: r.clone(),
                        sources,
                        peer_heads,
                        xfers: Vec::new(),
                        posted: false,
                        error: None,
                        grants: HashMap::new(),
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

    /// Start what waited for a handshake: grant questions, READs, heartbeats and answers.
    fn pump(&mut self, now: Instant) {
        while let Ok((peer, r)) = self.handshakes.1.try_recv() {
            let conn = match r {
                Ok(()) => Conn::Up,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "handshake failed");
                    Conn::Failed(e)
                }
            };
            self.conns.insert(peer, conn);
        }
        // heartbeats whose P rank is up go now; a failed rank's are dropped
        let hbs = std::mem::take(&mut self.deferred);
        for (peer, msg) in hbs {
            match self.conns.get(&peer) {
                Some(Conn::Up) => {
                    if let Err(e) = self.agent.send_notif(&peer, msg) {
                        tracing::warn!(%peer, error = %e, "heartbeat");
                        self.conns.remove(&peer);
                    }
                }
                Some(Conn::Connecting) => self.deferred.push((peer, msg)),
                _ => {}
            }
        }
        let ids: Vec<String> = self
            .recvs
            .iter()
            .filter(|(_, r)| !r.posted)
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            let mut failed = None;
            let mut ready = true;
            for (peer, _) in &self.recvs[&id].sources {
                match self.conns.get(peer) {
                    Some(Conn::Up) => {}
                    Some(Conn::Failed(e)) => failed = Some(format!("handshake with {peer}: {e}")),
                    _ => ready = false,
                }
            }
            if let Some(e) = failed {
                self.fail_recv(&id, &e);
            } else if ready {
                match self.grants_ready(&id, now) {
                    Ok(true) => self.post_reads(&id),
                    Ok(false) => {}
                    Err(e) => self.fail_recv(&id, &e),
                }
            }
        }
        // what waited for a failed handshake has failed; the next request tries again
        // (the engine may be back)
        self.conns.retain(|_, c| !matches!(c, Conn::Failed(_)));
    }

    fn fail_recv(&mut self, id: &str, why: &str) {
        let _span = tracing::info_span!("request", id = %id).entered();
        tracing::warn!(request = %id, error = %why, "KV receive failed");
        if let Some(r) = self.recvs.remove(id) {
            // handshake again before the next READ from those ranks: their connections may
            // be gone (a restarted P at the same address is then found again)
            for (peer, _) in &r.sources {
                if matches!(self.conns.get(peer), Some(Conn::Up)) {
                    self.conns.remove(peer);
                }
            }
        }
        self.done.failed_recving.push(id.to_owned());
    }

    /// Post one READ per source rank. A rank whose READ cannot be posted fails the receive,
    /// reported once the READs already posted have ended.
    fn post_reads(&mut self, id: &str) {
        let _span = tracing::info_span!("request", id = %id).entered();
        let Some(r) = self.recvs.get(id) else {
            return;
        };
        let (req, sources, peer_heads) = (r.req.clone(), r.sources.clone(), r.peer_heads);
        let tokens: HashMap<String, Vec<u8>> = (r.grants.iter())
            .filter_map(|(p, g)| match g {
                Granted::Token(t) => Some((p.clone(), t.clone())),
                _ => None,
            })
            .collect();
        let mut xfers = Vec::new();
        let mut error = None;
        for (peer, slice) in &sources {
            let token = tokens.get(peer).map(Vec::as_slice);
            match self.post_read(&req, (peer, slice), peer_heads, token) {
                Ok(x) => xfers.push(x),
                Err(e) => {
                    error = Some(format!("READ from {peer}: {e}"));
                    break;
                }
            }
        }
        if let Some(r) = self.recvs.get_mut(id) {
            r.posted = true;
            r.xfers = xfers;
            r.error = error;
        }
    }

    fn post_read(
        &mut self,
        r: &RecvReq,
        (peer, slice): (&str, &HeadSlice),
        peer_heads: u64,
        token: Option<&[u8]>,
    ) -> Result<XferId, String> {
        let p = &r.params;
        // both lists are logical: each side's blocks as physical ones, by its own ratio
        // (P's from its handshake)
        let p_ratio = self
            .agent
            .remote_metadata(peer)
            .map_or(1, |m| u64::from(m.handshake.physical_per_logical));
        let remote_ids = physical(&p.remote_block_ids, p_ratio);
        let local_ids = physical(&r.local_block_ids, self.layout.physical_per_logical);
        let remote_blocks = self.layout.prompt_blocks(&remote_ids, r.tokens);
        let bs = u64::from(self.layout.block_size.max(1));
        let short = if r.tokens > 0 {
            (remote_blocks.len() as u64) < r.tokens.div_ceil(bs)
        } else {
            remote_blocks.len() < r.local_block_ids.len()
        };
        if short {
            return Err(format!(
                "P names {} blocks for a {}-token prompt ({} local blocks)",
                remote_ids.len(),
                r.tokens,
                local_ids.len()
            ));
        }
        // D's blocks past the prompt (for tokens it will generate) take no part
        let local = &local_ids[..local_ids.len().min(remote_blocks.len())];
        let pk = peer_kv(&self.agent, peer, &self.layout, peer_heads)?;
        let sel = Select {
            tokens: r.tokens,
            chunk: self.chunk,
            swa: self.cfg.swa_window_mode,
            first: None,
        };
        // D may hold a prefix already: the lists are aligned at their ends
        let (local, remote) =
            self.layout
                .transfer_descs(&self.layers, local, &pk, remote_blocks, slice, sel)?;
        let bytes: u64 = local.iter().map(|d| d.len).sum();
        let notif = Completion {
            request_id: p.remote_request_id.clone(),
            tp_size: self.tp_size,
        }
        .encode();
        // a fenced P rank's blocks are read through its grant
        let read = Post {
            op: XferOp::Read,
            local,
            peer,
            remote,
            notif: Some(notif),
            token,
        };
        let x = post(&self.agent, read)?;
        self.read_bytes += bytes;
        Ok(x)
    }

    /// Pull, D: whether every fenced P rank of receive `id` gave its grant (asking the ones
    /// not asked yet: every rank is connected by now).
    ///
    /// # Errors
    /// A rank refused, or did not answer within a lease.
    fn grants_ready(&mut self, id: &str, now: Instant) -> Result<bool, String> {
        let Some(r) = self.recvs.get_mut(id) else {
            return Ok(false);
        };
        let mut ready = true;
        for (peer, _) in &r.sources {
            let fenced = (self.agent.remote_metadata(peer))
                .is_some_and(|m| m.regions.iter().any(|m| m.fenced));
            if !fenced {
                continue;
            }
            match r.grants.get(peer) {
                None => {
                    let addr = self.agent.side_channel_addr();
                    let ask = GrantReq {
                        request_id: r.req.params.remote_request_id.clone(),
                        host: addr.ip().to_string(),
                        port: addr.port(),
                    };
                    self.agent
                        .send_notif(peer, ask.encode())
                        .map_err(|e| format!("asking {peer} for its grant: {e}"))?;
                    let until = now + Duration::from_secs(self.cfg.lease_duration_s.max(1));
                    r.grants.insert(peer.clone(), Granted::Asked(until));
                    ready = false;
                }
                Some(Granted::Asked(until)) if now >= *until => {
                    return Err(format!("{peer} gave no grant for the blocks in time"));
                }
                Some(Granted::Asked(_)) => ready = false,
                Some(Granted::Refused(why)) => return Err(format!("{peer} gives no grant: {why}")),
                Some(Granted::Token(_)) => {}
            }
        }
        Ok(ready)
    }

    /// Pull, D: a P rank's answer about its blocks of P's request `request`.
    fn granted(&mut self, peer: &str, request: &str, g: Granted) {
        for r in self.recvs.values_mut() {
            if r.req.params.remote_request_id == request && r.grants.contains_key(peer) {
                r.grants.insert(peer.to_owned(), g);
                return;
            }
        }
    }

    fn handle_msg(&mut self, from: &str, m: &[u8], now: Instant) {
        match KvMsg::decode(m) {
            Ok(KvMsg::GrantReq(r)) => {
                let wait = Duration::from_secs(self.cfg.lease_duration_s.max(1));
                if let Some((peer, host, port, msg)) = self.fence.answer(from, r, now, wait) {
                    self.connect(&peer, &host, port);
                    self.deferred.push((peer, msg));
                }
            }
            Ok(KvMsg::Grant(g)) => self.granted(from, &g.request_id, Granted::Token(g.token)),
            Ok(KvMsg::GrantNone(g)) => {
                self.granted(from, &g.request_id, Granted::Refused(g.reason));
            }
            Ok(KvMsg::Heartbeat(ids)) => {
                self.stats.heartbeats_in.inc();
                self.leases.handle_heartbeat(&ids, now);
            }
            Ok(KvMsg::Completion(c)) => match self.cfg.direction {
                // pull: D's READs finished; push: P's WRITEs into us finished
                Direction::Pull => {
                    self.leases.handle_completion(&c);
                }
                Direction::Push => self.receiver.handle_completion(&c),
            },
            // the writer's
            Ok(KvMsg::PushReg(_) | KvMsg::PushCancel(_) | KvMsg::PushCancelled(_)) => {}
            Err(e) => {
                self.malformed += 1;
                tracing::warn!(error = %e, "dropped a malformed notification");
            }
        }
    }

    /// Withdraw registration `id` from the P ranks (reported once they confirmed, or after
    /// `push_registration_timeout`); without a writer there is nothing to withdraw.
    fn withdraw(&mut self, id: &str, how: Withdrawn, now: Instant) {
        match &self.writer {
            Some(w) => {
                w.cancel(id, true);
                let t = Duration::from_secs(self.cfg.push_registration_timeout_s);
                self.cancels.insert(id.to_owned(), (now + t, how));
            }
            None => self.withdrawn(id.to_owned(), how),
        }
    }

    /// A withdrawn registration is over on every P rank (confirmed, or past the bound).
    fn withdrawn(&mut self, id: String, how: Withdrawn) {
        match how {
            Withdrawn::Aborted => self.done.sending.push(id),
            Withdrawn::Expired => self.done.failed_recving.push(id),
        }
    }

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
        std::mem::take(&mut self.done)
    }

    /// Everything a step does but report: take peers' notifications (grant questions,
    /// heartbeats, completions), start what waited, look at transfers, leases and
    /// withdrawals; what finished waits for the next [`Worker::get_finished`]. An engine
    /// that idles between requests (no steps) has it called while idle — P answers a D's
    /// grant question, frees blocks on D's completion, ends leases — by its own thread
    /// (the Python package does, woken by [`Agent::wait_for_notifs`](crate::agent::Agent::wait_for_notifs)).
    pub fn serve(&mut self, now: Instant) {
        // the agent routes PUSH_REG to the writer; everything else is the worker's
        for (from, m) in self.agent.get_new_notifs() {
            self.handle_msg(&from, &m, now);
        }
        let events = self.writer.as_ref().map(|w| {
            w.wake();
            w.events()
        });
        for ev in events.into_iter().flatten() {
            match ev {
                WriterEvent::Unparsed(from, m) => self.handle_msg(&from, &m, now),
                WriterEvent::Refused => self.malformed += 1,
                WriterEvent::Cancelled(id) => {
                    if let Some((_, how)) = self.cancels.remove(&id) {
                        self.withdrawn(id, how);
                    }
                }
                WriterEvent::Pushed(id, d_tp) => {
                    self.stats.pushed.inc();
                    // a WRITE and its completion are done: P frees once every D rank that
                    // takes its heads has been written
                    self.leases.handle_completion(&Completion {
                        request_id: id,
                        tp_size: d_tp,
                    });
                }
                WriterEvent::RegistrationFailed(id, why) => {
                    tracing::warn!(request = %id, error = %why, "push registration failed");
                    self.receiver.send_failed(&id);
                }
            }
        }
        for (peer, host, port, msg) in self.fence.due(now) {
            self.connect(&peer, &host, port);
            self.deferred.push((peer, msg));
        }
        self.pump(now);
        // pull receives: done when every READ ended; failed when one failed
        let ids: Vec<String> = self
            .recvs
            .iter()
            .filter(|(_, r)| r.posted)
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            let Some(r) = self.recvs.get_mut(&id) else {
                continue;
            };
            let mut still = Vec::new();
            for x in std::mem::take(&mut r.xfers) {
                match self.agent.status(x) {
                    Ok(XferStatus::InProgress) => still.push(x),
                    Ok(XferStatus::Done) => {
                        let _ = self.agent.release(x);
                    }
                    other => {
                        let _ = self.agent.release(x);
                        let why = match other {
                            Ok(XferStatus::Error(e)) => e.to_string(),
                            o => format!("{o:?}"),
                        };
                        r.error.get_or_insert(why);
                    }
                }
            }
            r.xfers = still;
            if r.xfers.is_empty() {
                match r.error.clone() {
                    Some(e) => self.fail_recv(&id, &e),
                    None => {
                        self.recvs.remove(&id);
                        self.done.recving.push(id);
                    }
                }
            }
        }
        // withdrawals no P rank confirmed in time: the blocks go back (P is unreachable)
        let late: Vec<String> = (self.cancels.iter())
            .filter(|(_, (t, _))| *t <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in late {
            tracing::warn!(request = %id, "no P rank confirmed the withdrawn registration in time; blocks given back");
            if let Some((_, how)) = self.cancels.remove(&id) {
                self.withdrawn(id, how);
            }
        }
        // push receives
        let (ok, failed) = self.receiver.get_finished();
        self.done.recving.extend(ok);
        self.done.failed_recving.extend(failed);
        // leases
        self.leases.handle_timeout(now);
        while let Some(LeaseEvent::Free {
            request_id, reason, ..
        }) = self.leases.poll_event()
        {
            match reason {
                crate::proto::lease::FreeReason::Expired => tracing::info!(
                    request = %request_id,
                    "lease expired: blocks freed (no completion or heartbeat from D in time)"
                ),
                crate::proto::lease::FreeReason::Completed => {
                    tracing::debug!(request = %request_id, "lease over: D has the blocks");
                }
            }
            match &self.writer {
                Some(w) => {
                    w.evict(&request_id);
                    // blocks a WRITE still reads are freed when it ends
                    if w.retire(&request_id) {
                        self.done.sending.push(request_id);
                    } else {
                        self.retiring.push(request_id);
                    }
                }
                None => self.done.sending.push(request_id),
            }
        }
        if let Some(w) = &self.writer {
            let (free, keep): (Vec<String>, Vec<String>) = std::mem::take(&mut self.retiring)
                .into_iter()
                .partition(|id| w.quiet(id));
            self.retiring = keep;
            self.done.sending.extend(free);
        }
        // blocks given back to the engine: nothing reaches them through a grant any more
        let d = &self.done;
        let back = d.sending.iter().chain(&d.recving).chain(&d.failed_recving);
        self.fence.release(&self.agent, back);
    }

    /// Grants over this worker's blocks not revoked yet (`fence_blocks`).
    pub fn grants_live(&self) -> usize {
        self.fence.live()
    }
}
