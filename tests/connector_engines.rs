//! Engines of several ranks end to end, on both backends (TCP here, verbs in the lab):
//! - heterogeneous tensor parallelism (SPEC §3): P and D TP sizes differ, each rank its own
//!   worker and agent (`<engine>#tp<k>` at its advertised port). Every byte of every head of
//!   every layer lands in the right D rank, pull and push; P and D caches differ in block
//!   count; P frees every block only after every D rank that takes its heads has its bytes;
//!   D heartbeats every P rank of a request waiting in its queue (each rank's lease extended);
//! - `push_stream`: the blocks a prefill step closes reach D before the prefill ends, D is
//!   told only when every byte landed, and each block crosses once;
//! - `swa_window_mode`: a sliding-window layer moves only its window; D has every byte it
//!   attends to, and fewer bytes cross (counted).
//!
//! `KVRAIL_CONNECTOR_ETCD=1`: the same in metadata-store mode (P's parameters name its
//! engine and TP size only; D finds every P rank, `<engine>#tp<k>`, through etcd).

#[path = "etcd/mod.rs"]
mod etcd;
mod lab;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::Agent;
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::tp::rank_agent_name;
use kvrail::connector::{
    agent_config, BlockOrder, ConnectorMetadata, EngineRequest, Finished, KvLayout,
    KvTransferParams, Scheduler, Worker,
};
use lab::cache::{self, Cache, EngineCache};

/// KV heads of the model (split over the ranks).
const HEADS: u64 = 8;
/// Bytes of one token of one head.
const HEAD_BYTES: u64 = 8;
const BLOCK: u64 = 16;
const LAYERS: usize = 3;

/// The layer with a sliding window, when the model has one.
const SWA_LAYER: usize = 1;

fn layer_name(i: usize) -> String {
    format!("model.layers.{i}.attn")
}

fn layout(tp: u32, num_blocks: u64, window: Option<u64>) -> KvLayout {
    let heads = HEADS / u64::from(tp);
    KvLayout {
        layers: (0..LAYERS).map(layer_name).collect(),
        num_blocks,
        block_bytes: heads * BLOCK * HEAD_BYTES,
        planes: 2,
        block_size: BLOCK as u32,
        kv_heads: heads,
        sliding_windows: window
            .map(|w| (layer_name(SWA_LAYER), w))
            .into_iter()
            .collect(),
        physical_per_logical: 1,
        block_stride: 0,
        inner: BlockOrder::Hnd,
    }
}

/// The model's KV byte for (request seed, layer, plane, global head, token, byte).
fn val(seed: u64, layer: usize, plane: u64, head: u64, tok: u64, i: u64) -> u8 {
    let x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ ((layer as u64) << 48)
        ^ (plane << 44)
        ^ (head << 36)
        ^ (tok << 8)
        ^ i;
    (x.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 56) as u8
}

/// Block `bi` of a request of `tokens` tokens, as rank `rank` (of `tp`) holds it.
fn block(seed: u64, layer: usize, plane: u64, rank: u32, tp: u32, bi: u64, tokens: u64) -> Vec<u8> {
    let heads = HEADS / u64::from(tp);
    let mut v = vec![0u8; (heads * BLOCK * HEAD_BYTES) as usize];
    for h in 0..heads {
        for t in 0..BLOCK {
            let tok = bi * BLOCK + t;
            if tok >= tokens {
                continue;
            }
            for i in 0..HEAD_BYTES {
                let g = u64::from(rank) * heads + h;
                v[((h * BLOCK + t) * HEAD_BYTES + i) as usize] = val(seed, layer, plane, g, tok, i);
            }
        }
    }
    v
}

/// An engine of `tp` ranks: one scheduler, one worker (and agent) per rank.
struct Engine {
    sched: Scheduler,
    workers: Vec<Worker>,
    /// Each rank's own cache (None: kvrail allocated it).
    own: Vec<Option<EngineCache>>,
    tp: u32,
    next_block: u64,
    /// Per request: how many ranks reported it (sending / recving), and failures.
    reports: HashMap<String, u32>,
}

