//! The worker side (one per TP rank; here TP 1, the agent named after the engine): owns the
//! agent and the registered KV cache; P holds finished requests under leases and frees them
//! on completions or expiry; D READs (pull) or registers and waits for P's WRITEs (push),
//! and sends heartbeats. Handshakes run on helper threads and never block a step.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::config::KvTransferConfig;
use super::layout::{remote_regions, KvLayout};
use super::meta::{ConnectorMetadata, Finished, HeartbeatOut, RecvReq};
use super::writer::{Writer, WriterEvent};
use crate::agent::{Agent, AgentError, RegionId, RemoteAccess, XferId, XferOp, XferStatus};
use crate::proto::handshake::Direction;
use crate::proto::kvmsg::{Completion, KvMsg};
use crate::proto::lease::{LeaseEvent, Leases};
use crate::proto::push::PushReceiver;
use crate::proto::select::chunk_tokens;

/// A finished handshake: the engine, and the outcome.
type Handshake = (String, Result<(), String>);

/// A peer engine's connection state.
enum Conn {
    Connecting,
    Up,
    Failed(String),
}

/// A pull receive.
struct Recv {
    req: RecvReq,
    xfer: Option<XferId>,
}

/// The worker side of a connector.
pub struct Worker {
    agent: Arc<Agent>,
    cfg: KvTransferConfig,
    layout: KvLayout,
    regions: Vec<RegionId>,
    tp_size: u32,
    leases: Leases,
    conns: HashMap<String, Conn>,
    handshakes: (mpsc::Sender<Handshake>, mpsc::Receiver<Handshake>),
    /// Pull, D: receives by request id.
    recvs: HashMap<String, Recv>,
    /// Heartbeats waiting for their engine's handshake.
    deferred_hb: Vec<HeartbeatOut>,
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
    /// Notifications that did not parse (dropped).
    pub malformed: u64,
}

