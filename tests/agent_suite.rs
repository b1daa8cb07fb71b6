//! The agent's shared suite, run on both backends: on TCP on any host (`cargo test`), and on
//! verbs inside the kvrail lab (`tools/test.sh` runs it there), where the agents of "host A"
//! use rxeA* and those of "host B" rxeB*. Descriptor lists from 1 to 10,000 and sizes from 1
//! byte to 64 MiB (8 MiB on verbs, where rxe under emulation is slow), byte-exact both ways;
//! notifications after data; a 100,000-notification burst in order; validation naming the
//! descriptor; busy deregistration; handshake refusals; the loopback-advertise error; repost
//! rules; a peer that dies mid-transfer; two agents in two processes; protected mode (no
//! secret: loopback peers only). In the lab every agent of the suite proves a cluster secret.

#[path = "agent_suite/deregister.rs"]
mod deregister;
#[path = "agent_suite/driven.rs"]
mod driven;
#[path = "agent_suite/grants.rs"]
mod grants;
mod lab;
#[path = "agent_suite/metrics.rs"]
mod metrics;
#[path = "agent_suite/protected.rs"]
mod protected;
#[path = "agent_suite/tcp_conns.rs"]
mod tcp_conns;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvrail::agent::metadata::{AgentMetadata, BackendKind, MemKind, RegionMeta};
use kvrail::agent::{
    Agent, AgentConfig, AgentError, BackendChoice, Desc, Fault, MemRegion, RegionId, RemoteAccess,
    XferError, XferId, XferOp, XferStatus,
};
use kvrail::proto::handshake::HandshakeInfo;

/// Which lab host an agent stands on (which rails it gets on verbs).
#[derive(Clone, Copy)]
enum Host {
    A,
    B,
}

/// True inside the lab: the suite runs on verbs.
fn on_verbs() -> bool {
    lab::Topology::from_env().is_some()
}

fn cfg(host: Host) -> AgentConfig {
    let mut c = AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..AgentConfig::default()
    };
    if let Some(t) = lab::Topology::from_env() {
        c.backend = BackendChoice::Verbs;
        c.devices = match host {
            Host::A => t.a_devs,
            Host::B => t.b_devs,
        };
        // the lab's two hosts run as a cluster should: every handshake proves the secret
        // (protected.rs shows the refusal without one)
        c.cluster_secret = Some(kvrail::agent::ClusterSecret::new(LAB_SECRET).unwrap());
    }
    c
}

/// The cluster secret of the lab's agents (on TCP outside the lab: none, loopback only).
const LAB_SECRET: &str = "the kvrail lab's cluster secret";

/// [`cfg`] without a cluster secret on either backend: for an agent facing a fake peer that
/// speaks the wire without authentication, or a peer that has none (on loopback: served).
fn cfg_no_secret(host: Host) -> AgentConfig {
    AgentConfig {
        cluster_secret: None,
        ..cfg(host)
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            (((i ^ seed.rotate_left(13)).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 56) as u8 ^ i as u8
        })
        .collect()
}

fn wait(a: &Agent, x: XferId) -> XferStatus {
    lab::wait_xfer(a, x)
}

fn pair() -> (Agent, Agent, String) {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", cfg(Host::A)).unwrap();
    let name = d.load_remote(p.side_channel_addr()).unwrap();
    assert_eq!(name, "prefill-0");
    if on_verbs() {
        // the data and notifications go over queue pairs, not a TCP fallback
        assert_eq!(d.metadata().backend, BackendKind::Verbs);
        assert_eq!(d.peer_rails(&name), ["rxeA0:1", "rxeA1:1"]);
        assert_eq!(d.notif_rail(&name).as_deref(), Some("rxeA0:1"));
    }
    (p, d, name)
}

