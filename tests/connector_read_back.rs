//! Multi-turn KV reuse (seed 003, `bidirectional_kv_xfer`) between two real connector
//! engines (scheduler + worker each) in pull and in push, on TCP here (verbs in the lab):
//! - D keeps a decoded turn's blocks for `decoder_kv_blocks_ttl` and returns parameters
//!   naming them; the next turn, sent to P with them, READs that KV back byte-exact into
//!   the blocks after P's own cached prefix (which stay untouched), and D gives its blocks
//!   back on P's completion;
//! - the expiry travels in D's clock: with D's clock an hour ahead or behind, P converts it
//!   with the offset measured from its grant question's round trip, reads in time, and
//!   declines (reads nothing) when too little time is left;
//! - a read after D gave its blocks back (the expiry not forwarded) is refused by D's
//!   fence, and nothing lands.

mod lab;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::Agent;
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::{
    agent_config, EngineRequest, Finished, KvCaches, KvLayout, KvTransferParams, RequestEnd,
    Scheduler, Worker,
};

const BLOCK: u64 = 4096;
const HOUR_US: i64 = 3_600_000_000;

fn layout() -> KvLayout {
    lab::kv_layout(2, 16, BLOCK, 1)
}

struct Engine {
    sched: Scheduler,
    worker: Worker,
}

fn engine(dir: &str, role: &str, name: &str, ttl: u64, host_a: bool) -> Engine {
    let cfg = KvTransferConfig::from_json(&format!(
        r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}",
            "kv_connector_extra_config":{{"bidirectional_kv_xfer":true,
            "decoder_kv_blocks_ttl":{ttl},"kv_recompute_threshold":16}}}}"#
    ))
    .unwrap();
    let l = layout();
    let a = Agent::new(name, agent_config(&cfg, &l, lab::agent_config(host_a))).unwrap();
    let a = Arc::new(a);
    let sched = Scheduler::new(cfg.clone(), name, a.side_channel_addr(), 1);
    let worker = Worker::with_caches(a, cfg, l, (0, 1), KvCaches::Allocate).unwrap();
    Engine { sched, worker }
}

/// Every byte of block `b` (both planes of every layer) of `w`'s cache.
fn block(w: &Worker, b: u64) -> Vec<u8> {
    let l = layout();
    let mut out = Vec::new();
    for &r in w.regions() {
        for plane in 0..l.planes {
            let mut buf = vec![0u8; BLOCK as usize];
            w.agent()
                .read_region(r, l.offset(plane, b), &mut buf)
                .unwrap();
            out.extend(buf);
        }
    }
    out
}

fn fill(w: &Worker, b: u64, seed: u64) {
    let l = layout();
    for (i, &r) in w.regions().iter().enumerate() {
        for plane in 0..l.planes {
            let s = seed * 1000 + i as u64 * 10 + plane;
            let bytes = lab::pattern(s, BLOCK as usize);
            w.agent()
                .write_region(r, l.offset(plane, b), &bytes)
                .unwrap();
        }
    }
}

/// D decoded turn 1 (40 tokens of KV in its blocks 3-5, a pattern each) and finished it:
/// returns the next turn's parameters.
fn d_finishes_turn_one(d: &mut Engine, now: Instant) -> KvTransferParams {
    assert_eq!(d.worker.regions().len(), layout().layers.len());
    for b in 3..6 {
        fill(&d.worker, b, b);
    }
    let turn1 = EngineRequest {
        request_id: "turn1-d".into(),
        prompt_tokens: 30,
        params: Some(KvTransferParams {
            remote_engine_id: "prefill".into(),
            remote_request_id: "turn1-p".into(),
            ..KvTransferParams::default()
        }),
    };
    let end = RequestEnd {
        completed: true,
        computed_tokens: 40,
    };
    let (keep, params) = d.sched.request_finished_as(&turn1, &[3, 4, 5], end);
    assert!(keep, "D keeps the blocks for the next turn");
    d.worker
        .start_load_kv(&d.sched.build_connector_meta(now), now);
    assert_eq!(d.worker.leased(), 1);
    params.expect("the next turn's parameters")
}

/// P takes turn 2 (70 tokens) with D's parameters, its first `cached` tokens (whole blocks)
/// in its own prefix cache; drives both sides until P's receive ends. Returns P's report.
fn p_reads_turn_two(
    p: &mut Engine,
    d: &mut Engine,
    params: KvTransferParams,
    cached: u64,
) -> (Finished, Finished) {
    let now = Instant::now();
    let turn2 = EngineRequest {
        request_id: "turn2-p".into(),
        prompt_tokens: 70,
        params: Some(params),
    };
    let (n, load) = p.sched.get_num_new_matched_tokens(&turn2, cached, now);
    assert_eq!((n, load), (40 - cached, true));
    // P's blocks for the 70 tokens: 8-12, of which the first `cached / 16` hit its cache
    let fresh: Vec<u64> = (8 + cached / 16..13).collect();
    p.sched.update_state_after_alloc(&turn2, fresh, n, now);
    p.worker
        .start_load_kv(&p.sched.build_connector_meta(now), now);
    let (mut pf, mut df) = (Finished::default(), Finished::default());
    let t = Instant::now();
    let ended = |f: &Finished| {
        f.recving
            .iter()
            .chain(&f.failed_recving)
            .any(|id| id == "turn2-p")
    };
    while !ended(&pf) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "P's read-back never ended"
        );
        p.step(&mut pf);
        d.step(&mut df);
    }
    // D's completion: its blocks go back once P's notification arrived
    let t = Instant::now();
    while pf.recving.iter().any(|id| id == "turn2-p")
        && !df.sending.iter().any(|id| id == "turn1-d")
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "D never gave its blocks back"
        );
        d.step(&mut df);
    }
    (pf, df)
}

