//! The connector end to end between a P engine and a D engine in one process, on both
//! backends (TCP here, verbs in the lab): pull and push move every KV byte of every layer
//! (checked), P frees on completion, heartbeats run from scheduler entry, a dead D lets P
//! reclaim by lease expiry, a dead P fails D's receives, and pull and push instances refuse
//! to pair. Each engine step is build_connector_meta → (msgpack) → start_load_kv →
//! get_finished → update_connector_output, as an engine drives it.
//!
//! `KVRAIL_CONNECTOR_ETCD=1` runs the same suite in metadata-store mode (tier 1 does both):
//! every engine's `kv_transfer_config` names one real etcd (a namespace per test), P's
//! `kv_transfer_params` name its engine only (no host, no ports), and D finds every P rank
//! by name through the store.

#[path = "etcd/mod.rs"]
mod etcd;
mod lab;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, AgentError};
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::{
    agent_config, BlockOrder, ConnectorMetadata, EngineRequest, Finished, KvLayout,
    KvTransferParams, Scheduler, Worker,
};
use kvrail::proto::handshake::Direction;
use lab::cache::{self, Cache, EngineCache};

fn layout() -> KvLayout {
    // 2 KV heads × 16 tokens × head size 32 × fp16 a block
    lab::kv_layout(4, 64, 2 * 16 * 32 * 2, 2)
}

struct Engine {
    sched: Scheduler,
    worker: Worker,
    next_block: u64,
    /// The engine's own cache (None: kvrail allocated it).
    own: Option<EngineCache>,
}

fn engine(name: &str, json: &str, host_a: bool) -> Engine {
    engine_with(name, json, host_a, layout())
}

fn engine_with(name: &str, json: &str, host_a: bool, l: KvLayout) -> Engine {
    engine_cache(name, json, host_a, l, Cache::Agent).unwrap()
}

/// An engine whose KV cache is `cache` (the engine's own memory, registered in place).
fn engine_cache(
    name: &str,
    json: &str,
    host_a: bool,
    l: KvLayout,
    cache: Cache,
) -> Result<Engine, AgentError> {
    let cfg = KvTransferConfig::from_json(&etcd::with_store(json)).unwrap();
    let ac = agent_config(&cfg, &l, lab::agent_config(host_a));
    let agent = Arc::new(Agent::new(name, ac).unwrap());
    assert_eq!(agent.store_up(), etcd::mode().then_some(true), "store mode");
    let sched = Scheduler::new(cfg.clone(), name, agent.side_channel_addr(), 1);
    let (own, caches) = EngineCache::new(cache, &l, i32::from(host_a));
    let worker = Worker::with_caches(agent, cfg, l, (0, 1), caches)?;
    Ok(Engine {
        sched,
        worker,
        next_block: 1,
        own,
    })
}

fn cfg(dir: &str, role: &str, lease: u64) -> String {
    format!(
        r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}","kv_buffer_device":"rbln",
            "kv_connector_extra_config":{{"kv_lease_duration":{lease}}}}}"#
    )
}

/// The number in a layer name (`model.layers.3.attn` → 3).
fn layer_no(name: &str) -> usize {
    name.split('.').nth(2).and_then(|n| n.parse().ok()).unwrap()
}

/// The KV byte of (request seed, layer, plane, token block, offset): what the fake model
/// computes, so D can check every byte.
fn kv(seed: u64, layer: usize, plane: u64, blk: usize, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            lab::pattern_byte(
                seed ^ ((layer as u64) << 40) ^ (plane << 36) ^ ((blk as u64) << 20),
                i,
            )
        })
        .collect()
}

impl Engine {
    fn step(&mut self, now: Instant) -> Finished {
        let m = self.sched.build_connector_meta(now);
        let m = ConnectorMetadata::decode(&m.encode()).unwrap();
        self.worker.start_load_kv(&m, now);
        let f = self.worker.get_finished(now);
        self.sched.update_connector_output(&f);
        f
    }

    fn alloc(&mut self, n: usize) -> Vec<u64> {
        let b: Vec<u64> = (self.next_block..self.next_block + n as u64).collect();
        self.next_block += n as u64 + 1; // a gap: runs do not always coalesce
        b
    }

    /// Logical blocks for `tokens` (a logical block is `physical_per_logical` blocks of 16
    /// tokens), and the physical blocks they are.
    fn logical(&mut self, tokens: u64) -> (Vec<u64>, Vec<u64>) {
        let r = self.worker.layout().physical_per_logical;
        let blocks = self.alloc(tokens.div_ceil(16 * r) as usize);
        let phys = blocks
            .iter()
            .flat_map(|&b| (0..r).map(move |i| b * r + i))
            .collect();
        (blocks, phys)
    }