/// The bytes of the next `n` notifications at `a`, waiting at most `limit` for them.
fn collect_notifs(a: &Agent, n: usize, limit: Duration) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let t = Instant::now();
    while got.len() < n {
        got.extend(a.get_new_notifs().into_iter().map(|(_, b)| b));
        assert!(
            t.elapsed() < limit,
            "{} of {n} notifications arrived",
            got.len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

/// One transfer of `len` bytes from offset 0 of `local` to offset 0 of `peer`'s `remote`:
/// made, posted, waited for (it must be done) and released.
fn post_wait_release(
    a: &Agent,
    op: XferOp,
    (local, peer, remote): (RegionId, &str, RegionId),
    len: u64,
    notif: Option<Vec<u8>>,
) {
    let x = a
        .create_xfer(
            op,
            vec![Desc::new(local, 0, len)],
            peer,
            vec![Desc::new(remote, 0, len)],
            notif,
        )
        .unwrap();
    a.post(x).unwrap();
    assert_eq!(
        a.wait(x, Duration::from_secs(60)).unwrap(),
        XferStatus::Done
    );
    a.release(x).unwrap();
}

/// `a` (re)loads `b`'s metadata, e.g. after `b` registered memory.
fn load(a: &Agent, b: &Agent) -> String {
    a.load_remote(b.side_channel_addr()).unwrap()
}

/// Descriptors of `sizes` laid out one after another (64-byte gaps) in one region.
fn layout(sizes: &[u64]) -> (Vec<(u64, u64)>, u64) {
    let mut off = 3;
    let mut v = Vec::new();
    for &s in sizes {
        v.push((off, s));
        off += s + 64;
    }
    (v, off)
}

fn run_both_ways(sizes: &[u64]) {
    let (p, d, peer) = pair();
    let (segs, total) = layout(sizes);
    let src = p
        .register(total as usize, RemoteAccess::READ, vec![])
        .unwrap();
    let dst = d
        .register(total as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    load(&d, &p);
    let mut want = vec![0u8; total as usize];
    for (k, (off, len)) in segs.iter().enumerate() {
        let bytes = pattern(k as u64, *len as usize);
        p.write_region(src, *off, &bytes).unwrap();
        want[*off as usize..(*off + *len) as usize].copy_from_slice(&bytes);
    }
    // READ: D pulls P's descriptors into the same offsets of its region
    let ld: Vec<Desc> = segs.iter().map(|&(o, l)| Desc::new(dst, o, l)).collect();
    let rd: Vec<Desc> = segs.iter().map(|&(o, l)| Desc::new(src, o, l)).collect();
    let x = d.create_xfer(XferOp::Read, ld, &peer, rd, None).unwrap();
    d.post(x).unwrap();
    assert_eq!(wait(&d, x), XferStatus::Done);
    let mut got = vec![0u8; total as usize];
    d.read_region(dst, 0, &mut got).unwrap();
    assert!(
        got == want,
        "READ: bytes differ at {:?}",
        got.iter().zip(&want).position(|(a, b)| a != b)
    );
    // WRITE: P pushes them back into a fresh region of D's that allows remote WRITE
    let back = d
        .register(total as usize, RemoteAccess::WRITE, vec![])
        .unwrap();
    let dname = load(&p, &d);
    let ld: Vec<Desc> = segs.iter().map(|&(o, l)| Desc::new(src, o, l)).collect();
    let rd: Vec<Desc> = segs.iter().map(|&(o, l)| Desc::new(back, o, l)).collect();
    let x = p.create_xfer(XferOp::Write, ld, &dname, rd, None).unwrap();
    p.post(x).unwrap();
    assert_eq!(wait(&p, x), XferStatus::Done);
    d.read_region(back, 0, &mut got).unwrap();
    assert!(
        got == want,
        "WRITE: bytes differ at {:?}",
        got.iter().zip(&want).position(|(a, b)| a != b)
    );
}

#[test]
fn one_descriptor_sizes_1b_to_64mib() {
    let top = if on_verbs() { 8 << 20 } else { 64 << 20 };
    for s in [1u64, 7, 4096, 65_537, 1 << 20, top] {
        run_both_ways(&[s]);
    }
}

#[test]
fn descriptor_lists_up_to_10000() {
    run_both_ways(&(0..10).map(|i| 1 + i * 1000).collect::<Vec<_>>());
    run_both_ways(&(0..1000).map(|i| 1 + (i % 64) * 17).collect::<Vec<_>>());
    run_both_ways(&vec![128; 10_000]);
}

#[test]
fn notification_arrives_after_all_bytes() {
    let (p, d, _) = pair();
    const LEN: u64 = 8 << 20;
    let src = p
        .register(LEN as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let dst = d
        .register(LEN as usize, RemoteAccess::WRITE, vec![])
        .unwrap();
    let dname = load(&p, &d);
    for round in 0..5u64 {
        let bytes = pattern(100 + round, LEN as usize);
        p.write_region(src, 0, &bytes).unwrap();
        let descs: Vec<(u64, u64)> = (0..8).map(|k| (k * (1 << 20), 1 << 20)).collect();
        let x = p
            .create_xfer(
                XferOp::Write,
                descs.iter().map(|&(o, l)| Desc::new(src, o, l)).collect(),
                &dname,
                descs.iter().map(|&(o, l)| Desc::new(dst, o, l)).collect(),
                Some(format!("done-{round}").into_bytes()),
            )
            .unwrap();
        p.post(x).unwrap();
        // the receiver checks the bytes the moment the notification shows up
        let t = Instant::now();
        let n = loop {
            let n = d.get_new_notifs();
            if !n.is_empty() {
                break n;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "no notification");
            std::thread::yield_now();
        };
        let mut got = vec![0u8; LEN as usize];
        d.read_region(dst, 0, &mut got).unwrap();
        assert!(got == bytes, "notification {round} came before the data");
        assert_eq!(
            n,
            vec![(
                "prefill-0".to_string(),
                format!("done-{round}").into_bytes()
            )]
        );
        assert_eq!(wait(&p, x), XferStatus::Done);
        p.release(x).unwrap();
    }
}

#[test]
fn read_with_notification_tells_the_target() {
    let (p, d, peer) = pair();
    let src = p.register(4096, RemoteAccess::READ, vec![]).unwrap();
    let dst = d.register(4096, RemoteAccess::NONE, vec![]).unwrap();
    load(&d, &p);
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 4096)],
            &peer,
            vec![Desc::new(src, 0, 4096)],
            Some(b"req-7:1".to_vec()),
        )
        .unwrap();
    d.post(x).unwrap();
    assert_eq!(wait(&d, x), XferStatus::Done);
    let t = Instant::now();
    loop {
        let n = p.get_new_notifs();
        if !n.is_empty() {
            assert_eq!(n, vec![("decode-0".to_string(), b"req-7:1".to_vec())]);
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the target never heard of the READ"
        );
        std::thread::yield_now();
    }
}

/// Regression: the notification of a transfer released the moment it is done was lost
/// (it was looked up after the transfer was marked done; found by the C example).
#[test]
fn release_right_after_done_keeps_every_notification() {
    let (p, d, peer) = pair();
    let src = p.register(8192, RemoteAccess::READ_WRITE, vec![]).unwrap();
    let dst = d.register(8192, RemoteAccess::NONE, vec![]).unwrap();
    load(&d, &p);
    let rounds = 300;
    for i in 0..rounds {
        let op = if i % 2 == 0 {
            XferOp::Read
        } else {
            XferOp::Write
        };
        let notif = Some(format!("n{i}").into_bytes());
        post_wait_release(&d, op, (dst, &peer, src), 8192, notif);
    }
    let got = collect_notifs(&p, rounds, Duration::from_secs(60));
    let want: Vec<Vec<u8>> = (0..rounds).map(|i| format!("n{i}").into_bytes()).collect();
    assert_eq!(got, want);
}

/// Regression: two threads loading the same peer at once each connected, and the second
/// closed the first's connection with messages on it (found by the connector's push writer
/// and worker handshaking with the same P concurrently).
#[test]
fn concurrent_loads_of_one_peer_share_one_connection() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = std::sync::Arc::new(Agent::new("decode-0", cfg(Host::A)).unwrap());
    let addr = p.side_channel_addr();
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let d = d.clone();
            std::thread::spawn(move || {
                let name = d.load_remote(addr).unwrap();
                d.send_notif(&name, format!("from thread {i}").into_bytes())
                    .unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut got = collect_notifs(&p, 8, Duration::from_secs(30));
    got.sort();
    let want: Vec<Vec<u8>> = (0..8)
        .map(|i| format!("from thread {i}").into_bytes())
        .collect();
    assert_eq!(got, want);
}

/// Regression: once a dead peer's connection writer had stopped, posting to it deadlocked
/// (the failure was reported with the agent's transfer map still locked). Every post to a
/// dead peer must fail, promptly, however many come.
#[test]
fn posts_to_a_dead_peer_fail_and_never_hang() {
    let (p, d, peer) = pair();
    let src = p.register(4096, RemoteAccess::READ, vec![]).unwrap();
    let dst = d.register(4096, RemoteAccess::NONE, vec![]).unwrap();
    load(&d, &p);
    drop(p);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..5 {
            let x = d
                .create_xfer(
                    XferOp::Read,
                    vec![Desc::new(dst, 0, 4096)],
                    &peer,
                    vec![Desc::new(src, 0, 4096)],
                    None,
                )
                .unwrap();
            // a post refused at once, or a transfer that fails: never done, never hung
            let s = match d.post(x) {
                Err(e) => Err(e.to_string()),
                Ok(()) => Ok(d.wait(x, Duration::from_secs(60)).unwrap()),
            };
            tx.send(s).unwrap();
        }
    });
    for i in 0..5 {
        let s = rx
            .recv_timeout(Duration::from_secs(90))
            .unwrap_or_else(|_| panic!("post #{i} to a dead peer hung"));
        assert!(
            matches!(s, Err(_) | Ok(XferStatus::Error(_))),
            "post #{i}: {s:?}"
        );
    }
}

