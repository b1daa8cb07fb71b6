//! `kvrail-demo --soak`: many requests through the P/D pair while P and D are killed
//! (SIGKILL) and restarted at random. Every request gets exactly one outcome:
//!
//! - **completed**: D had every KV byte and checked it;
//! - **failed cleanly**: an instance said the request failed (its peer died, no blocks);
//! - **lost with a killed instance**: the instance holding it was killed (the proxy knows);
//! - **wrong bytes**: D found KV that differs (must be 0);
//! - **hung**: no outcome by its deadline (must be 0).
//!
//! At the end, after every lease ran out, P and D must hold no blocks (leaks must be 0).
//! The proxy reads both instances' answers on threads of their own, so a dead instance is
//! noticed at once and never blocks the others.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{coordinates, requests, spawn, Args, Inst, Mode, Req};

/// Which instance a message came from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    P,
    D,
}

/// A message from an instance (None: its control connection ended), with the instance's
/// generation (one per start).
type Event = (Who, u64, Option<Value>);

struct Live {
    inst: Inst,
    gen: u64,
}

/// Where a request stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    /// Sent to P (pull: D gets it with P's parameters).
    Prefill,
    /// With D (push: P prefills at the same time).
    Decode,
}

struct Flight {
    stage: Stage,
    p_gen: u64,
    d_gen: u64,
    deadline: Instant,
}

/// The tallies the soak reports.
#[derive(Default, Debug)]
struct Tally {
    completed: u64,
    failed_cleanly: u64,
    lost_with_killed: u64,
    wrong_bytes: u64,
    hung: u64,
    kills_p: u64,
    kills_d: u64,
    bytes: u64,
}

/// A small PRNG (xorshift*), seeded: a soak can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// True with probability 1/n.
    fn one_in(&mut self, n: u64) -> bool {
        self.next().is_multiple_of(n.max(1))
    }
}

/// Start an instance and a thread that forwards its answers as events.
fn start(a: &Args, who: Who, gen: u64, tx: &mpsc::Sender<Event>) -> Result<Live, String> {
    let (name, role, devs) = match who {
        Who::P => ("prefill-0", "kv_producer", a.devices_of(true)),
        Who::D => ("decode-0", "kv_consumer", a.devices_of(false)),
    };
    let mut inst = spawn(a, name, role, devs)?;
    let mut lines = std::mem::replace(
        &mut inst.lines,
        std::io::BufReader::new(inst.ctl.try_clone().map_err(|e| e.to_string())?),
    );
    let tx = tx.clone();
    std::thread::spawn(move || loop {
        let mut line = String::new();
        match std::io::BufRead::read_line(&mut lines, &mut line) {
            Ok(0) | Err(_) => {
                let _ = tx.send((who, gen, None));
                return;
            }
            Ok(_) => {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send((who, gen, Some(v)));
                }
            }
        }
    });
    Ok(Live { inst, gen })
}

/// Ask an instance for its stats and wait for the answer among the events.
fn stats(l: &mut Live, who: Who, rx: &mpsc::Receiver<Event>) -> Result<Value, String> {
    l.inst.send(json!({"cmd": "stats"}))?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((w, g, Some(v))) if w == who && g == l.gen && v.get("stats").is_some() => {
                return Ok(v["stats"].clone())
            }
            Ok((w, g, None)) if w == who && g == l.gen => {
                return Err(format!("{who:?} died while asked for its stats"))
            }
            _ => {}
        }
    }
    Err(format!("{who:?} did not answer for its stats"))
}