fn engine(name: &str, dir: &str, role: &str, tp: u32, num_blocks: u64, host_a: bool) -> Engine {
    engine_with(
        name,
        dir,
        role,
        (tp, num_blocks, Cache::Agent),
        host_a,
        "",
        None,
    )
}

/// An engine of `tp` ranks whose caches are `cache` (each rank's own), with `extra`
/// settings (JSON members) and a model whose layer `SWA_LAYER` has a sliding `window`.
fn engine_with(
    name: &str,
    dir: &str,
    role: &str,
    (tp, num_blocks, cache): (u32, u64, Cache),
    host_a: bool,
    extra: &str,
    window: Option<u64>,
) -> Engine {
    let json = format!(
        r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}","kv_buffer_device":"{}",
            "kv_connector_extra_config":{{"kv_lease_duration":30{extra}}}}}"#,
        cache.buffer_device()
    );
    let cfg = KvTransferConfig::from_json(&etcd::with_store(&json)).unwrap();
    let l = layout(tp, num_blocks, window);
    let (workers, own): (Vec<Worker>, Vec<Option<EngineCache>>) = (0..tp)
        .map(|rank| {
            let ac = agent_config(&cfg, &l, lab::agent_config(host_a));
            let agent = Arc::new(Agent::new(&rank_agent_name(name, rank), ac).unwrap());
            assert_eq!(agent.store_up(), etcd::mode().then_some(true), "store mode");
            let (own, caches) = EngineCache::new(cache, &l, rank as i32 % 2);
            let w = Worker::with_caches(agent, cfg.clone(), l.clone(), (rank, tp), caches);
            (w.unwrap(), own)
        })
        .unzip();
    let addr = workers[0].agent().side_channel_addr();
    let mut sched = Scheduler::new(cfg, name, addr, tp);
    sched.set_rank_ports(
        workers
            .iter()
            .map(|w| w.agent().side_channel_addr().port())
            .collect(),
    );
    Engine {
        sched,
        workers,
        own,
        tp,
        next_block: 3,
        reports: HashMap::new(),
    }
}

impl Engine {
    /// One engine step: every rank runs the same metadata; a request is finished for the
    /// scheduler once every rank reported it, failed once any rank failed it.
    fn step(&mut self, now: Instant) -> Finished {
        let m = ConnectorMetadata::decode(&self.sched.build_connector_meta(now).encode()).unwrap();
        let mut out = Finished::default();
        for w in &mut self.workers {
            w.start_load_kv(&m, now);
            let f = w.get_finished(now);
            for id in f.sending.iter().chain(&f.recving) {
                let n = self.reports.entry(id.clone()).or_default();
                *n += 1;
                if *n == self.tp {
                    if f.sending.contains(id) {
                        out.sending.push(id.clone());
                    } else {
                        out.recving.push(id.clone());
                    }
                }
            }
            out.failed_recving.extend(f.failed_recving);
        }
        self.sched.update_connector_output(&out);
        out
    }

    fn alloc(&mut self, n: u64) -> Vec<u64> {
        let b: Vec<u64> = (self.next_block..self.next_block + n).collect();
        self.next_block += n + 2;
        b
    }

    fn prefill(&mut self, id: &str, seed: u64, tokens: u64) -> KvTransferParams {
        let blocks = self.alloc(tokens.div_ceil(BLOCK));
        self.compute(seed, tokens, &blocks, 0..blocks.len());
        self.finish(id, tokens, &blocks)
    }

    /// The forward pass: the KV of blocks `which` of a request, in every rank's cache.
    fn compute(&self, seed: u64, tokens: u64, blocks: &[u64], which: std::ops::Range<usize>) {
        for (rank, w) in self.workers.iter().enumerate() {
            let l = w.layout().clone();
            for li in 0..l.layers.len() {
                for p in 0..l.planes {
                    for bi in which.clone() {
                        let data = block(seed, li, p, rank as u32, self.tp, bi as u64, tokens);
                        let own = self.own[rank].as_ref();
                        cache::write(own, w, li, l.offset(p, blocks[bi]), &data);
                    }
                }
            }
        }
    }