#[test]
fn burst_of_100k_notifications_in_order() {
    let (p, d, _) = pair();
    let dname = load(&p, &d);
    const N: u32 = 100_000;
    for i in 0..N {
        p.send_notif(&dname, format!("HB:{i}").into_bytes())
            .unwrap();
    }
    let mut next = 0;
    let t = Instant::now();
    while next < N {
        for (from, b) in d.get_new_notifs() {
            assert_eq!(from, "prefill-0");
            assert_eq!(b, format!("HB:{next}").into_bytes(), "out of order or lost");
            next += 1;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "only {next} of {N} arrived"
        );
        std::thread::yield_now();
    }
    if on_verbs() {
        // the channel's queue pair has rnr_retry 0: an RNR would have failed it over to TCP
        assert_eq!(p.notif_rail(&dname).as_deref(), Some("rxeB0:1"));
    }
}

/// One sender, three receivers, notifications to them in runs of irregular length: each
/// receiver gets exactly its own, in order, from the sender (on verbs each over its own
/// channel). The sender finds the channel of the last send without hashing the name: a
/// send to another peer must never take that shortcut to the wrong one.
#[test]
fn notifications_to_several_peers_reach_each_its_own() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let ds: Vec<Agent> = (0..3)
        .map(|i| Agent::new(&format!("decode-{i}"), cfg(Host::A)).unwrap())
        .collect();
    let names: Vec<String> = ds.iter().map(|d| load(&p, d)).collect();
    if on_verbs() {
        for n in &names {
            assert_eq!(p.notif_rail(n).as_deref(), Some("rxeB0:1"), "{n}");
        }
    }
    // runs of 1..=4 to one peer, each run to another peer than the run before
    let mut sent = vec![0u32; ds.len()];
    for step in 0..3000usize {
        let to = (step * 7 + step / 5) % ds.len();
        for _ in 0..=(step % 4) {
            let i = sent[to];
            p.send_notif(&names[to], format!("to {to} #{i}").into_bytes())
                .unwrap();
            sent[to] += 1;
        }
    }
    let t = Instant::now();
    for (to, d) in ds.iter().enumerate() {
        let mut next = 0;
        while next < sent[to] {
            for (from, b) in d.get_new_notifs() {
                assert_eq!(from, "prefill-0");
                assert_eq!(
                    String::from_utf8_lossy(&b),
                    format!("to {to} #{next}"),
                    "decode-{to}: another peer's notification, or out of order"
                );
                next += 1;
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "decode-{to}: {next} of {} arrived",
                sent[to]
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // nothing more comes: every notification went to exactly one peer
    std::thread::sleep(Duration::from_millis(200));
    for (to, d) in ds.iter().enumerate() {
        assert!(
            d.get_new_notifs().is_empty(),
            "decode-{to} got extra notifications"
        );
    }
}

/// Callers that wait with a polling budget (`progress_spin_us`) find small answers while
/// they look, on TCP too (no sleep and wake-up per answer); on TCP a large transfer's
/// waiter takes the sleeping path at once (its copies need the CPU). Every byte checked;
/// `kvrail_waits_total` says where each answer was found.
#[test]
fn waiting_callers_with_a_budget_find_small_answers_while_polling() {
    let conf = |host| AgentConfig {
        progress_spin_us: 5000,
        ..cfg(host)
    };
    let p = Agent::new("prefill-0", conf(Host::B)).unwrap();
    let d = Agent::new("decode-0", conf(Host::A)).unwrap();
    const SMALL: usize = 4096;
    const LARGE: usize = 1 << 20;
    const K: u64 = 100;
    let src = d.register(LARGE, RemoteAccess::NONE, vec![]).unwrap();
    let dst = p.register(LARGE, RemoteAccess::WRITE, vec![]).unwrap();
    let peer = d.load_remote(p.side_channel_addr()).unwrap();
    let p_peer = p.load_remote(d.side_channel_addr()).unwrap();
    let waits = |by: &str| {
        d.metrics()
            .value("kvrail_waits_total", &[("agent", "decode-0"), ("by", by)])
            .unwrap_or(-1.0)
    };
    let write = |len: usize, seed: u64| {
        let bytes = pattern(seed, len);
        d.write_region(src, 0, &bytes).unwrap();
        post_wait_release(&d, XferOp::Write, (src, &peer, dst), len as u64, None);
        let mut got = vec![0u8; len];
        p.read_region(dst, 0, &mut got).unwrap();
        assert!(got == bytes, "{len} B WRITE {seed}: wrong bytes");
    };
    for i in 0..K {
        write(SMALL, i);
    }
    let (polling, sleeping) = (waits("polling"), waits("sleeping"));
    assert_eq!(polling + sleeping, K as f64);
    assert!(
        polling >= (K / 2) as f64,
        "{polling} of {K} small answers found while polling"
    );
    for i in 0..4 {
        write(LARGE, K + i);
    }
    if !on_verbs() {
        // (on verbs the waiter polls the completion queue for any size, within the budget)
        assert_eq!(
            (waits("polling") - polling, waits("sleeping") - sleeping),
            (0.0, 4.0),
            "waits for 1 MiB transfers on TCP (polling, sleeping)"
        );
    }
    // notifications: found while polling too
    let before = waits("polling");
    for i in 0..50u32 {
        p.send_notif(&p_peer, i.to_le_bytes().to_vec()).unwrap();
        let got = d.wait_notifs(Duration::from_secs(60));
        assert_eq!(
            got,
            vec![("prefill-0".to_owned(), i.to_le_bytes().to_vec())]
        );
    }
    assert!(
        waits("polling") - before >= 25.0,
        "notifications not found while polling"
    );
}

/// Notifications queued when the sending agent is dropped still arrive, every one, in order
/// (the agent drains its channels while the peer keeps taking them, its TCP writers within a
/// bound, before the connections close).
#[test]
fn notifications_queued_when_the_agent_drops_still_arrive() {
    let (p, d, _) = pair();
    let dname = load(&p, &d);
    const N: u32 = 20_000;
    for i in 0..N {
        p.send_notif(&dname, format!("last-words:{i}").into_bytes())
            .unwrap();
    }
    let dropping = Instant::now();
    drop(p);
    let dropped = dropping.elapsed();
    // bounded by a stall (no arrival for 60 s), not a total a loaded host could miss
    let (mut next, mut last) = (0, Instant::now());
    while next < N && last.elapsed() < Duration::from_secs(60) {
        for (from, b) in d.wait_notifs(Duration::from_millis(100)) {
            assert_eq!(from, "prefill-0");
            assert_eq!(b, format!("last-words:{next}").into_bytes(), "out of order");
            next += 1;
            last = Instant::now();
        }
    }
    assert_eq!(
        next, N,
        "notifications lost when the sender was dropped (none arrived for 60 s; the drop took \
         {dropped:?})"
    );
}

/// A dropped agent's TCP writer keeps sending while the peer keeps taking: 10 GiB of queued
/// WRITE data (longer than the flush bound on any host) and the notifications behind it all
/// arrive; the bound is a stall, never a total. Host TCP only: rxe would take minutes.
#[test]
fn a_dropped_agent_sends_everything_queued_while_the_peer_takes_it() {
    if on_verbs() {
        return;
    }
    const LEN: usize = 64 << 20;
    const K: usize = 160;
    let (p, d, _) = pair();
    let src = p.register(LEN, RemoteAccess::NONE, vec![]).unwrap();
    let dst = d.register(LEN, RemoteAccess::WRITE, vec![]).unwrap();
    let bytes = pattern(7, LEN);
    p.write_region(src, 0, &bytes).unwrap();
    let dname = load(&p, &d);
    for i in 0..K {
        let x = p
            .create_xfer(
                XferOp::Write,
                vec![Desc::new(src, 0, LEN as u64)],
                &dname,
                vec![Desc::new(dst, 0, LEN as u64)],
                Some(format!("w-{i}").into_bytes()),
            )
            .unwrap();
        p.post(x).unwrap();
    }
    p.send_notif(&dname, b"last".to_vec()).unwrap();
    let t = Instant::now();
    drop(p);
    let dropped = t.elapsed();
    let mut want: Vec<Vec<u8>> = (0..K).map(|i| format!("w-{i}").into_bytes()).collect();
    want.push(b"last".to_vec());
    let got = collect_notifs(&d, want.len(), Duration::from_secs(120));
    assert_eq!(got, want, "the drop took {dropped:?}");
    let mut landed = vec![0u8; LEN];
    d.read_region(dst, 0, &mut landed).unwrap();
    assert!(landed == bytes, "WRITE bytes differ");
}

/// Many small WRITEs and READs in flight at once, with notifications between them (on TCP the
/// writer sends what is queued together in one gathered send): every byte lands, every READ
/// brings the right bytes back, every notification arrives once (in submission order on TCP).
#[test]
fn a_burst_of_small_transfers_and_notifications_lands_whole() {
    const N: usize = 256;
    const SZ: usize = 3000;
    let (p, d, _) = pair();
    let src = p.register(N * SZ, RemoteAccess::NONE, vec![]).unwrap();
    let dst = d
        .register(N * SZ, RemoteAccess::READ_WRITE, vec![])
        .unwrap();
    let back = p.register(N * SZ, RemoteAccess::NONE, vec![]).unwrap();
    let bytes = pattern(11, N * SZ);
    p.write_region(src, 0, &bytes).unwrap();
    let dname = load(&p, &d);
    let mut xs = Vec::new();
    for i in 0..N {
        let o = (i * SZ) as u64;
        // a zero-length descriptor in every fourth: it moves nothing and breaks nothing
        let (mut l, mut r) = (
            vec![Desc::new(src, o, SZ as u64)],
            vec![Desc::new(dst, o, SZ as u64)],
        );
        if i % 4 == 0 {
            l.push(Desc::new(src, o, 0));
            r.push(Desc::new(dst, o, 0));
        }
        let x = p
            .create_xfer(
                XferOp::Write,
                l,
                &dname,
                r,
                Some(format!("w{i}").into_bytes()),
            )
            .unwrap();
        p.post(x).unwrap();
        xs.push(x);
        if i % 8 == 0 {
            p.send_notif(&dname, format!("n{i}").into_bytes()).unwrap();
        }
    }
    for x in &xs {
        assert_eq!(
            p.wait(*x, Duration::from_secs(120)).unwrap(),
            XferStatus::Done
        );
    }
    let mut got = vec![0u8; N * SZ];
    d.read_region(dst, 0, &mut got).unwrap();
    assert!(got == bytes, "WRITE bytes differ");
    let mut want = Vec::new();
    for i in 0..N {
        want.push(format!("w{i}").into_bytes());
        if i % 8 == 0 {
            want.push(format!("n{i}").into_bytes());
        }
    }
    let mut notes = collect_notifs(&d, want.len(), Duration::from_secs(120));
    if on_verbs() {
        // WRITE notifications and plain ones take different paths on verbs
        notes.sort();
        want.sort();
    }
    assert_eq!(notes, want);
    // and READ them back, all in flight at once
    let rs: Vec<XferId> = (0..N)
        .map(|i| {
            let o = (i * SZ) as u64;
            let x = p
                .create_xfer(
                    XferOp::Read,
                    vec![Desc::new(back, o, SZ as u64)],
                    &dname,
                    vec![Desc::new(dst, o, SZ as u64)],
                    None,
                )
                .unwrap();
            p.post(x).unwrap();
            x
        })
        .collect();
    for x in rs {
        assert_eq!(
            p.wait(x, Duration::from_secs(120)).unwrap(),
            XferStatus::Done
        );
    }
    let mut again = vec![0u8; N * SZ];
    p.read_region(back, 0, &mut again).unwrap();
    assert!(again == bytes, "READ bytes differ");
}

#[test]
fn bad_descriptors_are_rejected_naming_the_index() {
    let (p, d, peer) = pair();
    let src = p.register(4096, RemoteAccess::READ, vec![]).unwrap();
    let wsrc = p.register(4096, RemoteAccess::WRITE, vec![]).unwrap();
    let dst = d.register(8192, RemoteAccess::NONE, vec![]).unwrap();
    load(&d, &p);
    let ok = |o| Desc::new(dst, o, 100);
    let reject = |op, local: Vec<Desc>, peer: &str, remote: Vec<Desc>| {
        d.create_xfer(op, local, peer, remote, None).unwrap_err()
    };
    let read = |local: Vec<Desc>, remote: Vec<Desc>| {
        reject(XferOp::Read, local, &peer, remote).to_string()
    };
    assert_eq!(
        reject(
            XferOp::Read,
            vec![ok(0), ok(100)],
            &peer,
            vec![Desc::new(src, 0, 100)]
        ),
        AgentError::LengthMismatch {
            local: 2,
            remote: 1
        }
    );
    assert_eq!(
        read(
            vec![ok(0), ok(100)],
            vec![Desc::new(src, 0, 100), Desc::new(src, 4000, 100)]
        ),
        "remote descriptor #1: [4000, 4000+100) is outside prefill-0's region 1 (4096 bytes)"
    );
    assert_eq!(
        read(
            vec![Desc::new(dst, 8100, 100)],
            vec![Desc::new(src, 0, 100)]
        ),
        "local descriptor #0: [8100, 8100+100) is outside region 1 (8192 bytes)"
    );
    assert_eq!(
        read(
            vec![Desc::new(RegionId(99), 0, 100)],
            vec![Desc::new(src, 0, 100)]
        ),
        "local descriptor #0: region 99 is not registered"
    );
    assert_eq!(
        read(vec![ok(0)], vec![Desc::new(RegionId(42), 0, 100)]),
        "remote descriptor #0: peer prefill-0 advertised no region 42"
    );
    assert_eq!(
        read(vec![ok(0)], vec![Desc::new(src, 0, 99)]),
        "remote descriptor #0: 99 bytes, the local descriptor has 100"
    );
    // least access: a READ-only region cannot be written, a WRITE-only one not read
    assert_eq!(
        reject(
            XferOp::Write,
            vec![ok(0)],
            &peer,
            vec![Desc::new(src, 0, 100)]
        )
        .to_string(),
        "remote descriptor #0: prefill-0's region 1 does not allow remote WRITE"
    );
    assert_eq!(
        read(vec![ok(0)], vec![Desc::new(wsrc, 0, 100)]),
        "remote descriptor #0: prefill-0's region 2 does not allow remote READ"
    );
    assert_eq!(
        reject(
            XferOp::Read,
            vec![ok(0)],
            "nobody",
            vec![Desc::new(src, 0, 100)]
        ),
        AgentError::UnknownPeer("nobody".into())
    );
}

/// A peer that accepts the attach and then never answers (or dies when told): transfers to
/// it stay in progress deterministically.
struct SilentPeer {
    addr: SocketAddr,
    kill: std::sync::mpsc::Sender<()>,
}

impl SilentPeer {
    fn start() -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (kill, killed) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut len = [0u8; 4];
            s.read_exact(&mut len).unwrap();
            let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
            s.read_exact(&mut body).unwrap();
            s.write_all(&[0, 0, 0, 9, 0xa8]).unwrap(); // msgpack "Attached" (a unit variant)
            s.write_all(b"Attached").unwrap();
            // swallow whatever comes until told to die
            s.set_nonblocking(true).unwrap();
            let mut sink = vec![0u8; 1 << 20];
            while killed.try_recv().is_err() {
                let _ = s.read(&mut sink);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Self { addr, kill }
    }

    fn metadata(&self) -> Vec<u8> {
        AgentMetadata {
            version: kvrail::agent::metadata::VERSION,
            handshake: HandshakeInfo {
                agent: "silent".into(),
                compat_hash: AgentConfig::default().compat.hash(),
                kv_layout: "HND".into(),
                block_size: 16,
                layers: vec![],
                requires_layers: false,
                physical_per_logical: 1,
            },
            backend: BackendKind::Tcp,
            side_channel: self.addr.to_string(),
            rails: vec![],
            tcp_data: Some(self.addr.to_string()),
            regions: vec![RegionMeta {
                id: 1,
                kind: MemKind::Host,
                addr: 0,
                len: 1 << 20,
                rkeys: vec![],
                remote_read: true,
                remote_write: true,
                layers: vec![],
                device: -1,
                layer_offsets: vec![],
                layer_len: 0,
                fenced: false,
            }],
        }
        .encode()
        .unwrap()
    }
}

#[test]
fn busy_deregistration_repost_rules_and_a_dying_peer() {
    let a = Agent::new("initiator", cfg_no_secret(Host::A)).unwrap();
    let silent = SilentPeer::start();
    let peer = a
        .load_remote_metadata(&silent.metadata(), Some(silent.addr))
        .unwrap();
    // the engine's own memory, registered in place
    let src = a
        .register_memory(MemRegion::vec(vec![7u8; 1 << 20]).unwrap())
        .unwrap();
    let x = a
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, 4096)],
            &peer,
            vec![Desc::new(RegionId(1), 0, 4096)],
            None,
        )
        .unwrap();
    assert_eq!(a.status(x).unwrap(), XferStatus::NotPosted);
    a.post(x).unwrap();
    assert_eq!(a.status(x).unwrap(), XferStatus::InProgress);
    // the silent peer never acknowledges: the region is busy, the transfer active
    let busy = AgentError::RegionBusy {
        region: src.0,
        transfers: 1,
    };
    assert_eq!(a.deregister(src).unwrap_err(), busy);
    assert_eq!(a.deregister_memory(src).unwrap_err(), busy);
    assert_eq!(a.post(x).unwrap_err(), AgentError::Active(x.0));
    assert_eq!(a.release(x).unwrap_err(), AgentError::Active(x.0));
    // waiting gives up after its timeout and says so
    assert_eq!(
        a.wait(x, Duration::from_millis(50)).unwrap(),
        XferStatus::InProgress
    );
    // the peer dies: the transfer fails (bounded, with the cause), never "done"
    silent.kill.send(()).unwrap();
    let st = a.wait(x, Duration::from_secs(120)).unwrap();
    let XferStatus::Error(cause) = st else {
        panic!("expected an error, got {st:?}")
    };
    assert!(
        matches!(&cause, XferError::ConnectionLost { peer, .. } if peer == "silent"),
        "{cause}"
    );
    assert_eq!(cause.fault(), Fault::Connection);
    // now the region is free and the request can be released
    a.release(x).unwrap();
    assert_eq!(a.status(x).unwrap_err(), AgentError::NoXfer(x.0));
    // the engine gets its memory back, untouched
    let back = a.deregister_memory(src).unwrap().into_vec();
    assert!(back.len() == 1 << 20 && back.iter().all(|b| *b == 7));
}