    /// Prefill: compute the KV of `tokens` into fresh blocks; finish the request.
    fn prefill(&mut self, id: &str, seed: u64, tokens: u64) -> KvTransferParams {
        let l = self.worker.layout().clone();
        let (blocks, phys) = self.logical(tokens);
        for li in 0..l.layers.len() {
            for p in 0..l.planes {
                for (bi, b) in phys.iter().enumerate() {
                    let data = kv(seed, layer_no(&l.layers[li]), p, bi, l.block_bytes as usize);
                    let own = self.own.as_ref();
                    cache::write(own, &self.worker, li, l.offset(p, *b), &data);
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
        assert!(delay, "P keeps the blocks for D");
        let mut params = params.unwrap();
        etcd::engine_only(&mut params);
        params
    }

    /// Decode leg: admit the request and allocate its blocks.
    fn admit(&mut self, id: &str, tokens: u64, params: KvTransferParams, now: Instant) -> Vec<u64> {
        let req = EngineRequest {
            request_id: id.into(),
            prompt_tokens: tokens,
            params: Some(params),
        };
        let (n, load_async) = self.sched.get_num_new_matched_tokens(&req, 0, now);
        assert_eq!((n, load_async), (tokens, true));
        let blocks = self.logical(tokens).0;
        self.sched
            .update_state_after_alloc(&req, blocks.clone(), n, now);
        blocks
    }

    fn check(&self, seed: u64, blocks: &[u64]) {
        self.check_layers(seed, blocks, &self.worker.layout().layers.clone(), None);
    }

    /// The KV of `layers` is in `blocks`; every other layer's blocks are still zero.
    fn check_layers(&self, seed: u64, blocks: &[u64], layers: &[String], tokens: Option<u64>) {
        let l = self.worker.layout().clone();
        let r = l.physical_per_logical;
        let phys: Vec<u64> = blocks
            .iter()
            .flat_map(|&b| (0..r).map(move |i| b * r + i))
            .collect();
        for (li, name) in l.layers.iter().enumerate() {
            for p in 0..l.planes {
                for (bi, b) in phys.iter().enumerate() {
                    let mut got = vec![0u8; l.block_bytes as usize];
                    let own = self.own.as_ref();
                    cache::read(own, &self.worker, li, l.offset(p, *b), &mut got);
                    // a logical block may end past the prompt: those physical blocks stay zero
                    let in_prompt = tokens.is_none_or(|t| (bi as u64) < t.div_ceil(16));
                    let want = if layers.contains(name) && in_prompt {
                        kv(seed, layer_no(name), p, bi, got.len())
                    } else {
                        vec![0; got.len()]
                    };
                    assert!(got == want, "KV differs: layer {name} plane {p} block {bi}");
                }
            }
        }
    }
}

/// Step both engines until `done` says so (real time; bounded).
fn run(p: &mut Engine, d: &mut Engine, mut done: impl FnMut(&Finished, &Finished) -> bool) {
    let t = Instant::now();
    loop {
        let now = Instant::now();
        let fp = p.step(now);
        let fd = d.step(now);
        if done(&fp, &fd) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn both_directions(dir: &str) {
    let p = engine("prefill-engine", &cfg(dir, "kv_producer", 30), false);
    let d = engine("decode-engine", &cfg(dir, "kv_consumer", 30), true);
    move_six_requests(p, d);
}

/// Six requests of different lengths from P to D: every KV byte of every layer checked on
/// D; P frees every request on completion; heartbeats stop.
fn move_six_requests(mut p: Engine, mut d: Engine) {
    let now = Instant::now();
    let reqs: Vec<(String, u64, u64)> = (0..6)
        .map(|i| (format!("cmpl-{i}-0"), i, 20 + i * 37))
        .collect();
    let mut d_blocks = Vec::new();
    for (id, seed, tokens) in &reqs {
        let params = p.prefill(id, *seed, *tokens);
        assert_eq!(params.remote_engine_id, p.worker.agent().name());
        let blocks = d.admit(&format!("{id}-d"), *tokens, params, now);
        d_blocks.push(blocks);
    }
    assert_eq!(p.sched.held(), 6);
    let (mut sent, mut recvd) = (HashSet::new(), HashSet::new());
    run(&mut p, &mut d, |fp, fd| {
        assert!(fd.failed_recving.is_empty(), "{fd:?}");
        sent.extend(fp.sending.iter().cloned());
        recvd.extend(fd.recving.iter().cloned());
        sent.len() == 6 && recvd.len() == 6
    });
    for ((_, seed, tokens), blocks) in reqs.iter().zip(&d_blocks) {
        let layers = d.worker.layout().layers.clone();
        d.check_layers(*seed, blocks, &layers, Some(*tokens));
    }
    assert_eq!(p.sched.held(), 0, "P freed every request on completion");
    assert_eq!(p.worker.leased(), 0);
    // the workers' counters say the same (the agents' registries)
    let count = |e: &Engine, outcome: &str| {
        let a = e.worker.agent();
        let l = [("agent", a.name()), ("outcome", outcome)];
        a.metrics().value("kvrail_connector_requests_total", &l)
    };
    assert_eq!(count(&p, "freed"), Some(6.0));
    assert_eq!(count(&d, "received"), Some(6.0));
    assert_eq!(count(&d, "failed"), Some(0.0));
    let held = [("agent", p.worker.agent().name())];
    let m = p.worker.agent().metrics();
    assert_eq!(m.value("kvrail_connector_leases_held", &held), Some(0.0));
    assert_eq!(m.value("kvrail_connector_grants_live", &held), Some(0.0));
    // push: P wrote each of the six registrations once; pull: P wrote none
    let pushed = m.value("kvrail_connector_push_matches_written_total", &held);
    let read = d.worker.bytes_posted() > 0;
    assert_eq!(pushed, Some(if read { 0.0 } else { 6.0 }), "D read: {read}");
    assert_eq!(
        d.sched.heartbeating(),
        0,
        "heartbeats stop when the KV arrived"
    );
    assert_eq!(p.worker.push_dropped(), 0);
}

#[test]
fn pull_moves_every_kv_byte_and_p_frees_on_completion() {
    both_directions("Pull");
}

#[test]
fn push_moves_every_kv_byte_and_reports_completion() {
    both_directions("Push");
}

/// The engines' own caches, registered in place (`register_kv_caches`): P one allocation per
/// layer, D one pooled allocation for every layer (and the other way round), pull and push.
/// `cpu`: host memory; on verbs the agents copy no payload byte. `rbln`: NPU memory of the
/// test runtime, which moves on TCP by copies through the runtime and on verbs through the
/// agent's host bounce (rxe has no dma-buf).
fn engines_own_caches(p_cache: Cache, d_cache: Cache) {
    for dir in ["Pull", "Push"] {
        let json = |role: &str| {
            format!(
                r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}",
                    "kv_buffer_device":"{}"}}"#,
                p_cache.buffer_device()
            )
        };
        let p = engine_cache(
            "prefill-engine",
            &json("kv_producer"),
            false,
            layout(),
            p_cache,
        );
        let p = p.unwrap();
        let d = engine_cache(
            "decode-engine",
            &json("kv_consumer"),
            true,
            layout(),
            d_cache,
        )
        .unwrap();
        let agents = (p.worker.agent().clone(), d.worker.agent().clone());
        move_six_requests(p, d);
        let copied = (
            agents.0.payload_bytes_copied(),
            agents.1.payload_bytes_copied(),
        );
        match (lab::Topology::from_env().is_some(), p_cache.buffer_device()) {
            // host caches on verbs: the NIC moves the engine's pages in place
            (true, "cpu") => assert_eq!(copied, (0, 0), "{dir}: payload copied on verbs"),
            // NPU caches on verbs: staged by the agents' host bounce
            (true, _) => {
                let sent = |a: &Agent| a.bounce_stats().map_or(0, |s| s.bytes_sent);
                assert!(sent(&agents.0) + sent(&agents.1) > 0, "{dir}: no bounce");
            }
            // TCP, host caches: P WRITEs from its pages as they are; its fenced pages (pull,
            // `fence_blocks`) are served by copies made under the grant's gate, so that a
            // revocation never waits on a socket
            (false, "cpu") if dir == "Push" => {
                assert_eq!(copied.0, 0, "{dir}: P copied host payload on TCP");
            }
            (false, "cpu") => assert!(copied.0 > 0, "{dir}: P served fenced pages uncopied"),
            // TCP, NPU caches: through the runtime's copies on both sides
            (false, _) => assert!(copied.0 > 0 && copied.1 > 0, "{dir}: {copied:?}"),
        }
    }
}

#[test]
fn engines_own_host_caches_per_layer_and_pooled_cpu() {
    engines_own_caches(Cache::Host, Cache::HostPooled);
    engines_own_caches(Cache::HostPooled, Cache::Host);
}

#[test]
fn engines_own_npu_caches_per_layer_and_pooled_rbln() {
    engines_own_caches(Cache::Npu, Cache::NpuPooled);
    engines_own_caches(Cache::NpuPooled, Cache::Npu);
}

/// Caches that do not fit the layout or the configured memory are refused naming the layer
/// or the key, and nothing stays registered.
#[test]
fn caches_that_do_not_fit_are_refused_by_name() {
    let json = |dev: &str| {
        format!(
            r#"{{"kv_connector":"KvrailPullConnector","kv_role":"kv_producer","kv_buffer_device":"{dev}"}}"#
        )
    };
    let err = |dev: &str, cache: Cache, l: KvLayout| {
        engine_cache("prefill-engine", &json(dev), false, l, cache)
            .err()
            .expect("refused")
            .to_string()
    };
    let e = err("rbln", Cache::Host, layout());
    assert!(
        e.starts_with(
            "memory: kv_buffer_device: \"rbln\" configures Npu memory, but cache #0 is Host"
        ),
        "{e}"
    );
    let e = err("cpu", Cache::Npu, layout());
    assert!(e.contains("\"cpu\" configures Host memory"), "{e}");
    // the engine's cache was made for 64 blocks; the layout says 32
    let cfg = KvTransferConfig::from_json(&json("cpu")).unwrap();
    let l = layout();
    let agent = Arc::new(
        Agent::new(
            "prefill-engine",
            agent_config(&cfg, &l, lab::agent_config(false)),
        )
        .unwrap(),
    );
    let (_own, caches) = EngineCache::new(Cache::HostPooled, &l, 0);
    let small = KvLayout {
        num_blocks: 32,
        ..l.clone()
    };
    let e = Worker::with_caches(agent.clone(), cfg.clone(), small, (0, 1), caches)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.layers.0.attn: 262144 bytes in cache #0, the layout needs 131072"),
        "{e}"
    );
    // a layer no cache holds
    let (_own, caches) = EngineCache::new(Cache::Host, &l, 0);
    let more = KvLayout {
        layers: [l.layers.clone(), vec!["model.layers.9.attn".into()]].concat(),
        ..l.clone()
    };
    let e = Worker::with_caches(agent.clone(), cfg, more, (0, 1), caches)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.layers.9.attn: no cache holds this layer"),
        "{e}"
    );
    assert!(
        agent.metadata().regions.is_empty(),
        "nothing stays registered"
    );
}

