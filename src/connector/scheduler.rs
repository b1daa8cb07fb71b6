//! The scheduler side (one per engine): decides which requests load or keep KV, tracks
//! heartbeats from the moment a remote-prefill request enters the scheduler, arms the push
//! registration watchdog, and tells the workers what to do through [`ConnectorMetadata`].

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::config::{KvRole, KvTransferConfig};
use super::meta::{
    ConnectorMetadata, EngineRequest, Finished, HeartbeatOut, KvTransferParams, RecvReq, SendReq,
    StreamReq,
};
use crate::proto::handshake::Direction;
use crate::proto::lease::{HeartbeatAction, Heartbeats};

/// The scheduler side of a connector.
pub struct Scheduler {
    cfg: KvTransferConfig,
    engine_id: String,
    side_channel: SocketAddr,
    tp_size: u32,
    hb: Heartbeats,
    /// P engine → its side channel: host, rank 0's port, every rank's port (heartbeats).
    engines: HashMap<String, (String, u16, Vec<u16>)>,
    /// P: the side-channel port of each TP rank (empty: `side_channel`'s port + rank).
    rank_ports: Vec<u16>,
    pending_recv: Vec<RecvReq>,
    pending_send: Vec<SendReq>,
    /// push_stream: progress to announce, and the tokens each request announced.
    pending_stream: Vec<StreamReq>,
    streamed: HashMap<String, u64>,
    /// Push, D: registration watchdog deadlines.
    watchdog: HashMap<String, Instant>,
    expired: Vec<String>,
    /// P: requests whose blocks wait for D (freed by `update_connector_output`).
    sending: HashSet<String>,
    /// D, push: aborted requests whose registration is being withdrawn (their blocks wait
    /// for every P rank's confirmation), and those to tell the workers about.
    cancelling: HashSet<String>,
    cancels: Vec<String>,
    /// D: requests whose parameters cannot load from P (said once each, computed here).
    refused: HashSet<String>,
    /// `bidirectional_kv_xfer`, P: the tokens a read-back request had cached here when the
    /// engine asked (its local blocks begin after them).
    computed: HashMap<String, u64>,
    /// `bidirectional_kv_xfer`, D: decoded requests whose blocks are kept for a read-back
    /// (given back by the workers' report, at their TTL or once read).
    kept: HashSet<String>,
    /// Added to this host's clock (tests: a keeper whose clock is skewed).
    clock_skew_us: i64,
}

/// How a request ended, for [`Scheduler::request_finished_as`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestEnd {
    /// It ran to its end (a stop condition or its length), not aborted or failed.
    pub completed: bool,
    /// Tokens whose KV is in its blocks (vLLM's `num_computed_tokens`).
    pub computed_tokens: u64,
}

impl Scheduler {
    /// A scheduler for engine `engine_id`, whose workers' side channel is `side_channel`.
    pub fn new(
        cfg: KvTransferConfig,
        engine_id: &str,
        side_channel: SocketAddr,
        tp_size: u32,
    ) -> Self {
        Self {
            hb: Heartbeats::new(Duration::from_secs(cfg.lease_duration_s)),
            cfg,
            engine_id: engine_id.to_owned(),
            side_channel,
            tp_size,
            engines: HashMap::new(),
            rank_ports: Vec::new(),
            pending_recv: Vec::new(),
            pending_send: Vec::new(),
            pending_stream: Vec::new(),
            streamed: HashMap::new(),
            watchdog: HashMap::new(),
            expired: Vec::new(),
            sending: HashSet::new(),
            cancelling: HashSet::new(),
            cancels: Vec::new(),
            refused: HashSet::new(),
            computed: HashMap::new(),
            kept: HashSet::new(),
            clock_skew_us: 0,
        }
    }

    /// Tests: this scheduler's clock runs `skew_us` ahead of the host's (behind, negative),
    /// as another host's would.
    #[doc(hidden)]
    pub fn skew_clock(&mut self, skew_us: i64) {
        self.clock_skew_us = skew_us;
    }