#[test]
fn repost_after_done_moves_the_bytes_again() {
    let (p, d, _) = pair();
    let src = p.register(4096, RemoteAccess::NONE, vec![]).unwrap();
    let dst = d.register(4096, RemoteAccess::WRITE, vec![]).unwrap();
    let dname = load(&p, &d);
    let x = p
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, 4096)],
            &dname,
            vec![Desc::new(dst, 0, 4096)],
            None,
        )
        .unwrap();
    for round in 0..3 {
        let bytes = pattern(round, 4096);
        p.write_region(src, 0, &bytes).unwrap();
        // each post may carry its own notification (none in round 1)
        let msg = (round != 1).then(|| format!("round-{round}").into_bytes());
        p.set_notif(x, msg.clone()).unwrap();
        p.post(x).unwrap();
        assert!(
            matches!(p.set_notif(x, None), Err(AgentError::Active(_)))
                || p.status(x).unwrap() != XferStatus::InProgress
        );
        // Agent::wait sleeps until the transfer finishes
        assert_eq!(
            p.wait(x, Duration::from_secs(120)).unwrap(),
            XferStatus::Done
        );
        let mut got = vec![0u8; 4096];
        d.read_region(dst, 0, &mut got).unwrap();
        assert_eq!(got, bytes, "round {round}");
        if let Some(m) = msg {
            assert_eq!(
                d.wait_notifs(Duration::from_secs(60)),
                vec![("prefill-0".to_string(), m)]
            );
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(d.get_new_notifs().is_empty(), "round 1 sent a notification");
    assert!(matches!(
        p.set_notif(XferId(999_999), None),
        Err(AgentError::NoXfer(_))
    ));
}

#[test]
fn handshake_refusals_name_both_values() {
    let p = Agent::new("p", cfg(Host::B)).unwrap();
    let mut other = cfg(Host::A);
    other.compat.model = "another-model".into();
    let d = Agent::new("d", other.clone()).unwrap();
    let e = d
        .load_remote(p.side_channel_addr())
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("compatibility hash mismatch with p: ours "),
        "{e}"
    );
    // enforce_handshake_compat = false skips only the hash...
    other.enforce_handshake_compat = false;
    let lax = Agent::new("lax", other.clone()).unwrap();
    let e = lax
        .load_remote(p.side_channel_addr())
        .unwrap_err()
        .to_string();
    // ...and the peer, which enforces it, still refuses the attach
    assert!(
        e.contains("peer refused us at") && e.contains("compatibility hash mismatch with lax"),
        "{e}"
    );
    let mut bs = cfg(Host::A);
    bs.block_size = 32;
    let e = Agent::new("bs", bs)
        .unwrap()
        .load_remote(p.side_channel_addr())
        .unwrap_err()
        .to_string();
    assert_eq!(e, "block_size mismatch with p: ours 32, theirs 16");
    let mut lay = cfg(Host::A);
    lay.kv_layout = "NHD".into();
    let e = Agent::new("lay", lay)
        .unwrap()
        .load_remote(p.side_channel_addr())
        .unwrap_err()
        .to_string();
    assert_eq!(e, "KV layout mismatch with p: ours NHD, theirs HND");
}

