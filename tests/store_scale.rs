//! Many agents through one real etcd, each in its own process (TCP backend): 64 agents
//! publish, each loads 8 random peers by name and READs each one's region byte-exact; then 16
//! are SIGKILLed and restarted (a new incarnation: another pattern in its memory). Every
//! transfer afterwards must reach the live incarnation (its pattern, never an error and never
//! the dead one's bytes). Prints metadata fetch latency (p50/p99), load-by-name latency, and
//! how long a crashed agent's key outlives it (≈ its 3 s lease TTL).
//!
//! `KVRAIL_SCALE_AGENTS` / `KVRAIL_SCALE_KILL` change the counts (64 / 16).

#[path = "etcd/mod.rs"]
mod etcd;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvrail::agent::XferStatus;
use kvrail::agent::{Agent, AgentConfig, BackendChoice, Desc, RegionId, RemoteAccess, XferOp};
use kvrail::store::{EtcdStore, StoreConfig};

const LEN: usize = 256 << 10;
const TTL_S: u64 = 3;
const PEERS: usize = 8;

fn store(url: &str, ns: &str) -> StoreConfig {
    let mut s = StoreConfig::from_url(url).unwrap();
    s.namespace = ns.into();
    s.lease_ttl = Duration::from_secs(TTL_S);
    s
}

/// Agent `name`'s bytes in incarnation `gen`: the generation in the first 8 bytes, then a
/// pattern of both.
fn memory(name: &str, gen: u64) -> Vec<u8> {
    let seed = name
        .bytes()
        .fold(gen.wrapping_mul(0x100_0000_01B3), |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
        });
    let mut v: Vec<u8> = (0..LEN as u64)
        .map(|i| ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect();
    v[..8].copy_from_slice(&gen.to_le_bytes());
    v
}

/// READ peer `p`'s region 1 into `dst`; its generation when every byte is what that
/// generation holds, else the error.
fn read_peer(a: &Agent, dst: RegionId, p: &str) -> Result<u64, String> {
    let x = a
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, LEN as u64)],
            p,
            vec![Desc::new(RegionId(1), 0, LEN as u64)],
            None,
        )
        .map_err(|e| e.to_string())?;
    a.post(x).map_err(|e| e.to_string())?;
    let st = a
        .wait(x, Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    a.release(x).ok();
    if st != XferStatus::Done {
        return Err(format!("{st:?}"));
    }
    let mut got = vec![0u8; LEN];
    a.read_region(dst, 0, &mut got).unwrap();
    let gen = u64::from_le_bytes(got[..8].try_into().unwrap());
    if got == memory(p, gen) {
        Ok(gen)
    } else {
        Err("bytes differ from every incarnation's".into())
    }
}

/// A child: agent `KVRAIL_SCALE_CHILD`, incarnation `KVRAIL_GEN`, answering commands on stdin:
/// `LOAD p…` (by name, timed, then a READ each) and `XFER p…` (a READ each, loading again a
/// peer that is not connected), one answer line per peer.
fn child_main(name: &str) {
    let url = std::env::var("KVRAIL_ETCD").unwrap();
    let ns = std::env::var("KVRAIL_NS").unwrap();
    let gen: u64 = std::env::var("KVRAIL_GEN").unwrap().parse().unwrap();
    let cfg = AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend: BackendChoice::Tcp,
        metadata_store: Some(store(&url, &ns)),
        ..AgentConfig::default()
    };
    let a = Agent::new(name, cfg).unwrap();
    let src = a.register(LEN, RemoteAccess::READ, vec![]).unwrap();
    assert_eq!(src, RegionId(1));
    a.write_region(src, 0, &memory(name, gen)).unwrap();
    let dst = a.register(LEN, RemoteAccess::NONE, vec![]).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    let mut loaded_as = std::collections::HashMap::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let mut w = line.split_whitespace();
        let cmd = w.next().unwrap_or("");
        for p in w {
            let t = Instant::now();
            let (how, r) = if cmd == "LOAD" {
                match a.load_by_name(p) {
                    Ok(_) => ("load", Ok(())),
                    Err(e) => ("load", Err(e.to_string())),
                }
            } else if a.peer_connected(p) {
                // still connected: reloaded by the store's watch if its incarnation changed
                let by_watch = a.peer_incarnation(p) != loaded_as.get(p).copied().flatten();
                (if by_watch { "watch" } else { "same" }, Ok(()))
            } else {
                (
                    "reload",
                    a.load_by_name(p).map(drop).map_err(|e| e.to_string()),
                )
            };
            let us = t.elapsed().as_micros();
            loaded_as.insert(p.to_owned(), a.peer_incarnation(p));
            let answer = match r.and_then(|()| read_peer(&a, dst, p)) {
                Ok(g) => format!("{p} {how} {us} gen {g}"),
                Err(e) => format!("{p} {how} {us} err {}", e.replace('\n', " ")),
            };
            writeln!(out, "{answer}").unwrap();
        }
        writeln!(out, "DONE").unwrap();
        out.flush().unwrap();
    }
}