    /// P with TP above 1: the side-channel port of each rank's worker, when they are not
    /// `side_channel`'s port + rank. They travel to D in the transfer parameters.
    pub fn set_rank_ports(&mut self, ports: Vec<u16>) {
        self.rank_ports = ports;
    }

    /// Loads KV: D, or (`bidirectional_kv_xfer`) P reading a turn back.
    fn consumes(&self) -> bool {
        self.cfg.role != KvRole::Producer || self.cfg.bidirectional_kv_xfer
    }

    /// Keeps KV for a peer: P, or (`bidirectional_kv_xfer`) D keeping a turn.
    fn produces(&self) -> bool {
        self.cfg.role != KvRole::Consumer || self.cfg.bidirectional_kv_xfer
    }

    /// `req`'s parameters, when they ask this engine to read a previous turn's KV back.
    fn read_back<'a>(&self, req: &'a EngineRequest) -> Option<&'a KvTransferParams> {
        let by_name = self.cfg.metadata_store.is_some();
        (req.params.as_ref()).filter(|p| self.cfg.bidirectional_kv_xfer && p.reads_back(by_name))
    }

    /// The tokens a read-back brings beyond `num_computed`: the remote's, up to the prompt
    /// (the new turn computes the rest); none under `kv_recompute_threshold`.
    fn read_back_tokens(&self, p: &KvTransferParams, prompt: u64, num_computed: u64) -> u64 {
        let n = p.remote_num_tokens.min(prompt).saturating_sub(num_computed);
        if n < self.cfg.kv_recompute_threshold {
            return 0;
        }
        n
    }

    /// A request entered the engine's scheduler (its waiting queue). A remote-prefill
    /// request starts its heartbeats here (seed 003): it may wait in the queue far longer
    /// than a lease, and P must keep its blocks meanwhile. Returns whether it is tracked.
    pub fn on_new_request(&mut self, req: &EngineRequest, now: Instant) -> bool {
        if let Some(p) = self.read_back(req) {
            // D keeps the blocks for its TTL; heartbeats keep them while the turn waits here
            self.track(&req.request_id, p, now);
            return true;
        }
        let Some(p) = req
            .params
            .as_ref()
            .filter(|p| p.do_remote_prefill && self.consumes())
        else {
            return false;
        };
        let by_name = self.cfg.metadata_store.is_some();
        if let Some(why) = p.load_problem(self.cfg.direction == Direction::Pull, by_name) {
            // nothing is loaded from (or for) an engine the parameters do not name whole: the
            // request's prompt is computed here
            if self.refused.insert(req.request_id.clone()) {
                tracing::error!(request = %req.request_id, "{why}; the prompt is computed here instead");
            }
            return false;
        }
        let p = p.clone();
        self.track(&req.request_id, &p, now);
        true
    }

    /// Heartbeats for `id` to the engine its parameters `p` name.
    fn track(&mut self, id: &str, p: &KvTransferParams, now: Instant) {
        let ports = (0..p.p_tp()).map(|k| p.rank_port(k)).collect();
        self.engines.insert(
            p.remote_engine_id.clone(),
            (p.remote_host.clone(), p.remote_port, ports),
        );
        self.hb
            .track(id, &p.remote_engine_id, &p.remote_request_id, now);
    }

    /// Tokens the connector will load for `req` beyond `num_computed`, and whether they load
    /// asynchronously. Tracks the request's heartbeats too, for an engine that has no
    /// [`Scheduler::on_new_request`] hook.
    pub fn get_num_new_matched_tokens(
        &mut self,
        req: &EngineRequest,
        num_computed: u64,
        now: Instant,
    ) -> (u64, bool) {
        if let Some(p) = self.read_back(req) {
            let n = self.read_back_tokens(p, req.prompt_tokens, num_computed);
            if n == 0 {
                // computed here: nothing to wait for (D's blocks go at their TTL)
                self.hb.untrack(&req.request_id);
                return (0, false);
            }
            self.on_new_request(req, now);
            self.computed.insert(req.request_id.clone(), num_computed);
            return (n, true);
        }
        if !self.on_new_request(req, now) {
            return (0, false);
        }
        (req.prompt_tokens.saturating_sub(num_computed), true)
    }

    /// Whether push work is under way (seed 000): P holds finished requests for D or has
    /// blocks to announce, D waits for registrations to complete. While it is, the engine
    /// keeps stepping so the workers (and P's writer) get their turn each step.
    ///
    /// Pull too, while sends or receives wait to be shipped to the workers: an engine that
    /// just finished its last request (P after a prefill) takes one more step, so its
    /// workers learn which blocks D will read (and answer D's grant question) without
    /// waiting for another request.
    pub fn has_pending_push_work(&self) -> bool {
        if !self.pending_send.is_empty() || !self.pending_recv.is_empty() {
            return true;
        }
        self.cfg.direction == Direction::Push
            && (!self.sending.is_empty()
                || !self.pending_send.is_empty()
                || !self.pending_stream.is_empty()
                || !self.pending_recv.is_empty()
                || !self.watchdog.is_empty()
                || !self.expired.is_empty()
                || !self.cancelling.is_empty())
    }

    /// Blocks were allocated for `req`; with external tokens to load, the workers receive
    /// into `block_ids` (push: the registration's watchdog starts now).
    pub fn update_state_after_alloc(
        &mut self,
        req: &EngineRequest,
        block_ids: Vec<u64>,
        num_external_tokens: u64,
        now: Instant,
    ) {
        if let Some(p) = self.read_back(req) {
            let computed = self.computed.remove(&req.request_id).unwrap_or(0);
            if num_external_tokens > 0 {
                self.pending_recv.push(RecvReq {
                    request_id: req.request_id.clone(),
                    local_block_ids: block_ids,
                    params: p.clone(),
                    tokens: p.remote_num_tokens.min(req.prompt_tokens),
                    read_back: true,
                    computed,
                });
            }
            return;
        }
        let Some(p) = req.params.as_ref().filter(|p| p.do_remote_prefill) else {
            return;
        };
        if num_external_tokens == 0 || !self.consumes() {
            return;
        }
        if self.cfg.direction == Direction::Push {
            let t = Duration::from_secs(self.cfg.push_registration_timeout_s);
            self.watchdog.insert(req.request_id.clone(), now + t);
        }
        self.pending_recv.push(RecvReq {
            request_id: req.request_id.clone(),
            local_block_ids: block_ids,
            params: p.clone(),
            tokens: req.prompt_tokens,
            read_back: false,
            computed: 0,
        });
    }

    /// P in push mode with `push_stream`: after a prefill step, `req` has the KV of
    /// `computed` prompt tokens in its cache (the forward that computed them has finished),
    /// in `block_ids` (its blocks so far). The blocks that closed go to D with the next
    /// metadata, as soon as D's registration is there; the rest when the request finishes.
    /// Without `push_stream` (or not a prefill for a remote decode) this does nothing.
    pub fn prefill_progress(&mut self, req: &EngineRequest, block_ids: &[u64], computed: u64) {
        let remote_decode = req.params.as_ref().is_some_and(|p| p.do_remote_decode);
        if !self.cfg.push_stream || !remote_decode || !self.produces() {
            return;
        }
        let last = self.streamed.entry(req.request_id.clone()).or_default();
        if computed > *last {
            *last = computed;
            self.pending_stream.push(StreamReq {
                request_id: req.request_id.clone(),
                block_ids: block_ids.to_vec(),
                computed,
                tokens: req.prompt_tokens,
            });
        }
    }

    /// This step's instructions for the workers.
    pub fn build_connector_meta(&mut self, now: Instant) -> ConnectorMetadata {
        let mut heartbeats = Vec::new();
        self.hb.handle_timeout(now);
        while let Some(a) = self.hb.poll_action() {
            match a {
                // the workers handshake on their own when they must send to an engine
                HeartbeatAction::Handshake { engine } => self.hb.handshake_done(&engine, true),
                HeartbeatAction::Send {
                    engine, message, ..
                } => {
                    if let Some((host, port, ports)) = self.engines.get(&engine) {
                        heartbeats.push(HeartbeatOut {
                            engine: engine.clone(),
                            host: host.clone(),
                            port: *port,
                            ports: ports.clone(),
                            message,
                        });
                    }
                }
            }
        }
        let mut gone: Vec<String> = self
            .watchdog
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|(k, _)| k.clone())
            .collect();
        gone.sort();
        for id in &gone {
            self.watchdog.remove(id);
            tracing::warn!(
                request = %id,
                timeout_s = self.cfg.push_registration_timeout_s,
                "push registration saw no completion in time; withdrawn from P, and the \
                 request's receive fails (failed_recving)"
            );
        }
        self.expired.extend(gone);
        ConnectorMetadata {
            reqs_to_recv: std::mem::take(&mut self.pending_recv),
            reqs_to_send: std::mem::take(&mut self.pending_send),
            reqs_streaming: std::mem::take(&mut self.pending_stream),
            heartbeats,
            expired_registrations: std::mem::take(&mut self.expired),
            cancel_registrations: std::mem::take(&mut self.cancels),
        }
    }

    /// `req` finished on this engine. On P (`do_remote_decode`) its blocks stay allocated
    /// (`true`) under a lease for D, and the returned parameters go to the proxy for D. On D
    /// in push mode, a request aborted while its registration is out keeps its blocks too
    /// (`true`): P is told to drop the registration, and the workers report the request in
    /// `sending` once every P rank confirmed that nothing of it will be written any more.
    pub fn request_finished(
        &mut self,
        req: &EngineRequest,
        block_ids: &[u64],
    ) -> (bool, Option<KvTransferParams>) {
        self.request_finished_as(req, block_ids, RequestEnd::default())
    }

    /// [`Scheduler::request_finished`], told how the request ended. With
    /// `bidirectional_kv_xfer`, D keeps the blocks of a decode leg that ran to its end
    /// (`true`) for `decoder_kv_blocks_ttl` and returns the parameters of the next turn:
    /// `do_remote_decode` with D's engine, side channel, blocks and request id, the tokens
    /// they hold (`remote_num_tokens`) and when D gives them back
    /// (`remote_blocks_expiry_time`, D's monotonic clock in seconds).
    pub fn request_finished_as(
        &mut self,
        req: &EngineRequest,
        block_ids: &[u64],
        end: RequestEnd,
    ) -> (bool, Option<KvTransferParams>) {
        self.computed.remove(&req.request_id);
        let decode_leg = req.params.as_ref().is_some_and(|p| !p.do_remote_decode);
        let keep = self.cfg.bidirectional_kv_xfer
            && self.cfg.role != KvRole::Producer
            && decode_leg
            && end.completed
            && end.computed_tokens > 0
            && !block_ids.is_empty()
            && !self.watchdog.contains_key(&req.request_id)
            && !self
                .pending_recv
                .iter()
                .any(|r| r.request_id == req.request_id);
        if keep {
            return self.keep_for_next_turn(req, block_ids, end.computed_tokens);
        }
        if self.cfg.direction == Direction::Push && self.consumes() {
            let id = &req.request_id;
            if let Some(i) = self.pending_recv.iter().position(|r| &r.request_id == id) {
                // never reached the workers: nothing was registered
                self.pending_recv.remove(i);
                self.watchdog.remove(id);
            } else if self.watchdog.remove(id).is_some() {
                self.hb.untrack(id);
                self.cancelling.insert(id.clone());
                self.cancels.push(id.clone());
                return (true, None);
            }
        }
        self.hb.untrack(&req.request_id);
        self.watchdog.remove(&req.request_id);
        self.streamed.remove(&req.request_id);
        self.refused.remove(&req.request_id);
        let remote_decode = req.params.as_ref().is_some_and(|p| p.do_remote_decode);
        if !remote_decode || !self.produces() {
            return (false, None);
        }
        self.sending.insert(req.request_id.clone());
        self.pending_send.push(SendReq {
            request_id: req.request_id.clone(),
            block_ids: block_ids.to_vec(),
            tokens: req.prompt_tokens,
            keep_s: None,
        });
        let mut params = self.own_params(&req.request_id, block_ids);
        params.do_remote_prefill = true;
        (true, Some(params))
    }

    /// D, `bidirectional_kv_xfer`: keep `req`'s blocks for a read-back.
    fn keep_for_next_turn(
        &mut self,
        req: &EngineRequest,
        block_ids: &[u64],
        computed: u64,
    ) -> (bool, Option<KvTransferParams>) {
        let id = &req.request_id;
        self.hb.untrack(id);
        self.streamed.remove(id);
        self.refused.remove(id);
        let ttl = self.cfg.decoder_kv_blocks_ttl_s;
        let now_us = super::clock::now_us() + self.clock_skew_us;
        let expiry = (now_us as f64) / 1e6 + ttl as f64;
        self.kept.insert(id.clone());
        self.pending_send.push(SendReq {
            request_id: id.clone(),
            block_ids: block_ids.to_vec(),
            tokens: computed,
            keep_s: Some(ttl),
        });
        let mut params = self.own_params(id, block_ids);
        params.do_remote_decode = true;
        params.remote_num_tokens = computed;
        params.remote_blocks_expiry_time = Some(expiry);
        (true, Some(params))
    }

    /// Parameters naming this engine's blocks `block_ids` of request `id`.
    fn own_params(&self, id: &str, block_ids: &[u64]) -> KvTransferParams {
        KvTransferParams {
            remote_engine_id: self.engine_id.clone(),
            remote_host: self.side_channel.ip().to_string(),
            remote_port: self.side_channel.port(),
            remote_block_ids: block_ids.to_vec(),
            remote_request_id: id.to_owned(),
            tp_size: self.tp_size,
            remote_ports: self.rank_ports.clone(),
            ..KvTransferParams::default()
        }
    }

    /// The workers' report: P frees `sending` (the engine returns the blocks); D stops
    /// heartbeating and watching what arrived or failed.
    ///
    /// D, push: a receive that ended in the same step as the engine finished its request
    /// needs no withdrawal. vLLM fails a request whose KV did not load (policy `fail`) and
    /// calls [`Scheduler::request_finished`] before it reads this report, so the request
    /// looked aborted with its registration out. The report frees it in vLLM: a `sending`
    /// for it later would name a request vLLM no longer has, and vLLM asserts on that (a D
    /// behind vllm-router died so when a P was killed under load).
    pub fn update_connector_output(&mut self, f: &Finished) {
        for id in &f.sending {
            self.sending.remove(id);
            self.cancelling.remove(id);
            self.kept.remove(id);
        }
        for id in f.recving.iter().chain(&f.failed_recving) {
            self.hb.untrack(id);
            self.watchdog.remove(id);
            if self.cancelling.remove(id) {
                self.cancels.retain(|c| c != id);
            }
        }
    }

    /// Requests with heartbeats running.
    pub fn heartbeating(&self) -> usize {
        self.hb.tracked()
    }

    /// P: requests whose blocks wait for D.
    pub fn held(&self) -> usize {
        self.sending.len()
    }

    /// D, `bidirectional_kv_xfer`: decoded requests whose blocks are kept for a read-back.
    pub fn kept(&self) -> usize {
        self.kept.len()
    }
}

#[cfg(test)]
mod tests;