#[test]
fn loopback_advertised_to_another_host_is_refused_before_any_traffic() {
    let a = Agent::new("a", cfg(Host::A)).unwrap();
    assert!(a.side_channel_addr().ip().is_loopback());
    // 192.0.2.0/24 is TEST-NET-1: the check fails before anything is sent there
    let e = a
        .load_remote("192.0.2.10:5555".parse().unwrap())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "this agent advertises 127.0.0.1 to peer 192.0.2.10, which is not on this host: set side_channel_host to an address the peer can reach"
    );
}

#[test]
fn a_dead_side_channel_says_which_address() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let a = Agent::new("a", cfg(Host::A)).unwrap();
    let e = a
        .load_remote(format!("127.0.0.1:{port}").parse().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "side channel: cannot connect to 127.0.0.1:{port}: "
        )),
        "{e}"
    );
    assert!(e.contains("side_channel_host"), "{e}");
}

#[test]
fn garbage_on_the_side_channel_is_survived() {
    let p = Agent::new("p", cfg(Host::B)).unwrap();
    for junk in [
        &b"\x00\x00\x00\x03abc"[..],
        &[0xff; 64][..],
        &b"\x00\x00\x00\x01\xc1"[..],
    ] {
        let mut s = std::net::TcpStream::connect(p.side_channel_addr()).unwrap();
        let _ = s.write_all(junk);
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    }
    let d = Agent::new("d", cfg(Host::A)).unwrap();
    assert_eq!(d.load_remote(p.side_channel_addr()).unwrap(), "p");
}

