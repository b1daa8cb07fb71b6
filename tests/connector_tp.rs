//! Heterogeneous tensor parallelism end to end (SPEC §3): a P engine and a D engine whose TP
//! sizes differ, each rank its own worker and agent (`<engine>#tp<k>` at its advertised
//! port), on both backends (TCP here, verbs in the lab). Every byte of every head of every
//! layer lands in the right D rank, pull and push; P and D caches differ in block count;
//! P frees every block only after every D rank that takes its heads has its bytes.

mod lab;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, AgentConfig, BackendChoice};
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::tp::rank_agent_name;
use kvrail::connector::{
    agent_config, ConnectorMetadata, EngineRequest, Finished, KvLayout, KvTransferParams,
    Scheduler, Worker,
};

/// KV heads of the model (split over the ranks).
const HEADS: u64 = 8;
/// Bytes of one token of one head.
const HEAD_BYTES: u64 = 8;
const BLOCK: u64 = 16;
const LAYERS: usize = 3;

fn layout(tp: u32, num_blocks: u64) -> KvLayout {
    let heads = HEADS / u64::from(tp);
    KvLayout {
        layers: (0..LAYERS)
            .map(|i| format!("model.layers.{i}.attn"))
            .collect(),
        num_blocks,
        block_bytes: heads * BLOCK * HEAD_BYTES,
        planes: 2,
        block_size: BLOCK as u32,
        kv_heads: heads,
        sliding_windows: Default::default(),
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
    tp: u32,
    next_block: u64,
    /// Per request: how many ranks reported it (sending / recving), and failures.
    reports: HashMap<String, u32>,
}

fn engine(name: &str, dir: &str, role: &str, tp: u32, num_blocks: u64, host_a: bool) -> Engine {
    let json = format!(
        r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}","kv_buffer_device":"rbln",
            "kv_connector_extra_config":{{"kv_lease_duration":30}}}}"#
    );
    let cfg = KvTransferConfig::from_json(&json).unwrap();
    let l = layout(tp, num_blocks);
    let workers: Vec<Worker> = (0..tp)
        .map(|rank| {
            let mut base = AgentConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                ..AgentConfig::default()
            };
            if let Some(t) = lab::Topology::from_env() {
                base.backend = BackendChoice::Verbs;
                base.devices = if host_a { t.a_devs } else { t.b_devs };
            }
            let ac = agent_config(&cfg, &l, base);
            let agent = Arc::new(Agent::new(&rank_agent_name(name, rank), ac).unwrap());
            Worker::with_rank(agent, cfg.clone(), l.clone(), rank, tp).unwrap()
        })
        .collect();
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
        for (rank, w) in self.workers.iter().enumerate() {
            let l = w.layout().clone();
            for (li, r) in w.regions().iter().enumerate() {
                for p in 0..l.planes {
                    for (bi, b) in blocks.iter().enumerate() {
                        let data = block(seed, li, p, rank as u32, self.tp, bi as u64, tokens);
                        w.agent().write_region(*r, l.offset(p, *b), &data).unwrap();
                    }
                }
            }
        }
        let req = EngineRequest {
            request_id: id.into(),
            prompt_tokens: tokens,
            params: Some(KvTransferParams {
                do_remote_decode: true,
                ..KvTransferParams::default()
            }),
        };
        let (delay, params) = self.sched.request_finished(&req, &blocks);
        assert!(delay);
        params.unwrap()
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
        for (rank, w) in self.workers.iter().enumerate() {
            let l = w.layout();
            for (li, r) in w.regions().iter().enumerate() {
                for p in 0..l.planes {
                    for (bi, b) in blocks.iter().enumerate() {
                        let mut got = vec![0u8; l.block_bytes as usize];
                        w.agent()
                            .read_region(*r, l.offset(p, *b), &mut got)
                            .unwrap();
                        let want = block(seed, li, p, rank as u32, self.tp, bi as u64, tokens);
                        assert!(
                            got == want,
                            "D rank {rank} of {}: layer {li} plane {p} block {bi} differs",
                            self.tp
                        );
                    }
                }
            }
        }
    }

    fn leased(&self) -> usize {
        self.workers.iter().map(Worker::leased).sum()
    }
}

fn pair(dir: &str, p_tp: u32, d_tp: u32) {
    let mut p = engine("prefill", dir, "kv_producer", p_tp, 40, false);
    let mut d = engine("decode", dir, "kv_consumer", d_tp, 90, true);
    let now = Instant::now();
    let reqs: Vec<(String, u64, u64)> = (0..3)
        .map(|i| (format!("cmpl-tp-{i}-0"), 7 + i, 21 + i * 29))
        .collect();
    let mut d_blocks = Vec::new();
    for (id, seed, tokens) in &reqs {
        let params = p.prefill(id, *seed, *tokens);
        assert_eq!(params.tp_size, p_tp);
        assert_eq!(params.remote_ports.len(), p_tp as usize);
        d_blocks.push(d.admit(id, *tokens, params, now));
    }
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    let t = Instant::now();
    while sent.len() < reqs.len() || got.len() < reqs.len() {
        let now = Instant::now();
        sent.extend(p.step(now).sending);
        let fd = d.step(now);
        assert!(fd.failed_recving.is_empty(), "{:?}", fd.failed_recving);
        got.extend(fd.recving);
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "P TP {p_tp} → D TP {d_tp} ({dir}): sent {sent:?} got {got:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    for ((_, seed, tokens), blocks) in reqs.iter().zip(&d_blocks) {
        d.check(*seed, *tokens, blocks);
    }
    assert_eq!(p.leased(), 0, "every P rank freed every request");
    assert_eq!(p.sched.held(), 0);
    // each D rank moved exactly its share: the whole model's KV crossed once
    let moved: u64 = d
        .workers
        .iter()
        .chain(&p.workers)
        .map(Worker::bytes_posted)
        .sum();
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