    fn prefill_req(id: &str, tokens: u64) -> EngineRequest {
        EngineRequest {
            request_id: id.into(),
            prompt_tokens: tokens,
            params: Some(KvTransferParams {
                do_remote_decode: true,
                ..KvTransferParams::default()
            }),
        }
    }

    fn finish(&mut self, id: &str, tokens: u64, blocks: &[u64]) -> KvTransferParams {
        let (delay, params) = self
            .sched
            .request_finished(&Self::prefill_req(id, tokens), blocks);
        assert!(delay);
        let mut params = params.unwrap();
        etcd::engine_only(&mut params);
        params
    }

    /// Where D finds this (P) engine before its prefill ends (push: the proxy sends both
    /// legs at once).
    fn coordinates(&self, id: &str) -> KvTransferParams {
        let a = self.workers[0].agent().side_channel_addr();
        let mut p = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: "prefill".into(),
            remote_host: a.ip().to_string(),
            remote_port: a.port(),
            remote_request_id: id.into(),
            tp_size: self.tp,
            remote_ports: self
                .workers
                .iter()
                .map(|w| w.agent().side_channel_addr().port())
                .collect(),
            ..KvTransferParams::default()
        };
        etcd::engine_only(&mut p);
        p
    }

    fn admit(&mut self, id: &str, tokens: u64, params: KvTransferParams, now: Instant) -> Vec<u64> {
        let req = EngineRequest {
            request_id: id.into(),
            prompt_tokens: tokens,
            params: Some(params),
        };
        let (n, _) = self.sched.get_num_new_matched_tokens(&req, 0, now);
        let blocks = self.alloc(tokens.div_ceil(BLOCK));
        self.sched
            .update_state_after_alloc(&req, blocks.clone(), n, now);
        blocks
    }

    /// Every byte of every rank's share of the request's blocks.
    fn check(&self, seed: u64, tokens: u64, blocks: &[u64]) {
        let bad = self.differs(seed, tokens, blocks, 0..blocks.len(), false);
        assert!(bad.is_none(), "{}", bad.unwrap_or_default());
    }

    /// Where the request's blocks `which` differ from the model's KV (None: they do not),
    /// in every rank's share; with `window_only` the sliding-window layer is compared only
    /// on the tokens of its window (what D attends to, and all that moves).
    fn differs(
        &self,
        seed: u64,
        tokens: u64,
        blocks: &[u64],
        which: std::ops::Range<usize>,
        window_only: bool,
    ) -> Option<String> {
        for (rank, w) in self.workers.iter().enumerate() {
            let l = w.layout();
            for li in 0..l.layers.len() {
                let from = match l.sliding_windows.get(&l.layers[li]) {
                    Some(win) if window_only => tokens.saturating_sub(*win),
                    _ => 0,
                };
                for p in 0..l.planes {
                    for bi in which.clone() {
                        let mut got = vec![0u8; l.block_bytes as usize];
                        let off = l.offset(p, blocks[bi]);
                        cache::read(self.own[rank].as_ref(), w, li, off, &mut got);
                        let want = block(seed, li, p, rank as u32, self.tp, bi as u64, tokens);
                        let same = (0..l.kv_heads).all(|h| {
                            (0..BLOCK).all(|t| {
                                let tok = bi as u64 * BLOCK + t;
                                let at = ((h * BLOCK + t) * HEAD_BYTES) as usize;
                                let r = at..at + HEAD_BYTES as usize;
                                (window_only && tok < from) || got[r.clone()] == want[r]
                            })
                        });
                        if !same {
                            return Some(format!(
                                "D rank {rank} of {}: layer {li} plane {p} block {bi} differs",
                                self.tp
                            ));
                        }
                    }
                }
            }
        }
        None
    }

    fn bytes_posted(&self) -> u64 {
        self.workers.iter().map(Worker::bytes_posted).sum()
    }

    /// Step until D reports `n` requests received and P freed `n` (bounded).
    fn exchange(p: &mut Self, d: &mut Self, n: usize) {
        let (mut sent, mut got) = (Vec::new(), Vec::new());
        let t = Instant::now();
        while sent.len() < n || got.len() < n {
            let now = Instant::now();
            sent.extend(p.step(now).sending);
            let fd = d.step(now);
            assert!(fd.failed_recving.is_empty(), "{:?}", fd.failed_recving);
            got.extend(fd.recving);
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "sent {sent:?} got {got:?}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn leased(&self) -> usize {
        self.workers.iter().map(Worker::leased).sum()
    }
}