impl Engine {
    /// One engine step's report (the worker's, told to the scheduler), added to `seen`.
    fn step(&mut self, seen: &mut Finished) {
        let f = self.worker.get_finished(Instant::now());
        self.sched.update_connector_output(&f);
        seen.sending.extend(f.sending);
        seen.recving.extend(f.recving);
        seen.failed_recving.extend(f.failed_recving);
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pair(dir: &str, ttl: u64, d_skew_us: i64) -> (Engine, Engine) {
    let p = engine(dir, "kv_producer", "prefill", ttl, true);
    let mut d = engine(dir, "kv_consumer", "decode", ttl, false);
    d.sched.skew_clock(d_skew_us);
    d.worker.skew_clock(d_skew_us);
    (p, d)
}

/// Turn 2 reads turn 1's KV back from D, byte-exact, into the blocks after P's cached
/// prefix; D's clock an hour ahead or behind P's changes nothing.
#[test]
fn the_next_turn_reads_the_kept_blocks_back_byte_exact_whatever_d_clock_says() {
    for dir in ["Pull", "Push"] {
        for (skew, cached) in [(HOUR_US, 0), (-HOUR_US, 16), (0, 0)] {
            let (mut p, mut d) = pair(dir, 60, skew);
            let params = d_finishes_turn_one(&mut d, Instant::now());
            let mine = (8..13).map(|b| block(&p.worker, b)).collect::<Vec<_>>();
            fill(&p.worker, 8, 99); // P's cached prefix block, when it has one
            let cached_block = block(&p.worker, 8);
            let (pf, df) = p_reads_turn_two(&mut p, &mut d, params, cached);
            assert!(pf.failed_recving.is_empty(), "{dir} skew {skew}: {pf:?}");
            assert_eq!(p.worker.expired_reads, 0);
            let first = 8 + cached / 16;
            for (i, b) in (first..11).enumerate() {
                let from = 3 + cached / 16 + i as u64;
                assert!(
                    block(&p.worker, b) == block(&d.worker, from),
                    "{dir}: P's block {b} is not D's {from}"
                );
            }
            if cached > 0 {
                assert!(
                    block(&p.worker, 8) == cached_block,
                    "{dir}: P's cached block was written"
                );
            }
            for b in 11..13 {
                assert!(
                    block(&p.worker, b) == mine[(b - 8) as usize],
                    "{dir}: block {b} past D's tokens was written"
                );
            }
            assert!(
                df.sending.iter().any(|id| id == "turn1-d"),
                "{dir}: D kept its blocks"
            );
            assert_eq!(d.worker.leased(), 0);
            assert_eq!(d.sched.kept(), 0);
            assert_eq!(p.worker.read_backs, 1);
            assert_eq!(
                d.worker.leases_expired, 0,
                "{dir}: given back on P's completion"
            );
        }
    }
}

/// A TTL of 1 s leaves less than the READ's margin: P declines, whichever way D's clock is
/// skewed, and nothing lands in P's blocks (the engine computes the tokens).
#[test]
fn a_read_back_too_close_to_the_expiry_is_declined_and_reads_nothing() {
    for dir in ["Pull", "Push"] {
        for skew in [HOUR_US, -HOUR_US] {
            let (mut p, mut d) = pair(dir, 1, skew);
            let params = d_finishes_turn_one(&mut d, Instant::now());
            let before = (8..13).map(|b| block(&p.worker, b)).collect::<Vec<_>>();
            let posted = p.worker.bytes_posted();
            let (pf, _) = p_reads_turn_two(&mut p, &mut d, params, 0);
            assert_eq!(pf.failed_recving, ["turn2-p"], "{dir} skew {skew}");
            assert_eq!(p.worker.expired_reads, 1, "{dir} skew {skew}");
            assert_eq!(p.worker.bytes_posted(), posted, "{dir}: a READ was posted");
            for b in 8..13 {
                assert!(
                    block(&p.worker, b) == before[(b - 8) as usize],
                    "{dir}: block {b} written"
                );
            }
        }
    }
}

/// The expiry not forwarded (a proxy that drops it) and D's TTL over: D gave its blocks back
/// and reuses them; P's read is refused by D's fence and lands nothing.
#[test]
fn a_read_back_after_d_gave_its_blocks_back_is_refused_by_the_fence() {
    for dir in ["Pull", "Push"] {
        let (mut p, mut d) = pair(dir, 2, 0);
        let t0 = Instant::now();
        let mut params = d_finishes_turn_one(&mut d, t0);
        params.remote_blocks_expiry_time = None;
        let f = d.worker.get_finished(t0 + Duration::from_secs(3));
        assert_eq!(f.sending, ["turn1-d"], "{dir}: D's TTL ran out");
        assert_eq!(d.worker.leases_expired, 1);
        d.sched.update_connector_output(&f);
        for b in 3..6 {
            fill(&d.worker, b, 50 + b); // another request's KV
        }
        let before = (8..13).map(|b| block(&p.worker, b)).collect::<Vec<_>>();
        let (pf, _) = p_reads_turn_two(&mut p, &mut d, params, 0);
        assert_eq!(pf.failed_recving, ["turn2-p"], "{dir}");
        for b in 8..13 {
            assert!(
                block(&p.worker, b) == before[(b - 8) as usize],
                "{dir}: block {b} written"
            );
        }
    }
}