#[test]
fn a_dead_decode_instance_lets_p_reclaim_by_lease_expiry() {
    // lease 6 s: heartbeats every 1 s extend by 4 s
    let mut p = engine("prefill-engine", &cfg("Pull", "kv_producer", 6), false);
    let mut d = engine("decode-engine", &cfg("Pull", "kv_consumer", 6), true);
    let params = p.prefill("r", 1, 40);
    // D admits it but never gets to schedule it; it heartbeats from admission
    let req = EngineRequest {
        request_id: "r-d".into(),
        prompt_tokens: 40,
        params: Some(params),
    };
    d.sched.get_num_new_matched_tokens(&req, 0, Instant::now());
    let t0 = Instant::now();
    let mut freed_at = None;
    while t0.elapsed() < Duration::from_secs(10) {
        let now = Instant::now();
        assert!(p.step(now).sending.is_empty(), "freed while D heartbeats");
        d.step(now);
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(d); // D dies
    let dead = Instant::now();
    while freed_at.is_none() {
        let f = p.step(Instant::now());
        if f.sending == vec!["r".to_string()] {
            freed_at = Some(dead.elapsed());
        }
        assert!(dead.elapsed() < Duration::from_secs(30), "never reclaimed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let at = freed_at.unwrap();
    eprintln!("P reclaimed the blocks {at:?} after D died (lease 6 s, extension 4 s)");
    assert!(at <= Duration::from_secs(8), "{at:?}");
    assert_eq!(p.sched.held(), 0);
}

#[test]
fn a_dead_prefill_instance_fails_the_receives_cleanly() {
    for dir in ["Pull", "Push"] {
        let mut p = engine("prefill-engine", &cfg(dir, "kv_producer", 30), false);
        let mut d = engine("decode-engine", &cfg(dir, "kv_consumer", 30), true);
        let params = p.prefill("r", 1, 40);
        let addr = p.worker.agent().side_channel_addr();
        drop(p); // P dies before D reaches it
        let _ = addr;
        let now = Instant::now();
        d.admit("r-d", 40, params, now);
        let t = Instant::now();
        loop {
            let f = d.step(Instant::now());
            assert!(
                f.recving.is_empty(),
                "{dir}: a receive from a dead P reported success"
            );
            if f.failed_recving == vec!["r-d".to_string()] {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{dir}: the receive never failed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn pull_and_push_instances_refuse_to_pair() {
    let mut p = engine("prefill-engine", &cfg("Push", "kv_producer", 30), false);
    let mut d = engine("decode-engine", &cfg("Pull", "kv_consumer", 30), true);
    let params = p.prefill("r", 1, 40);
    d.admit("r-d", 40, params, Instant::now());
    let t = Instant::now();
    loop {
        let f = d.step(Instant::now());
        p.step(Instant::now());
        assert!(f.recving.is_empty());
        if !f.failed_recving.is_empty() {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "paired anyway");
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = Direction::Pull;
}

/// A pipeline-parallel producer stage (layers 1 and 2 of 4) pushes into a decode instance
/// that holds every layer: routed by layer name, D's layers 1 and 2 get the KV, 0 and 3 stay
/// untouched. A stage owning a layer D lacks fails the handshake, and nothing is reported
/// received.
#[test]
fn pipeline_parallel_producer_routes_by_layer_name() {
    let stage = |layers: &[usize]| KvLayout {
        layers: layers
            .iter()
            .map(|i| format!("model.layers.{i}.attn"))
            .collect(),
        ..layout()
    };
    let mut p = engine_with(
        "prefill-pp1",
        &cfg("Push", "kv_producer", 30),
        false,
        stage(&[1, 2]),
    );
    let mut d = engine("decode-engine", &cfg("Push", "kv_consumer", 30), true);
    let params = p.prefill("r", 5, 50);
    let blocks = d.admit("r-d", 50, params, Instant::now());
    let mut got = false;
    run(&mut p, &mut d, |_, fd| {
        assert!(fd.failed_recving.is_empty(), "{fd:?}");
        got |= fd.recving == vec!["r-d".to_string()];
        got
    });
    d.check_layers(5, &blocks, &p.worker.layout().layers.clone(), None);

    // a stage with a layer the decode instance does not have
    let mut p = engine_with(
        "prefill-pp9",
        &cfg("Push", "kv_producer", 30),
        false,
        stage(&[2, 9]),
    );
    let params = p.prefill("s", 6, 30);
    d.admit("s-d", 30, params, Instant::now());
    // the handshake fails on whichever side meets the other first: D's registration
    // (reported failed at once) or P's WRITE (dropped, counted); never a success
    let t = Instant::now();
    loop {
        let now = Instant::now();
        let f = d.step(now);
        assert!(
            f.recving.is_empty(),
            "KV reported received from a refused stage"
        );
        p.step(now);
        if f.failed_recving == vec!["s-d".to_string()] || p.worker.push_dropped() > 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the refusal never surfaced"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `chunk_mode`: the request's partly filled last block moves only up to the end of the chunk
/// holding its last token; D still has every token's KV (checked token by token over D blocks
/// filled with garbage first), and the bytes moved are counted against whole blocks.
#[test]
fn chunk_mode_moves_fewer_bytes_and_every_token() {
    let l = layout();
    let head_bytes = l.block_bytes / 2 / 16;
    for dir in ["Pull", "Push"] {
        let mut moved = Vec::new();
        for chunk in [false, true] {
            let json = format!(
                r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"kv_both",
                    "kv_connector_extra_config":{{"chunk_mode":{chunk}{}}}}}"#,
                if chunk { r#","chunk_tokens":4"# } else { "" }
            );
            let mut p = engine("prefill-engine", &json, false);
            let mut d = engine("decode-engine", &json, true);
            let params = p.prefill("r", 3, 50); // 4 blocks; the last holds 2 tokens
            let blocks = d.admit("r-d", 50, params, Instant::now());
            for r in d.worker.regions().to_vec() {
                d.worker
                    .agent()
                    .write_region(r, 0, &vec![0xEE; l.layer_bytes() as usize])
                    .unwrap();
            }
            let mut got = false;
            run(&mut p, &mut d, |_, fd| {
                assert!(fd.failed_recving.is_empty(), "{fd:?}");
                got |= !fd.recving.is_empty();
                got
            });
            for (li, r) in d.worker.regions().iter().enumerate() {
                for plane in 0..2 {
                    for (bi, b) in blocks.iter().enumerate() {
                        let want = kv(3, li, plane, bi, l.block_bytes as usize);
                        let mut have = vec![0u8; l.block_bytes as usize];
                        d.worker
                            .agent()
                            .read_region(*r, l.offset(plane, *b), &mut have)
                            .unwrap();
                        for t in 0..16u64 {
                            if bi as u64 * 16 + t >= 50 {
                                break;
                            }
                            for h in 0..2u64 {
                                let at = ((h * 16 + t) * head_bytes) as usize;
                                let s = at..at + head_bytes as usize;
                                assert!(
                                    have[s.clone()] == want[s],
                                    "{dir} chunk {chunk}: layer {li} block {bi} token {t} head {h}"
                                );
                            }
                        }
                    }
                }
            }
            moved.push(p.worker.bytes_posted() + d.worker.bytes_posted());
        }
        let whole = 4 * 2 * 4 * l.block_bytes; // layers x planes x blocks
        let chunked = 4 * 2 * (3 * l.block_bytes + 2 * 4 * head_bytes);
        assert_eq!(
            moved,
            vec![whole, chunked],
            "{dir}: bytes moved without and with chunk_mode"
        );
    }
}

/// A prefill instance that dies and comes back (same engine id, new address): D fails what
/// was in flight to the old one cleanly, then handshakes again and receives from the new one.
#[test]
fn a_restarted_prefill_instance_is_found_again() {
    let mut d = engine("decode-engine", &cfg("Pull", "kv_consumer", 30), true);
    let mut p = engine("prefill-engine", &cfg("Pull", "kv_producer", 30), false);
    let params = p.prefill("r0", 1, 40);
    let b = d.admit("r0-d", 40, params, Instant::now());
    let mut ok = false;
    run(&mut p, &mut d, |_, fd| {
        ok |= fd.recving == vec!["r0-d".to_string()];
        ok
    });
    d.check(1, &b);
    drop(p);
    let mut p = engine("prefill-engine", &cfg("Pull", "kv_producer", 30), false);
    for round in 1..=3u64 {
        let id = format!("r{round}");
        let params = p.prefill(&id, round, 40);
        let b = d.admit(&format!("{id}-d"), 40, params, Instant::now());
        let mut outcome = None;
        run(&mut p, &mut d, |_, fd| {
            if !fd.recving.is_empty() {
                outcome = Some(true);
            } else if !fd.failed_recving.is_empty() {
                outcome = Some(false);
            }
            outcome.is_some()
        });
        if outcome == Some(true) {
            d.check(round, &b);
            return;
        }
        eprintln!("round {round}: failed cleanly against the old connection");
    }
    panic!("D never reached the restarted prefill instance");
}

/// P drops a registration that never meets its prefill after `push_registration_timeout`
/// (from the config, not a fixed 8 minutes), and refuses one without blocks.
#[test]
fn unmatched_push_registration_expires_after_the_configured_timeout() {
    let json = r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_producer","kv_buffer_device":"rbln",
        "kv_connector_extra_config":{"push_registration_timeout":1}}"#;
    let mut p = engine("prefill-ttl", json, false);
    // a D that registers blocks for a request P never prefills
    let d_json = r#"{"kv_connector":"KvrailPushConnector","kv_role":"kv_consumer","kv_buffer_device":"rbln"}"#;
    let d = engine("decode-ttl", d_json, true);
    let peer = d
        .worker
        .agent()
        .load_remote(p.worker.agent().side_channel_addr())
        .unwrap();
    let addr = d.worker.agent().side_channel_addr();
    let reg = |blocks: Vec<u64>| kvrail::proto::kvmsg::PushReg {
        request_id: "d-req".into(),
        engine_id: "decode-ttl".into(),
        host: addr.ip().to_string(),
        port: addr.port(),
        tp_rank: 0,
        tp_size: 1,
        block_ids: blocks,
        remote_engine_id: "prefill-ttl".into(),
        remote_request_id: "never-prefilled".into(),
        grant: None,
    };
    d.worker
        .agent()
        .send_notif(&peer, reg(vec![]).encode())
        .unwrap();
    // one for another P engine (D's proxy mixed them up): refused, not matched
    let mut other = reg(vec![1, 2]);
    other.remote_engine_id = "prefill-elsewhere".into();
    d.worker.agent().send_notif(&peer, other.encode()).unwrap();
    d.worker
        .agent()
        .send_notif(&peer, reg(vec![1, 2]).encode())
        .unwrap();
    let t0 = Instant::now();
    let mut seen = (false, None);
    while t0.elapsed() < Duration::from_secs(30) {
        p.step(Instant::now());
        seen.0 |= p.worker.malformed >= 2;
        if p.worker.push_dropped() > 0 {
            seen.1 = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        seen.0,
        "the registrations without blocks and for another engine were not both refused"
    );
    let after = seen.1.expect("the unmatched registration never expired");
    println!(
        "    unmatched registration dropped after {:.2} s (timeout 1 s)",
        after.as_secs_f64()
    );
    assert!(
        after >= Duration::from_millis(900),
        "dropped early: {after:?}"
    );
    assert_eq!(p.worker.push_dropped(), 1);
}

/// Engines whose scheduler names logical blocks of two physical ones: each side expands
/// its own ids, and the peer's by the ratio the peer told in the handshake — P with 2 and D
/// with 1, then the other way round, pull and push; every KV byte checked on D.
#[test]
fn logical_blocks_expand_by_each_sides_ratio() {
    let ratio = |r: u64| KvLayout {
        physical_per_logical: r,
        block_stride: 0,
        inner: BlockOrder::Hnd,
        num_blocks: 200,
        ..layout()
    };
    for dir in ["Pull", "Push"] {
        for (rp, rd) in [(2, 1), (1, 2)] {
            let p = engine_with(
                &format!("prefill-r{rp}"),
                &cfg(dir, "kv_producer", 30),
                false,
                ratio(rp),
            );
            let d = engine_with(
                &format!("decode-r{rd}"),
                &cfg(dir, "kv_consumer", 30),
                true,
                ratio(rd),
            );
            let theirs = d
                .worker
                .agent()
                .load_remote(p.worker.agent().side_channel_addr())
                .unwrap();
            let told = d.worker.agent().remote_metadata(&theirs).unwrap();
            assert_eq!(u64::from(told.handshake.physical_per_logical), rp);
            move_six_requests(p, d);
        }
    }
}

/// `engine_id` in the config is what peers look the engine's ranks up by: a worker whose
/// agent carries another name is refused, naming the key.
#[test]
fn engine_id_must_name_the_workers_agent() {
    let json =
        r#"{"kv_connector":"KvrailPullConnector","kv_role":"kv_producer","engine_id":"prefill-a"}"#;
    let Err(e) = engine_cache("prefill-b", json, false, layout(), Cache::Agent) else {
        panic!("a worker named prefill-b under engine_id prefill-a was accepted")
    };
    assert!(e.to_string().starts_with("engine_id: "), "{e}");
    assert!(engine_cache("prefill-a", json, false, layout(), Cache::Agent).is_ok());
}

/// Push: D registers for a prefill P does not hold (P restarted under its name, or the
/// parameters were made up). P refuses the registration once it has waited a lease for its
/// prefill; D withdraws it and fails the receive then, not after
/// `push_registration_timeout` (60 s here), and nothing lands in D's blocks.
#[test]
fn a_registration_for_a_prefill_p_does_not_hold_fails_within_a_lease() {
    let json = |role: &str| {
        format!(
            r#"{{"kv_connector":"KvrailPushConnector","kv_role":"{role}","kv_buffer_device":"rbln",
            "kv_connector_extra_config":{{"kv_lease_duration":2,"push_registration_timeout":60}}}}"#
        )
    };
    let mut p = engine("prefill-unheld", &json("kv_producer"), false);
    let mut d = engine("decode-unheld", &json("kv_consumer"), true);
    let addr = p.worker.agent().side_channel_addr();
    let params = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: "prefill-unheld".into(),
        remote_host: addr.ip().to_string(),
        remote_port: addr.port(),
        remote_request_id: "cmpl-never-0".into(),
        tp_size: 1,
        ..KvTransferParams::default()
    };
    let t0 = Instant::now();
    let blocks = d.admit("cmpl-never-0-d", 40, params, t0);
    let mut failed = false;
    run(&mut p, &mut d, |_, fd| {
        assert!(fd.recving.is_empty(), "D received what P never had: {fd:?}");
        failed |= fd.failed_recving.contains(&"cmpl-never-0-d".to_string());
        failed || t0.elapsed() > Duration::from_secs(40)
    });
    let took = t0.elapsed();
    println!("    refused and failed after {:.2} s", took.as_secs_f64());
    assert!(failed, "D still waits after {took:?}");
    // a lease (2 s) and the withdrawal's round trip, far inside the 60 s timeout
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(!d.sched.has_pending_push_work());
    d.check_layers(7, &blocks, &[], None); // all zeros
}

/// Push: P dies after D's registration reached it and before it wrote. D fails the receive
/// as soon as it sees P's connection end, not after a lease or `push_registration_timeout`
/// (30 s and 60 s here); nothing lands in D's blocks.
#[test]
fn a_registration_out_to_a_p_that_died_fails_when_its_connection_ends() {
    let json = |role: &str| {
        format!(
            r#"{{"kv_connector":"KvrailPushConnector","kv_role":"{role}","kv_buffer_device":"rbln",
            "kv_connector_extra_config":{{"kv_lease_duration":30,"push_registration_timeout":60}}}}"#
        )
    };
    let mut p = engine("prefill-dies", &json("kv_producer"), false);
    let mut d = engine("decode-orphan", &json("kv_consumer"), true);
    let addr = p.worker.agent().side_channel_addr();
    let params = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: "prefill-dies".into(),
        remote_host: addr.ip().to_string(),
        remote_port: addr.port(),
        remote_request_id: "cmpl-orphan-0".into(),
        tp_size: 1,
        ..KvTransferParams::default()
    };
    let t0 = Instant::now();
    let blocks = d.admit("cmpl-orphan-0-d", 40, params, t0);
    // the registration reaches P, which holds no prefill yet and waits for it
    run(&mut p, &mut d, |_, _| {
        t0.elapsed() > Duration::from_millis(500)
    });
    drop(p);
    let t1 = Instant::now();
    let mut failed = false;
    while !failed && t1.elapsed() < Duration::from_secs(40) {
        let f = d.step(Instant::now());
        assert!(f.recving.is_empty(), "D received from a dead P: {f:?}");
        failed = f.failed_recving.contains(&"cmpl-orphan-0-d".to_string());
        std::thread::sleep(Duration::from_millis(2));
    }
    let took = t1.elapsed();
    println!("    failed {:.2} s after P died", took.as_secs_f64());
    assert!(failed, "D still waits {took:?} after P died");
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(!d.sched.has_pending_push_work());
    d.check_layers(7, &blocks, &[], None); // all zeros
}

/// Push: D aborts a request while its registration is out. P drops the registration and
/// confirms; only then does D report the request (its blocks may be freed). P's prefill,
/// finished afterwards, writes nothing into D's blocks. With no P to confirm, D gives the
/// blocks back after `push_registration_timeout`.
#[test]
fn an_aborted_push_registration_is_withdrawn_before_d_frees_its_blocks() {
    let json = |role: &str| {
        format!(
            r#"{{"kv_connector":"KvrailPushConnector","kv_role":"{role}","kv_buffer_device":"rbln",
            "kv_connector_extra_config":{{"kv_lease_duration":2,"push_registration_timeout":3}}}}"#
        )
    };
    let mut p = engine("prefill-abort", &json("kv_producer"), false);
    let mut d = engine("decode-abort", &json("kv_consumer"), true);
    let addr = p.worker.agent().side_channel_addr();
    let params = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: "prefill-abort".into(),
        remote_host: addr.ip().to_string(),
        remote_port: addr.port(),
        remote_request_id: "cmpl-abort-0".into(),
        tp_size: 1,
        ..KvTransferParams::default()
    };
    let t0 = Instant::now();
    let blocks = d.admit("cmpl-abort-0-d", 40, params.clone(), t0);
    // the registration reaches P (P has not prefilled: it waits there, unmatched)
    run(&mut p, &mut d, |_, _| {
        t0.elapsed() > Duration::from_millis(300)
    });
    // the engine aborts the request: D keeps its blocks until P confirmed
    let req = EngineRequest {
        request_id: "cmpl-abort-0-d".into(),
        prompt_tokens: 40,
        params: Some(params),
    };
    let (delay, none) = d.sched.request_finished(&req, &blocks);
    assert!(
        delay && none.is_none(),
        "D must hold the blocks until P confirmed"
    );
    assert!(d.sched.has_pending_push_work());
    let mut freed = false;
    run(&mut p, &mut d, |_, fd| {
        assert!(
            fd.recving.is_empty() && fd.failed_recving.is_empty(),
            "{fd:?}"
        );
        freed |= fd.sending.contains(&"cmpl-abort-0-d".to_string());
        freed
    });
    let confirmed = t0.elapsed();
    println!(
        "    withdrawal confirmed by P after {:.2} s",
        confirmed.as_secs_f64()
    );
    // P's confirmation, not D's 3 s timeout, gave the blocks back
    assert!(confirmed < Duration::from_secs(3), "{confirmed:?}");
    assert!(!d.sched.has_pending_push_work());
    // P's prefill of the same request now finishes: nothing may land in D's blocks
    let _ = p.prefill("cmpl-abort-0", 7, 40);
    let t1 = Instant::now();
    run(&mut p, &mut d, |fp, fd| {
        assert!(
            fd.recving.is_empty(),
            "D received a withdrawn request: {fd:?}"
        );
        // P gives its blocks back when the lease ends (no D will ever read them)
        fp.sending.contains(&"cmpl-abort-0".to_string()) || t1.elapsed() > Duration::from_secs(20)
    });
    d.check_layers(7, &blocks, &[], None); // still all zeros
                                           // a P that never got the registration (unreachable): nothing was sent, nothing can be
                                           // written, the blocks come back at once
    let mut d2 = engine("decode-abort-2", &json("kv_consumer"), true);
    let dead = KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: "prefill-gone".into(),
        remote_host: "127.0.0.1".into(),
        remote_port: 1,
        remote_request_id: "cmpl-gone-0".into(),
        tp_size: 1,
        ..KvTransferParams::default()
    };
    let t2 = Instant::now();
    let b2 = d2.admit("cmpl-gone-0-d", 40, dead.clone(), t2);
    let first = d2.step(Instant::now());
    let req2 = EngineRequest {
        request_id: "cmpl-gone-0-d".into(),
        prompt_tokens: 40,
        params: Some(dead),
    };
    let delayed = d2.sched.request_finished(&req2, &b2).0;
    if first.failed_recving.contains(&"cmpl-gone-0-d".to_string()) {
        // (a loaded machine: the refused connection already failed the receive in that
        // step, so the blocks are the engine's at once)
        assert!(!delayed, "a failed receive must not hold its blocks");
        return;
    }
    assert!(delayed);
    let mut back = None;
    while t2.elapsed() < Duration::from_secs(30) {
        let f = d2.step(Instant::now());
        if f.sending.contains(&"cmpl-gone-0-d".to_string()) {
            back = Some(t2.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let back = back.expect("the blocks never came back");
    println!(
        "    registration never sent: blocks back after {:.2} s",
        back.as_secs_f64()
    );
    assert!(
        back < Duration::from_secs(2),
        "waited for a confirmation nobody owes"
    );
}