fn pair(dir: &str, p_tp: u32, d_tp: u32) {
    pair_caches(dir, (p_tp, Cache::Agent), (d_tp, Cache::Agent));
}

/// P and D of TP sizes `p.0` and `d.0` with caches `p.1` and `d.1`.
fn pair_caches(dir: &str, (p_tp, p_cache): (u32, Cache), (d_tp, d_cache): (u32, Cache)) {
    let mut p = engine_with(
        "prefill",
        dir,
        "kv_producer",
        (p_tp, 40, p_cache),
        false,
        "",
        None,
    );
    let mut d = engine_with(
        "decode",
        dir,
        "kv_consumer",
        (d_tp, 90, d_cache),
        true,
        "",
        None,
    );
    let now = Instant::now();
    let reqs: Vec<(String, u64, u64)> = (0..3)
        .map(|i| (format!("cmpl-tp-{i}-0"), 7 + i, 21 + i * 29))
        .collect();
    let mut d_blocks = Vec::new();
    for (id, seed, tokens) in &reqs {
        let params = p.prefill(id, *seed, *tokens);
        assert_eq!(params.tp_size, p_tp);
        let ports = if etcd::mode() { 0 } else { p_tp as usize }; // by name in store mode
        assert_eq!(params.remote_ports.len(), ports);
        d_blocks.push(d.admit(id, *tokens, params, now));
    }
    Engine::exchange(&mut p, &mut d, reqs.len());
    for ((_, seed, tokens), blocks) in reqs.iter().zip(&d_blocks) {
        d.check(*seed, *tokens, blocks);
    }
    assert_eq!(p.leased(), 0, "every P rank freed every request");
    assert_eq!(p.sched.held(), 0);
    // each D rank moved exactly its share: the whole model's KV crossed once
    let moved = d.bytes_posted() + p.bytes_posted();
    let blocks: u64 = reqs.iter().map(|r| r.2.div_ceil(BLOCK)).sum();
    assert_eq!(
        moved,
        blocks * LAYERS as u64 * 2 * HEADS * BLOCK * HEAD_BYTES
    );
}

#[test]
fn pull_d_tp_larger() {
    pair("Pull", 1, 2);
}

#[test]
fn pull_p_tp_larger() {
    pair("Pull", 2, 1);
}

#[test]
fn pull_tp_2_to_4() {
    pair("Pull", 2, 4);
}

#[test]
fn push_d_tp_larger() {
    pair("Push", 1, 2);
}

#[test]
fn push_p_tp_larger() {
    pair("Push", 2, 1);
}

/// push_stream: a 100-token prompt (7 blocks) prefilled 32 tokens a step. The blocks each
/// step closes reach D while the prefill still runs; D reports the request only at the end;
/// every block crosses exactly once.
fn stream(p_tp: u32, d_tp: u32) {
    stream_caches(p_tp, d_tp, Cache::Agent);
}