#[test]
fn silent_connections_cannot_lock_out_the_side_channel() {
    let p = Agent::new("p", cfg(Host::B)).unwrap();
    // more silent connections than the listener keeps waiting: the oldest are closed
    let silent: Vec<std::net::TcpStream> = (0..300)
        .map(|_| std::net::TcpStream::connect(p.side_channel_addr()).unwrap())
        .collect();
    let d = Agent::new("d", cfg(Host::A)).unwrap();
    assert_eq!(d.load_remote(p.side_channel_addr()).unwrap(), "p");
    let mut first = &silent[0];
    first
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        first.read(&mut b).unwrap(),
        0,
        "the oldest silent connection was not closed"
    );
}

/// Two agents in two processes: the child is the producer, the test the consumer.
#[test]
fn two_processes() {
    if std::env::var_os("KVRAIL_AGENT_CHILD").is_some() {
        let p = Agent::new("child-producer", cfg(Host::B)).unwrap();
        let src = p.register(1 << 20, RemoteAccess::READ, vec![]).unwrap();
        p.write_region(src, 0, &pattern(77, 1 << 20)).unwrap();
        println!("ADDR {}", p.side_channel_addr());
        // wait for the consumer's notification, then exit
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(60) {
            if p.get_new_notifs().iter().any(|(_, b)| b == b"bye") {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("no notification from the consumer");
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "two_processes", "--nocapture"])
        .env("KVRAIL_AGENT_CHILD", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let addr: SocketAddr = loop {
        let mut line = String::new();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "child said nothing"
        );
        if let Some(a) = line.trim().strip_prefix("ADDR ") {
            break a.parse().unwrap();
        }
    };
    let d = Agent::new("consumer", cfg(Host::A)).unwrap();
    let peer = d.load_remote(addr).unwrap();
    let dst = d.register(1 << 20, RemoteAccess::NONE, vec![]).unwrap();
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 1 << 20)],
            &peer,
            vec![Desc::new(RegionId(1), 0, 1 << 20)],
            Some(b"bye".to_vec()),
        )
        .unwrap();
    d.post(x).unwrap();
    assert_eq!(wait(&d, x), XferStatus::Done);
    let mut got = vec![0u8; 1 << 20];
    d.read_region(dst, 0, &mut got).unwrap();
    assert!(got == pattern(77, 1 << 20));
    assert!(
        child.wait().unwrap().success(),
        "the producer process failed"
    );
}