impl Worker {
    /// A worker over `agent` (named after the engine), registering one region per layer of
    /// `layout`.
    ///
    /// # Errors
    /// What registering the KV cache returns.
    pub fn new(
        agent: Arc<Agent>,
        cfg: KvTransferConfig,
        layout: KvLayout,
        tp_size: u32,
    ) -> Result<Self, AgentError> {
        let access = match cfg.direction {
            Direction::Pull => RemoteAccess::READ,
            Direction::Push => RemoteAccess::WRITE,
        };
        let regions = layout
            .layers
            .iter()
            .map(|l| agent.register(layout.layer_bytes() as usize, access, vec![l.clone()]))
            .collect::<Result<Vec<_>, _>>()?;
        let chunk = cfg.chunk_mode.then(|| {
            let bs = u64::from(layout.block_size);
            chunk_tokens(bs, cfg.chunk_tokens.unwrap_or(bs))
        });
        let writer = (cfg.direction == Direction::Push).then(|| {
            Writer::start(
                agent.clone(),
                layout.clone(),
                regions.clone(),
                tp_size,
                chunk,
            )
        });
        Ok(Self {
            leases: Leases::new(Duration::from_secs(cfg.lease_duration_s), tp_size),
            // the scheduler runs the registration watchdog; this one never fires first
            receiver: PushReceiver::new(
                Duration::from_secs(cfg.push_registration_timeout_s.saturating_mul(2)),
                tp_size,
            ),
            agent,
            cfg,
            layout,
            regions,
            tp_size,
            conns: HashMap::new(),
            handshakes: mpsc::channel(),
            recvs: HashMap::new(),
            deferred_hb: Vec::new(),
            retiring: Vec::new(),
            writer: writer.transpose()?,
            done: Finished::default(),
            chunk,
            read_bytes: 0,
            malformed: 0,
        })
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

    /// Start a handshake with `engine` at `host:port` on a helper thread (once).
    fn connect(&mut self, engine: &str, host: &str, port: u16) {
        if self.conns.contains_key(engine) {
            return;
        }
        self.conns.insert(engine.to_owned(), Conn::Connecting);
        let (agent, tx, engine, addr) = (
            self.agent.clone(),
            self.handshakes.0.clone(),
            engine.to_owned(),
            format!("{host}:{port}"),
        );
        std::thread::spawn(move || {
            let r = addr
                .parse::<SocketAddr>()
                .map_err(|e| format!("{addr}: {e}"))
                .and_then(|a| agent.load_remote(a).map_err(|e| e.to_string()))
                .and_then(|name| {
                    if name == engine {
                        Ok(())
                    } else {
                        Err(format!("{addr} is engine {name:?}, expected {engine:?}"))
                    }
                });
            let _ = tx.send((engine, r));
        });
    }

    /// This step's work from the scheduler (call once per step).
    pub fn start_load_kv(&mut self, meta: &ConnectorMetadata, now: Instant) {
        for s in &meta.reqs_to_send {
            self.leases.pin(&s.request_id, s.block_ids.clone(), now);
            if let Some(w) = &self.writer {
                w.finished(&s.request_id, s.block_ids.clone(), s.tokens);
            }
        }
        for r in &meta.reqs_to_recv {
            let p = &r.params;
            match self.cfg.direction {
                Direction::Pull => {
                    self.recvs.insert(
                        r.request_id.clone(),
                        Recv {
                            req: r.clone(),
                            xfer: None,
                        },
                    );
                }
                Direction::Push => {
                    self.receiver.registered(&r.request_id, now);
                    if let Some(w) = &self.writer {
                        w.register(r.clone());
                    }
                }
            }
            self.connect(&p.remote_engine_id, &p.remote_host, p.remote_port);
        }
        for id in &meta.expired_registrations {
            // the scheduler's watchdog gave up: no longer watched, no longer re-sent
            self.receiver.forget(id);
            if let Some(w) = &self.writer {
                w.forget_registration(id);
            }
        }
        for hb in &meta.heartbeats {
            self.connect(&hb.engine, &hb.host, hb.port);
            self.deferred_hb.push(hb.clone());
        }
        self.pump();
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

    /// Start what waited for a handshake: READs, heartbeats.
    fn pump(&mut self) {
        while let Ok((engine, r)) = self.handshakes.1.try_recv() {
            let conn = match r {
                Ok(()) => Conn::Up,
                Err(e) => {
                    tracing::warn!(%engine, "handshake failed: {e}");
                    Conn::Failed(e)
                }
            };
            self.conns.insert(engine, conn);
        }
        // heartbeats whose engine is up go now; a failed engine's are dropped
        let hbs = std::mem::take(&mut self.deferred_hb);
        for hb in hbs {
            match self.conns.get(&hb.engine) {
                Some(Conn::Up) => {
                    if let Err(e) = self.agent.send_notif(&hb.engine, hb.message) {
                        tracing::warn!(engine = %hb.engine, "heartbeat: {e}");
                        self.conns.remove(&hb.engine);
                    }
                }
                Some(Conn::Connecting) => self.deferred_hb.push(hb),
                _ => {}
            }
        }
        let ids: Vec<String> = self
            .recvs
            .iter()
            .filter(|(_, r)| r.xfer.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            let engine = self.recvs[&id].req.params.remote_engine_id.clone();
            match self.conns.get(&engine) {
                Some(Conn::Up) => {
                    if let Err(e) = self.post_read(&id) {
                        self.fail_recv(&id, &e);
                    }
                }
                Some(Conn::Failed(e)) => {
                    let e = format!("handshake with {engine}: {e}");
                    self.fail_recv(&id, &e);
                }
                _ => {}
            }
        }
        // what waited for a failed handshake has failed; the next request tries again
        // (the engine may be back)
        self.conns.retain(|_, c| !matches!(c, Conn::Failed(_)));
    }

    fn fail_recv(&mut self, id: &str, why: &str) {
        tracing::warn!(request = %id, "KV receive failed: {why}");
        if let Some(r) = self.recvs.remove(id) {
            // handshake again before the next READ from that engine: its connection may be
            // gone (a restarted P at the same address is then found again)
            if matches!(
                self.conns.get(&r.req.params.remote_engine_id),
                Some(Conn::Up)
            ) {
                self.conns.remove(&r.req.params.remote_engine_id);
            }
        }
        self.done.failed_recving.push(id.to_owned());
    }

    fn post_read(&mut self, id: &str) -> Result<(), String> {
        let r = &self.recvs[id].req;
        let p = &r.params;
        let n = r.local_block_ids.len();
        if p.remote_block_ids.len() < n {
            return Err(format!(
                "{} remote blocks for {n} local ones",
                p.remote_block_ids.len()
            ));
        }
        // D may hold a prefix already: the last n remote blocks fill the n local ones
        let remote_blocks = &p.remote_block_ids[p.remote_block_ids.len() - n..];
        let remote_regions = remote_regions(&self.agent, &p.remote_engine_id, &self.layout)?;
        let (local, remote) = self.layout.request_descs(
            &self.regions,
            &r.local_block_ids,
            &remote_regions,
            remote_blocks,
            r.tokens,
            self.chunk,
        );
        let bytes: u64 = local.iter().map(|d| d.len).sum();
        let notif = Completion {
            request_id: p.remote_request_id.clone(),
            tp_size: self.tp_size,
        }
        .encode();
        let x = self
            .agent
            .create_xfer(
                XferOp::Read,
                local,
                &p.remote_engine_id,
                remote,
                Some(notif),
            )
            .map_err(|e| e.to_string())?;
        self.agent.post(x).map_err(|e| e.to_string())?;
        self.read_bytes += bytes;
        if let Some(r) = self.recvs.get_mut(id) {
            r.xfer = Some(x);
        }
        Ok(())
    }

    fn handle_msg(&mut self, m: &[u8], now: Instant) {
        match KvMsg::decode(m) {
            Ok(KvMsg::Heartbeat(ids)) => {
                self.leases.handle_heartbeat(&ids, now);
            }
            Ok(KvMsg::Completion(c)) => match self.cfg.direction {
                // pull: D's READs finished; push: P's WRITEs into us finished
                Direction::Pull => {
                    self.leases.handle_completion(&c);
                }
                Direction::Push => self.receiver.handle_completion(&c),
            },
            Ok(KvMsg::PushReg(_)) => {} // the writer's
            Err(e) => {
                self.malformed += 1;
                tracing::warn!("dropped a malformed notification: {e}");
            }
        }
    }

    /// What finished since the last call (call once per step).
    pub fn get_finished(&mut self, now: Instant) -> Finished {
        match &self.writer {
            None => {
                for (_, m) in self.agent.get_new_notifs() {
                    self.handle_msg(&m, now);
                }
            }
            Some(w) => {
                w.wake();
                for ev in w.events() {
                    match ev {
                        WriterEvent::Notif(m) => self.handle_msg(&m, now),
                        WriterEvent::Pushed(id) => {
                            // the WRITE and its completion are done: P frees now
                            if self.leases.abort(&id) {
                                self.done.sending.push(id);
                            }
                        }
                        WriterEvent::RegistrationFailed(id, why) => {
                            tracing::warn!(request = %id, "push registration failed: {why}");
                            self.receiver.send_failed(&id);
                        }
                    }
                }
            }
        }
        self.pump();
        // pull receives
        let ids: Vec<(String, XferId)> = self
            .recvs
            .iter()
            .filter_map(|(k, r)| r.xfer.map(|x| (k.clone(), x)))
            .collect();
        for (id, x) in ids {
            match self.agent.status(x) {
                Ok(XferStatus::InProgress) => {}
                Ok(XferStatus::Done) => {
                    let _ = self.agent.release(x);
                    self.recvs.remove(&id);
                    self.done.recving.push(id);
                }
                other => {
                    let _ = self.agent.release(x);
                    let why = match other {
                        Ok(XferStatus::Error(e)) => e,
                        o => format!("{o:?}"),
                    };
                    self.fail_recv(&id, &why);
                }
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
            tracing::debug!(request = %request_id, ?reason, "lease over");
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
        std::mem::take(&mut self.done)
    }
}