/// Run the soak: `a.requests` requests, an instance killed after about one outcome in
/// `a.kill_every`.
pub(crate) fn run(a: &Args) -> Result<(), String> {
    let reqs = requests(a);
    let by_id: HashMap<&str, &Req> = reqs.iter().map(|r| (r.id.as_str(), r)).collect();
    let (tx, rx) = mpsc::channel::<Event>();
    let mut gen = 0u64;
    let mut p = start(a, Who::P, gen, &tx)?;
    let mut d = start(a, Who::D, gen, &tx)?;
    outln!(
        "kvrail-demo soak: {:?} mode, P on {}, D on {}; {} requests, {} at once, an instance killed after about every {} outcomes; lease {} s",
        a.mode, p.inst.backend, d.inst.backend, reqs.len(), a.concurrency, a.kill_every, a.lease
    );
    outln!("{}", super::metadata_line(a));
    // the most a request may take: a lease (P's blocks of a dead D), the push registration
    // timeout (D's registration with a dead P), and a margin for restarts
    let limit = Duration::from_secs(2 * a.lease + 30);
    let mut rng = Rng(0x0005_0ac0_ffee ^ a.kill_every);
    let mut flights: HashMap<String, Flight> = HashMap::new();
    let mut t = Tally::default();
    let (mut next, mut outcomes) = (0usize, 0usize);
    let t0 = Instant::now();
    while outcomes < reqs.len() {
        while flights.len() < a.concurrency && next < reqs.len() {
            let r = &reqs[next];
            next += 1;
            let f = Flight {
                stage: Stage::Prefill,
                p_gen: p.gen,
                d_gen: d.gen,
                deadline: Instant::now() + limit,
            };
            let f = if a.mode == Mode::Push {
                d.inst
                    .send(json!({"cmd": "decode", "id": r.id, "seed": r.seed,
                    "tokens": r.tokens, "params": coordinates(&p.inst, r)}))?;
                Flight {
                    stage: Stage::Decode,
                    ..f
                }
            } else {
                f
            };
            p.inst
                .send(json!({"cmd": "prefill", "id": r.id, "seed": r.seed, "tokens": r.tokens}))?;
            flights.insert(r.id.clone(), f);
        }
        let mut ended = Vec::new();
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok((Who::P, g, Some(v))) if g == p.gen => {
                let id = v["id"].as_str().unwrap_or("").to_owned();
                let Some(f) = flights.get_mut(&id) else {
                    continue;
                };
                if v.get("error").is_some() {
                    ended.push((id, "failed"));
                } else if f.stage == Stage::Prefill && a.mode == Mode::Pull {
                    let r = by_id[id.as_str()];
                    d.inst
                        .send(json!({"cmd": "decode", "id": r.id, "seed": r.seed,
                        "tokens": r.tokens, "params": p.inst.params(v["params"].clone())}))?;
                    f.stage = Stage::Decode;
                    f.d_gen = d.gen;
                }
            }
            Ok((Who::D, g, Some(v))) if g == d.gen => {
                let id = v["id"].as_str().unwrap_or("").to_owned();
                if flights.contains_key(&id) {
                    let e = v["error"].as_str().unwrap_or("");
                    ended.push((
                        id,
                        if v["ok"] == json!(true) {
                            t.bytes += v["bytes"].as_u64().unwrap_or(0);
                            "completed"
                        } else if e.starts_with("KV differs") {
                            "wrong"
                        } else {
                            "failed"
                        },
                    ));
                }
            }
            Ok((who, g, None))
                if (who == Who::P && g == p.gen) || (who == Who::D && g == d.gen) =>
            {
                return Err(format!("{who:?} died without being killed"));
            }
            _ => {}
        }
        for (id, how) in ended {
            flights.remove(&id);
            outcomes += 1;
            match how {
                "completed" => t.completed += 1,
                "wrong" => t.wrong_bytes += 1,
                _ => t.failed_cleanly += 1,
            }
            if outcomes < reqs.len() && rng.one_in(a.kill_every) {
                gen += 1;
                let who = if rng.one_in(2) { Who::P } else { Who::D };
                let l = if who == Who::P { &mut p } else { &mut d };
                let _ = l.inst.child.kill();
                let _ = l.inst.child.wait();
                let old = l.gen;
                *l = start(a, who, gen, &tx)?;
                eprintln!(
                    "kvrail-demo soak: killed {who:?} after {outcomes} outcomes ({} in flight); restarted",
                    flights.len()
                );
                // what only the dead instance held is lost with it: P's unanswered
                // prefills (pull), D's requests
                let lost: Vec<String> = flights
                    .iter()
                    .filter(|(_, f)| match who {
                        Who::P => f.p_gen == old && f.stage == Stage::Prefill,
                        Who::D => f.d_gen == old && f.stage == Stage::Decode,
                    })
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in lost {
                    flights.remove(&id);
                    outcomes += 1;
                    t.lost_with_killed += 1;
                }
                match who {
                    Who::P => t.kills_p += 1,
                    Who::D => t.kills_d += 1,
                }
            }
        }
        let now = Instant::now();
        let hung: Vec<String> = flights
            .iter()
            .filter(|(_, f)| f.deadline < now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in hung {
            eprintln!(
                "kvrail-demo soak: {id} HUNG: no outcome in {} s",
                limit.as_secs()
            );
            flights.remove(&id);
            outcomes += 1;
            t.hung += 1;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    // every lease runs out: nothing may stay held
    let settle = Instant::now();
    let (ps, ds) = loop {
        let (ps, ds) = (stats(&mut p, Who::P, &rx)?, stats(&mut d, Who::D, &rx)?);
        let clean = ps["held"] == json!(0)
            && ps["free_blocks"] == json!(a.num_blocks)
            && ds["free_blocks"] == json!(a.num_blocks)
            && ps["grants"] == json!(0)
            && ds["grants"] == json!(0);
        if clean || settle.elapsed() > Duration::from_secs(a.lease + 15) {
            break (ps, ds);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let leaked = a
        .num_blocks
        .saturating_sub(ps["free_blocks"].as_u64().unwrap_or(0))
        + a.num_blocks
            .saturating_sub(ds["free_blocks"].as_u64().unwrap_or(0));
    // grants over blocks given back must all be revoked (fence_blocks)
    let grants = ps["grants"].as_u64().unwrap_or(0) + ds["grants"].as_u64().unwrap_or(0);
    for l in [&mut p, &mut d] {
        let _ = l.inst.send(json!({"cmd": "quit"}));
        let _ = l.inst.child.wait();
    }
    outln!(
        "soak: {} requests in {secs:.1} s with {} kills of P and {} of D: {} completed byte-exact ({:.1} MiB), {} failed cleanly, {} lost with a killed instance, {} wrong bytes, {} hung; blocks leaked after the leases ran out: {leaked}, grants not revoked: {grants} (P held {}, settled in {:.1} s)",
        reqs.len(),
        t.kills_p,
        t.kills_d,
        t.completed,
        t.bytes as f64 / (1 << 20) as f64,
        t.failed_cleanly,
        t.lost_with_killed,
        t.wrong_bytes,
        t.hung,
        ps["held"],
        settle.elapsed().as_secs_f64()
    );
    if t.wrong_bytes > 0 || t.hung > 0 || leaked > 0 || grants > 0 || t.completed == 0 {
        return Err(format!(
            "soak failed: {t:?}, {leaked} blocks leaked, {grants} grants not revoked"
        ));
    }
    Ok(())
}