#[test]
fn invalidate_forgets_the_peer_and_fails_its_transfers() {
    let a = Agent::new("initiator", cfg_no_secret(Host::A)).unwrap();
    let silent = SilentPeer::start();
    let peer = a
        .load_remote_metadata(&silent.metadata(), Some(silent.addr))
        .unwrap();
    assert_eq!(a.peers(), ["silent"]);
    let src = a.register(4096, RemoteAccess::NONE, vec![]).unwrap();
    let descs = || {
        (
            vec![Desc::new(src, 0, 4096)],
            vec![Desc::new(RegionId(1), 0, 4096)],
        )
    };
    let (l, r) = descs();
    let x = a.create_xfer(XferOp::Write, l, &peer, r, None).unwrap();
    a.post(x).unwrap();
    a.invalidate(&peer).unwrap();
    let st = wait(&a, x);
    assert_eq!(
        st,
        XferStatus::Error(XferError::ConnectionLost {
            peer: "silent".into(),
            why: "peer metadata invalidated".into()
        })
    );
    let (l, r) = descs();
    assert_eq!(
        a.create_xfer(XferOp::Write, l, &peer, r, None).unwrap_err(),
        AgentError::UnknownPeer("silent".into())
    );
    assert_eq!(
        a.invalidate(&peer).unwrap_err(),
        AgentError::UnknownPeer("silent".into())
    );
    assert!(a.peers().is_empty());
    a.deregister(src).unwrap();
}

/// Notifications go to their consumer by kind: a route takes the messages with its prefix
/// (in order), the engine's queue the rest; a dropped route gives its kind back.
#[test]
fn notifications_are_routed_by_kind() {
    let (p, d, peer) = pair();
    let route = p.notif_route(b"PUSH_REG:");
    for m in ["PUSH_REG:a", "HB:x", "PUSH_REG:b", "done:1"] {
        d.send_notif(&peer, m.as_bytes().to_vec()).unwrap();
    }
    let t = Instant::now();
    let (mut routed, mut engine) = (Vec::new(), Vec::new());
    while routed.len() < 2 || engine.len() < 2 {
        routed.extend(
            route
                .wait(Duration::from_millis(5))
                .into_iter()
                .map(|(_, b)| b),
        );
        engine.extend(p.get_new_notifs().into_iter().map(|(_, b)| b));
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{routed:?} {engine:?}"
        );
    }
    assert_eq!(routed, [b"PUSH_REG:a".to_vec(), b"PUSH_REG:b".to_vec()]);
    assert_eq!(engine, [b"HB:x".to_vec(), b"done:1".to_vec()]);
    drop(route);
    d.send_notif(&peer, b"PUSH_REG:c".to_vec()).unwrap();
    assert_eq!(
        collect_notifs(&p, 1, Duration::from_secs(60)),
        [b"PUSH_REG:c".to_vec()]
    );
}