fn stream_caches(p_tp: u32, d_tp: u32, cache: Cache) {
    let extra = r#","push_stream":true"#;
    let mut p = engine_with(
        "prefill",
        "Push",
        "kv_producer",
        (p_tp, 40, cache),
        false,
        extra,
        None,
    );
    let mut d = engine_with(
        "decode",
        "Push",
        "kv_consumer",
        (d_tp, 90, cache),
        true,
        extra,
        None,
    );
    let (id, seed, tokens) = ("cmpl-stream-0", 99, 100);
    let d_blocks = d.admit(id, tokens, p.coordinates(id), Instant::now());
    let blocks = p.alloc(tokens.div_ceil(BLOCK));
    let req = Engine::prefill_req(id, tokens);
    let mut closed = 0;
    for computed in [32, 64, 96] {
        let now_closed = (computed / BLOCK) as usize;
        p.compute(seed, tokens, &blocks, closed..now_closed);
        closed = now_closed;
        p.sched.prefill_progress(&req, &blocks, computed);
        // the closed blocks arrive while the prefill runs; D is not told yet
        let t = Instant::now();
        while d
            .differs(seed, tokens, &d_blocks, 0..closed, false)
            .is_some()
        {
            let now = Instant::now();
            assert!(p.step(now).sending.is_empty());
            let fd = d.step(now);
            assert!(
                fd.recving.is_empty() && fd.failed_recving.is_empty(),
                "{fd:?}"
            );
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "P TP {p_tp} → D TP {d_tp}: blocks closed by {computed} tokens never arrived"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    assert!(p.bytes_posted() > 0);
    p.compute(seed, tokens, &blocks, closed..blocks.len());
    p.finish(id, tokens, &blocks);
    Engine::exchange(&mut p, &mut d, 1);
    d.check(seed, tokens, &d_blocks);
    assert_eq!(p.leased(), 0);
    assert_eq!(
        p.bytes_posted(),
        7 * LAYERS as u64 * 2 * HEADS * BLOCK * HEAD_BYTES,
        "each block once"
    );
}

/// The engines' own caches across TP sizes: host memory (`cpu`), one allocation per layer
/// on P and pooled on D, and the other way round.
#[test]
fn engines_own_host_caches_across_tp_sizes() {
    pair_caches("Pull", (1, Cache::Host), (2, Cache::HostPooled));
    pair_caches("Push", (2, Cache::HostPooled), (1, Cache::Host));
}

/// NPU memory of the test runtime (`rbln`): pooled P ranks, per-layer D ranks, TP 2 → 1
/// and 1 → 2, and push_stream (on verbs through the agent's host bounce).
#[test]
fn engines_own_npu_caches_across_tp_sizes_and_push_stream() {
    pair_caches("Pull", (2, Cache::NpuPooled), (1, Cache::Npu));
    pair_caches("Push", (1, Cache::Npu), (2, Cache::NpuPooled));
    stream_caches(2, 1, Cache::NpuPooled);
}

#[test]
fn push_stream_sends_closed_blocks_during_the_prefill() {
    stream(1, 1);
}

#[test]
fn push_stream_with_p_tp_larger() {
    stream(2, 1);
}

/// swa_window_mode with a window of 4 tokens on layer 1 (block 16): D has every byte it
/// attends to and fewer bytes cross than without the mode, pull and push.
fn window(dir: &str) {
    let run = |mode: bool| -> u64 {
        let extra = if mode {
            r#","swa_window_mode":true"#
        } else {
            ""
        };
        let mut p = engine_with(
            "prefill",
            dir,
            "kv_producer",
            (1, 40, Cache::Agent),
            false,
            extra,
            Some(4),
        );
        let mut d = engine_with(
            "decode",
            dir,
            "kv_consumer",
            (2, 60, Cache::Agent),
            true,
            extra,
            Some(4),
        );
        let reqs: Vec<(String, u64, u64)> = [(3, 70), (4, 16), (5, 3)]
            .iter()
            .map(|&(seed, tokens)| (format!("cmpl-swa-{seed}-0"), seed, tokens))
            .collect();
        let mut d_blocks = Vec::new();
        for (id, seed, tokens) in &reqs {
            let params = p.prefill(id, *seed, *tokens);
            d_blocks.push(d.admit(id, *tokens, params, Instant::now()));
        }
        Engine::exchange(&mut p, &mut d, reqs.len());
        for ((_, seed, tokens), b) in reqs.iter().zip(&d_blocks) {
            let bad = d.differs(*seed, *tokens, b, 0..b.len(), mode);
            assert!(
                bad.is_none(),
                "{dir} swa_window_mode {mode}: {}",
                bad.unwrap()
            );
        }
        d.bytes_posted() + p.bytes_posted()
    };
    let (full, windowed) = (run(false), run(true));
    // 70 tokens: 5 blocks of layer 1 → tokens 64..72 of block 4; 16 tokens: one granule of
    // block 0 is 12..16; 3 tokens: 0..4
    let per_token = 2 * HEADS * HEAD_BYTES;
    let saved = (5 * BLOCK - 8 + BLOCK - 4 + BLOCK - 4) * per_token;
    assert_eq!(full - windowed, saved, "{dir}: {full} vs {windowed}");
}

#[test]
fn swa_window_mode_pull() {
    window("Pull");
}

#[test]
fn swa_window_mode_push() {
    window("Push");
}

/// A P rank that is gone: D (TP 1, taking the heads of both P ranks) fails the receive
/// cleanly and never reports it received; nothing moves for it afterwards. In push mode the
/// registration goes to no rank until every rank is connected, so the living rank never
/// WRITEs into blocks D has given up.
#[test]
fn a_dead_p_rank_fails_the_receive() {
    for dir in ["Pull", "Push"] {
        let mut p = engine("prefill", dir, "kv_producer", 2, 40, false);
        let mut d = engine("decode", dir, "kv_consumer", 1, 90, true);
        let params = p.prefill("cmpl-dead-0", 5, 40);
        drop(p.workers.pop()); // rank 1's worker and agent are gone
        let blocks = d.admit("cmpl-dead-0", 40, params, Instant::now());
        let t = Instant::now();
        let failed = loop {
            let now = Instant::now();
            p.step(now);
            let f = d.step(now);
            assert!(f.recving.is_empty(), "{dir}: reported received: {f:?}");
            if !f.failed_recving.is_empty() {
                break f.failed_recving;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{dir}: no failure reported"
            );
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(failed, vec!["cmpl-dead-0".to_owned()], "{dir}");
        // nothing landed, and nothing is still reading or writing for it
        let before = d.differs(5, 40, &blocks, 0..blocks.len(), false);
        assert!(before.is_some(), "{dir}: bytes landed for a failed receive");
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..50 {
            let f = d.step(Instant::now());
            assert!(f.recving.is_empty() && f.failed_recving.is_empty(), "{f:?}");
        }
        assert_eq!(d.differs(5, 40, &blocks, 0..blocks.len(), false), before);
    }
}

/// P and D hand the connector one block more than the prompt fills (an engine that
/// allocated a slot for a token it samples): the extra blocks hold no prompt token and must
/// not shift which P block lands in which D block (pull, push, push_stream). Before, the
/// lists were aligned at their ends and every block landed one block off.
#[test]
fn an_extra_trailing_p_block_does_not_shift_the_bytes() {
    for (dir, extra) in [
        ("Pull", ""),
        ("Push", ""),
        ("Push", r#","push_stream":true"#),
    ] {
        let shape = |n| (1, n, Cache::Agent);
        let mut p = engine_with("prefill", dir, "kv_producer", shape(40), false, extra, None);
        let mut d = engine_with("decode", dir, "kv_consumer", shape(90), true, extra, None);
        let (id, seed, tokens) = ("cmpl-extra-0", 11, 64); // 4 full blocks
        let blocks = p.alloc(5);
        p.compute(seed, tokens, &blocks, 0..4);
        // the extra block holds garbage
        for (w, r) in p.workers.iter().zip(p.workers[0].regions()) {
            let l = w.layout();
            for plane in 0..l.planes {
                w.agent()
                    .write_region(
                        *r,
                        l.offset(plane, blocks[4]),
                        &vec![0xAB; l.block_bytes as usize],
                    )
                    .unwrap();
            }
        }
        let req = Engine::prefill_req(id, tokens);
        p.sched.prefill_progress(&req, &blocks, 48);
        let params = p.finish(id, tokens, &blocks);
        // D, too, holds one block past the prompt (for the tokens it will generate)
        let req = EngineRequest {
            request_id: id.into(),
            prompt_tokens: tokens,
            params: Some(params),
        };
        let now = Instant::now();
        let (n, _) = d.sched.get_num_new_matched_tokens(&req, 0, now);
        let d_blocks = d.alloc(5);
        d.sched
            .update_state_after_alloc(&req, d_blocks.clone(), n, now);
        Engine::exchange(&mut p, &mut d, 1);
        let bad = d.differs(seed, tokens, &d_blocks, 0..4, false);
        assert!(bad.is_none(), "{dir}{extra}: {}", bad.unwrap());
        // nothing landed in D's extra block
        let w = &d.workers[0];
        let mut got = vec![1u8; w.layout().block_bytes as usize];
        w.agent()
            .read_region(w.regions()[0], w.layout().offset(0, d_blocks[4]), &mut got)
            .unwrap();
        assert!(
            got.iter().all(|b| *b == 0),
            "{dir}{extra}: D's extra block was written"
        );
    }
}

/// Parameters that name fewer P blocks than the prompt needs: the receive fails with the
/// reason, nothing is read.
#[test]
fn too_few_p_blocks_for_the_prompt_fail_the_receive() {
    let mut p = engine("prefill", "Pull", "kv_producer", 1, 40, false);
    let mut d = engine("decode", "Pull", "kv_consumer", 1, 90, true);
    let mut params = p.prefill("cmpl-short-0", 3, 64);
    params.remote_block_ids.pop();
    d.admit("cmpl-short-0", 64, params, Instant::now());
    let t = Instant::now();
    loop {
        let f = d.step(Instant::now());
        assert!(f.recving.is_empty(), "{f:?}");
        if f.failed_recving == vec!["cmpl-short-0".to_owned()] {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no failure reported");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(d.bytes_posted(), 0);
}

/// This P rank's heartbeat messages received (its agent's registry).
fn heartbeats_in(w: &Worker) -> f64 {
    let text = w.agent().metrics().render_prometheus();
    text.lines()
        .filter(|l| l.starts_with("kvrail_connector_heartbeats_received_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

/// Heterogeneous TP (SPEC §3): D (TP 1) heartbeats every rank of P (TP 2), not only rank
/// 0, so every rank's lease on the blocks of a request still waiting in D's queue is
/// extended; without the heartbeats they would run out at 30 s (virtual time).
#[test]
fn heartbeats_reach_every_p_rank() {
    let mut p = engine("prefill", "Pull", "kv_producer", 2, 32, true);
    let mut d = engine("decode", "Pull", "kv_consumer", 1, 32, false);
    let t0 = Instant::now();
    let params = p.prefill("hb-1", 7, 40);
    p.step(t0);
    assert!(p.workers.iter().all(|w| w.leased() == 1));
    // the request waits in D's queue: tracked, never scheduled
    let req = EngineRequest {
        request_id: "hb-1-d".into(),
        prompt_tokens: 40,
        params: Some(params),
    };
    assert!(d.sched.on_new_request(&req, t0));
    let late = t0 + Duration::from_secs(25);
    let t = Instant::now();
    while p.workers.iter().any(|w| heartbeats_in(w) < 1.0) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "a P rank got no heartbeat"
        );
        d.step(late);
        for w in &mut p.workers {
            w.get_finished(late);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // past the 30 s lease: both ranks still hold the blocks (extended to 25 + 20 s)
    let f = p.step(t0 + Duration::from_secs(35));
    assert!(f.sending.is_empty(), "a P rank freed the blocks: {f:?}");
    assert!(p.workers.iter().all(|w| w.leased() == 1));
}