struct Kid {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Kid {
    fn spawn(name: &str, gen: u64, url: &str, ns: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sixty_four_agents_crash_and_come_back",
                "--nocapture",
            ])
            .env("KVRAIL_SCALE_CHILD", name)
            .env("KVRAIL_ETCD", url)
            .env("KVRAIL_NS", ns)
            .env("KVRAIL_GEN", gen.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Self {
            name: name.into(),
            child,
            stdin,
            out,
        }
    }

    /// The next line that is not the test harness's own.
    fn line(&mut self) -> String {
        loop {
            let mut l = String::new();
            assert!(
                self.out.read_line(&mut l).unwrap() > 0,
                "{} said nothing more",
                self.name
            );
            let l = l.trim();
            if !l.is_empty() && !l.starts_with("running ") && !l.starts_with("test ") {
                return l.to_owned();
            }
        }
    }

    fn ready(&mut self) {
        let l = self.line();
        assert_eq!(l, "READY", "{}", self.name);
    }

    fn send(&mut self, cmd: &str, peers: &[String]) {
        let s = self.stdin.as_mut().unwrap();
        writeln!(s, "{cmd} {}", peers.join(" ")).unwrap();
        s.flush().unwrap();
    }

    /// The answers to the last command: (peer, how, µs, Ok(gen) | Err(why)).
    fn answers(&mut self) -> Vec<(String, String, u64, Result<u64, String>)> {
        let mut v = Vec::new();
        loop {
            let l = self.line();
            if l == "DONE" {
                return v;
            }
            let f: Vec<&str> = l.splitn(5, ' ').collect();
            let r = match f[3] {
                "gen" => Ok(f[4].parse().unwrap()),
                _ => Err(f[4].to_owned()),
            };
            v.push((f[0].into(), f[1].into(), f[2].parse().unwrap(), r));
        }
    }

    fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        drop(self.stdin.take());
        self.sigkill();
    }
}