/// Defect: a notification over the frame limit was accepted, and the receiver stopped
/// reading the connection: every later transfer and notification to that peer was lost.
#[test]
fn oversize_notifications_are_refused_and_the_largest_arrives() {
    let (p, d, peer) = pair();
    let max = kvrail::agent::MAX_NOTIF_LEN;
    let e = d.send_notif(&peer, vec![1; max + 1]).unwrap_err();
    assert!(matches!(e, AgentError::NotifTooLarge { .. }), "{e}");
    assert_eq!(e.fault(), kvrail::agent::Fault::Misuse);
    let src = p.register(4096, RemoteAccess::READ, vec![]).unwrap();
    let dst = d.register(4096, RemoteAccess::NONE, vec![]).unwrap();
    let peer = load(&d, &p);
    let read = |notif| {
        let (l, r) = (Desc::new(dst, 0, 4096), Desc::new(src, 0, 4096));
        d.create_xfer(XferOp::Read, vec![l], &peer, vec![r], notif)
    };
    let e = read(Some(vec![2; max + 1])).unwrap_err();
    assert!(matches!(e, AgentError::NotifTooLarge { .. }), "{e}");
    let x = read(None).unwrap();
    assert!(matches!(
        d.set_notif(x, Some(vec![3; max + 1])),
        Err(AgentError::NotifTooLarge { .. })
    ));
    // the largest allowed one, then a small one: both arrive, intact and in order
    let big = pattern(5, max);
    d.send_notif(&peer, big.clone()).unwrap();
    d.send_notif(&peer, b"after".to_vec()).unwrap();
    let got = collect_notifs(&p, 2, Duration::from_secs(120));
    assert!(got[0] == big, "the largest notification came back changed");
    assert_eq!(got[1], b"after");
    d.post(x).unwrap();
    assert_eq!(wait(&d, x), XferStatus::Done);
}

fn with_secret(host: Host, secret: Option<&str>) -> AgentConfig {
    AgentConfig {
        cluster_secret: secret.map(|k| kvrail::agent::ClusterSecret::new(k).unwrap()),
        ..cfg(host)
    }
}

/// One length-prefixed frame from `s` (the side channel's framing), None at its end.
fn raw_frame(s: &mut std::net::TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some([&len[..], &body].concat())
}

/// With a cluster secret, a side-channel peer proves it before it gets metadata or queue
/// pairs: the right secret works (byte-exact transfer); a wrong one, none, or one brought
/// to an agent without a secret gets nothing, and the agent counts the refusal; leaked
/// metadata does not let a stranger attach; a recorded answer replayed on a new connection
/// fails.
#[test]
fn cluster_secret_right_wrong_missing_and_replayed() {
    const K: &str = "a cluster secret of the test";
    let p = Agent::new("prefill-0", with_secret(Host::B, Some(K))).unwrap();
    let src = p.register(1 << 20, RemoteAccess::READ, vec![]).unwrap();
    let data = pattern(11, 1 << 20);
    p.write_region(src, 0, &data).unwrap();
    let at = p.side_channel_addr();
    // the right secret
    let d = Agent::new("decode-0", with_secret(Host::A, Some(K))).unwrap();
    let peer = d.load_remote(at).unwrap();
    let dst = d.register(1 << 20, RemoteAccess::NONE, vec![]).unwrap();
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 1 << 20)],
            &peer,
            vec![Desc::new(src, 0, 1 << 20)],
            None,
        )
        .unwrap();
    d.post(x).unwrap();
    assert_eq!(wait(&d, x), XferStatus::Done);
    let mut got = vec![0u8; 1 << 20];
    d.read_region(dst, 0, &mut got).unwrap();
    assert!(got == data, "the bytes differ");
    assert_eq!(p.auth_refusals(), 0);
    // a wrong secret, and none: refused, counted, no metadata learned
    let wrong = Agent::new(
        "wrong",
        with_secret(Host::A, Some("another cluster's secret")),
    )
    .unwrap();
    // (it sees first that the agent's proof is not of its secret, and leaves)
    let e = wrong.load_remote(at).unwrap_err().to_string();
    assert!(e.contains("did not prove the cluster secret"), "{e}");
    let none = Agent::new("none", with_secret(Host::A, None)).unwrap();
    let e = none.load_remote(at).unwrap_err().to_string();
    assert!(e.contains("authentication required"), "{e}");
    assert!(wrong.peers().is_empty() && none.peers().is_empty());
    // metadata leaked some other way: the attach (queue pairs) is refused all the same
    let leaked = p.metadata().encode().unwrap();
    let e = none
        .load_remote_metadata(&leaked, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication required"), "{e}");
    // (the wrong secret's departure is counted as the listener sees it close)
    let t = Instant::now();
    while p.auth_refusals() < 3 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.auth_refusals(), 3);
    // a secret brought to an agent that has none
    let open = Agent::new("open", with_secret(Host::B, None)).unwrap();
    let e = wrong
        .load_remote(open.side_channel_addr())
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no cluster_secret"), "{e}");
    // replay: record what a real peer sends through a relay, then send it again
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_at = relay.local_addr().unwrap();
    let recorder = std::thread::spawn(move || {
        let (mut c, _) = relay.accept().unwrap();
        let mut s = std::net::TcpStream::connect(at).unwrap();
        let mut sent = Vec::new();
        // hello (answered by the challenge), the proof (no answer), GetMetadata (answered)
        for answered in [true, false, true] {
            let f = raw_frame(&mut c).unwrap();
            s.write_all(&f).unwrap();
            sent.push(f);
            if answered {
                c.write_all(&raw_frame(&mut s).unwrap()).unwrap();
            }
        }
        sent
    });
    let d2 = Agent::new("decode-1", with_secret(Host::A, Some(K))).unwrap();
    // (the relay carries the metadata request only: the attach that follows, to the relay's
    // address, finds nobody)
    let _ = d2.load_remote(relay_at);
    let recorded = recorder.join().unwrap();
    let mut s = std::net::TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&recorded[0]).unwrap(); // the recorded hello (same nonce)
    let _challenge = raw_frame(&mut s).unwrap(); // a fresh nonce of the agent's
    s.write_all(&recorded[1]).unwrap(); // the recorded proof
    let answer = raw_frame(&mut s).unwrap_or_default();
    assert!(
        String::from_utf8_lossy(&answer).contains("wrong cluster_secret"),
        "the replayed proof was not refused: {} bytes back",
        answer.len()
    );
    assert!(raw_frame(&mut s).is_none(), "more came after the refusal");
    assert_eq!(p.auth_refusals(), 4);
}