/// A tiny deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn pct(v: &mut [u64], p: usize) -> u64 {
    v.sort_unstable();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn env_count(k: &str, default: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn sixty_four_agents_crash_and_come_back() {
    if let Ok(name) = std::env::var("KVRAIL_SCALE_CHILD") {
        return child_main(&name);
    }
    let n = env_count("KVRAIL_SCALE_AGENTS", 64);
    let kill = env_count("KVRAIL_SCALE_KILL", 16).min(n);
    let e = etcd::Etcd::start();
    let ns = etcd::namespace("scale");
    let url = e.url();
    let names: Vec<String> = (0..n).map(|i| format!("agent-{i:02}")).collect();
    let t0 = Instant::now();
    let mut kids: Vec<Kid> = names.iter().map(|m| Kid::spawn(m, 1, &url, &ns)).collect();
    kids.iter_mut().for_each(Kid::ready);
    let started = t0.elapsed();
    let mut rng = Rng(0x5eed_cafe_f00d_1234);
    let peers: Vec<Vec<String>> = (0..n)
        .map(|i| {
            let mut v = Vec::new();
            while v.len() < PEERS.min(n - 1) {
                let j = rng.below(n);
                if j != i && !v.contains(&names[j]) {
                    v.push(names[j].clone());
                }
            }
            v
        })
        .collect();
    // every agent loads its peers by name and READs each one
    for (k, p) in kids.iter_mut().zip(&peers) {
        k.send("LOAD", p);
    }
    let mut load_us = Vec::new();
    for k in &mut kids {
        for (p, _, us, r) in k.answers() {
            assert_eq!(r, Ok(1), "{} loading {p}", k.name);
            load_us.push(us);
        }
    }
    // the store's own fetch latency, with every agent live
    let w = EtcdStore::connect(&store(&url, &ns)).unwrap();
    assert_eq!(w.agents().unwrap().len(), n);
    let mut fetch_us: Vec<u64> = (0..512)
        .map(|_| {
            let name = &names[rng.below(n)];
            let t = Instant::now();
            assert!(w.fetch(name).unwrap().is_some());
            t.elapsed().as_micros() as u64
        })
        .collect();
    // SIGKILL `kill` of them at once; each key must go by itself (the lease runs out)
    let mut victims: Vec<usize> = Vec::new();
    while victims.len() < kill {
        let j = rng.below(n);
        if !victims.contains(&j) {
            victims.push(j);
        }
    }
    let tk = Instant::now();
    for &j in &victims {
        kids[j].sigkill();
    }
    let mut gone_ms = Vec::new();
    let mut left: Vec<usize> = victims.clone();
    while !left.is_empty() {
        assert!(
            tk.elapsed() < Duration::from_secs(TTL_S * 10),
            "keys of {left:?} outlived their lease"
        );
        left.retain(|&j| {
            let present = w.fetch(&names[j]).unwrap().is_some();
            if !present {
                gone_ms.push(tk.elapsed().as_millis() as u64);
            }
            present
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    // restart them: new incarnations (generation 2) under the same names
    for &j in &victims {
        kids[j] = Kid::spawn(&names[j], 2, &url, &ns);
    }
    for &j in &victims {
        kids[j].ready();
    }
    let want_gen = |p: &str| {
        if victims.iter().any(|&j| names[j] == p) {
            2
        } else {
            1
        }
    };
    // every agent transfers again: survivors to their (partly restarted) peers, the
    // restarted ones load theirs afresh; nothing may reach a dead incarnation
    for (i, k) in kids.iter_mut().enumerate() {
        let cmd = if victims.contains(&i) { "LOAD" } else { "XFER" };
        k.send(cmd, &peers[i]);
    }
    let (mut moved, mut dead, mut by_watch, mut reloaded, mut to_restarted) = (0, 0, 0, 0, 0);
    for k in &mut kids {
        for (p, how, _, r) in k.answers() {
            match r {
                Ok(g) if g == want_gen(&p) => moved += 1,
                other => {
                    eprintln!(
                        "{} → {p} ({how}): {other:?}, want generation {}",
                        k.name,
                        want_gen(&p)
                    );
                    dead += 1;
                }
            }
            if want_gen(&p) == 2 && how != "load" {
                to_restarted += 1;
                by_watch += usize::from(how == "watch");
                reloaded += usize::from(how == "reload");
            }
        }
    }
    let total = n * PEERS.min(n - 1);
    println!(
        "store scale: {n} agents (TCP, each its own process) up in {:.1} s; {} loads by name: \
         load+handshake p50 {:.2} ms p99 {:.2} ms; etcd fetch p50 {:.2} ms p99 {:.2} ms (512)",
        started.as_secs_f64(),
        load_us.len(),
        pct(&mut load_us, 50) as f64 / 1e3,
        pct(&mut load_us, 99) as f64 / 1e3,
        pct(&mut fetch_us, 50) as f64 / 1e3,
        pct(&mut fetch_us, 99) as f64 / 1e3,
    );
    println!(
        "store scale: {kill} SIGKILLed: key gone after p50 {:.2} s, max {:.2} s (lease TTL {TTL_S} s); \
         after their restart {moved} of {total} transfers byte-exact from the live incarnation, \
         {dead} failed or reached a dead one; of {to_restarted} survivor transfers to restarted \
         peers, {by_watch} went to the incarnation the watch had loaded, {reloaded} loaded it then",
        pct(&mut gone_ms, 50) as f64 / 1e3,
        pct(&mut gone_ms, 100) as f64 / 1e3,
    );
    assert_eq!(
        dead, 0,
        "transfers that failed or reached a dead incarnation"
    );
    assert_eq!(moved, total);
}
