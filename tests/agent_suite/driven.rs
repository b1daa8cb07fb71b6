//! Callers that wait with a budget drive the peer's first TCP connection themselves (they
//! send what is queued and read the answers while the connection's threads sleep): WRITEs
//! and READs from 1 byte to 1 MiB, 32 in flight, with and without notifications, land
//! byte-exact and in order whether the caller or the connection's threads moved them
//! (a READ answer whose bytes are not all there yet and a large WRITE go to the threads);
//! work posted after the last wait goes out and is answered with nobody driving; a peer that
//! dies while a caller drives fails every transfer in flight, none hangs; four threads driving
//! one connection at once all land their transfers. On verbs the same
//! transfers run over queue pairs (the waiter polls the completion queues instead).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, AgentConfig, Desc, RegionId, RemoteAccess, XferId, XferOp, XferStatus};

use super::{cfg, collect_notifs, load, on_verbs, pattern, Host};

fn driving(host: Host, spin_us: u32) -> AgentConfig {
    AgentConfig {
        progress_spin_us: spin_us,
        ..cfg(host)
    }
}

/// `op` of `len` bytes from offset `off` of `local` to the same offset of the peer's `dst`,
/// made and posted.
fn post(
    d: &Agent,
    op: XferOp,
    (local, off, len): (RegionId, u64, u64),
    (peer, dst): (&str, RegionId),
    notif: Option<Vec<u8>>,
) -> XferId {
    let x = d
        .create_xfer(
            op,
            vec![Desc::new(local, off, len)],
            peer,
            vec![Desc::new(dst, off, len)],
            notif,
        )
        .unwrap();
    d.post(x).unwrap();
    x
}

/// The regions a test moves bytes between: `src` (WRITEs read it) and `back` (READs fill
/// it) on the initiator `d`, `dst` on the target `p`, each `span` bytes; a transfer uses the
/// same offset on both sides.
struct Regions<'a> {
    d: &'a Agent,
    p: &'a Agent,
    peer: String,
    src: RegionId,
    back: RegionId,
    dst: RegionId,
}

impl<'a> Regions<'a> {
    fn new(d: &'a Agent, p: &'a Agent, span: usize) -> Self {
        Self {
            src: d.register(span, RemoteAccess::NONE, vec![]).unwrap(),
            back: d.register(span, RemoteAccess::NONE, vec![]).unwrap(),
            dst: p.register(span, RemoteAccess::READ_WRITE, vec![]).unwrap(),
            peer: load(d, p),
            d,
            p,
        }
    }

    /// Put `bytes` where `op` takes them from (at `off`: the initiator's `src` for a WRITE,
    /// the target's `dst` for a READ) and post it, with `notif`.
    fn stage_and_post(&self, op: XferOp, off: u64, bytes: &[u8], notif: Option<Vec<u8>>) -> XferId {
        let local = match op {
            XferOp::Write => {
                self.d.write_region(self.src, off, bytes).unwrap();
                self.src
            }
            XferOp::Read => {
                self.p.write_region(self.dst, off, bytes).unwrap();
                self.back
            }
        };
        let len = bytes.len() as u64;
        post(self.d, op, (local, off, len), (&self.peer, self.dst), notif)
    }

    /// The `len` bytes `op` left at `off` (the target's `dst` for a WRITE, `back` for a READ).
    fn landed(&self, op: XferOp, off: u64, len: u64) -> Vec<u8> {
        let mut got = vec![0u8; len as usize];
        match op {
            XferOp::Write => self.p.read_region(self.dst, off, &mut got).unwrap(),
            XferOp::Read => self.d.read_region(self.back, off, &mut got).unwrap(),
        }
        got
    }
}

/// Notifications as they arrived against `want` in posting order: on TCP in that order (one
/// connection), on verbs as a set (each comes as its transfer ends).
fn assert_notifs(mut got: Vec<Vec<u8>>, mut want: Vec<Vec<u8>>) {
    if on_verbs() {
        got.sort();
        want.sort();
    }
    assert_eq!(got, want, "notifications (in posting order on TCP)");
}

/// `a`'s transfers of `op` that ended done, by its metrics (read without driving anything).
fn done(a: &Agent, op: &str) -> f64 {
    let l = [("agent", a.name()), ("op", op), ("outcome", "done")];
    a.metrics()
        .value("kvrail_transfers_total", &l)
        .unwrap_or(0.0)
}

/// Sizes cycled through: small ones (batched, answered to the driving caller), 16 KiB
/// READs (the largest a caller drives: their bytes may arrive after their header), and
/// 64 KiB and 1 MiB ones (the connection's threads move those).
const SIZES: [u64; 8] = [1, 100, 4096, 16 << 10, 4096, 64 << 10, 777, 1 << 20];
const SLOT: u64 = 1 << 20;
const DEPTH: usize = 32;

#[test]
fn driving_callers_move_small_and_large_work_byte_exact_and_in_order() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", driving(Host::A, 5000)).unwrap();
    let slots = DEPTH as u64;
    let r = Regions::new(&d, &p, (slots * SLOT) as usize);
    let n = if on_verbs() { 96 } else { 400 };
    // what each transfer must leave, checked when it is done: (slot, op, len, seed)
    let mut flight = VecDeque::new();
    let mut free: Vec<u64> = (0..slots).collect();
    let mut notifs = 0;
    let check = |(slot, op, len, seed): (u64, XferOp, u64, u64)| {
        let got = r.landed(op, slot * SLOT, len);
        assert!(
            got == pattern(seed, len as usize),
            "{op:?} of {len} B (seed {seed}) landed wrong"
        );
    };
    for i in 0..n {
        if free.is_empty() {
            let (x, what) = flight.pop_front().unwrap();
            assert_eq!(
                d.wait(x, Duration::from_secs(60)).unwrap(),
                XferStatus::Done,
                "transfer {i}"
            );
            d.release(x).unwrap();
            check(what);
            free.push(what.0);
        }
        let slot = free.pop().unwrap();
        let len = SIZES[i as usize % SIZES.len()];
        let seed = 1000 + i;
        let off = slot * SLOT;
        // a READ every third transfer (its bytes put at the target first), else a WRITE
        let op = if i % 3 == 2 {
            XferOp::Read
        } else {
            XferOp::Write
        };
        // every fifth WRITE tells the target, after its bytes
        let notif = (op == XferOp::Write && i % 5 == 0).then(|| {
            notifs += 1;
            format!("slot {slot} seed {seed}").into_bytes()
        });
        let x = r.stage_and_post(op, off, &pattern(seed, len as usize), notif);
        flight.push_back((x, (slot, op, len, seed)));
    }
    for (x, what) in flight {
        assert_eq!(
            d.wait(x, Duration::from_secs(60)).unwrap(),
            XferStatus::Done
        );
        d.release(x).unwrap();
        check(what);
    }
    // every notification; on TCP in the order the WRITEs were posted (one connection, the
    // caller and the writer taking the queue in turn), on verbs as their transfers end (a
    // 1 MiB WRITE's may come after a later small one's)
    let got = collect_notifs(&p, notifs, Duration::from_secs(60));
    let mut seeds: Vec<u64> = got
        .iter()
        .map(|b| {
            let s = String::from_utf8(b.clone()).unwrap();
            s.rsplit(' ').next().unwrap().parse().unwrap()
        })
        .collect();
    if on_verbs() {
        seeds.sort_unstable();
    }
    assert!(
        seeds.windows(2).all(|w| w[0] < w[1]),
        "out of order (or twice): {seeds:?}"
    );
    assert_eq!(seeds.len(), notifs);
    if !on_verbs() {
        let by = |how: &str| {
            let l = [("agent", "decode-0"), ("by", how)];
            d.metrics().value("kvrail_waits_total", &l).unwrap_or(0.0)
        };
        assert!(
            by("polling") > 0.0,
            "no answer was found by a driving caller"
        );
    }
}

/// After a wait, the connection is left to the caller for a while (16 ms; 200 ms budget): a WRITE
/// posted then, with nothing called on the agent again, still goes out (its notification
/// and bytes reach the target), and its answer is taken by the connection's reader (the
/// agent's metrics count it done while nobody drives).
#[test]
fn work_posted_after_the_last_wait_is_sent_and_answered_with_nobody_driving() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", driving(Host::A, 200_000)).unwrap();
    let src = d.register(8192, RemoteAccess::NONE, vec![]).unwrap();
    let dst = p.register(8192, RemoteAccess::WRITE, vec![]).unwrap();
    let peer = load(&d, &p);
    let post = |seed: u64, notif: &str| {
        d.write_region(src, 0, &pattern(seed, 4096)).unwrap();
        let notif = Some(notif.as_bytes().to_vec());
        post(&d, XferOp::Write, (src, 0, 4096), (&peer, dst), notif)
    };
    let first = post(1, "first");
    assert_eq!(
        d.wait(first, Duration::from_secs(60)).unwrap(),
        XferStatus::Done
    );
    assert_eq!(collect_notifs(&p, 1, Duration::from_secs(60)), [b"first"]);
    let before = done(&d, "write");
    let _second = post(2, "second");
    // nothing called on `d` from here on
    assert_eq!(collect_notifs(&p, 1, Duration::from_secs(60)), [b"second"]);
    let mut got = vec![0u8; 4096];
    p.read_region(dst, 0, &mut got).unwrap();
    assert!(got == pattern(2, 4096), "the second WRITE's bytes");
    let t = Instant::now();
    while done(&d, "write") < before + 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the answer was never read"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A peer that goes away while a caller drives the connection with 32 small WRITEs in
/// flight: every transfer ends (done with its bytes in place before the peer went, or
/// failed), none hangs.
#[test]
fn a_peer_dying_under_a_driving_caller_fails_what_is_in_flight() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", driving(Host::A, 5000)).unwrap();
    let src = d
        .register(DEPTH * 4096, RemoteAccess::NONE, vec![])
        .unwrap();
    let dst = p
        .register(DEPTH * 4096, RemoteAccess::WRITE, vec![])
        .unwrap();
    let peer = load(&d, &p);
    d.write_region(src, 0, &pattern(7, DEPTH * 4096)).unwrap();
    let mut xs = Vec::new();
    for k in 0..DEPTH as u64 {
        xs.push(post(
            &d,
            XferOp::Write,
            (src, k * 4096, 4096),
            (&peer, dst),
            None,
        ));
    }
    drop(p);
    let (mut ok, mut failed) = (0, 0);
    for x in xs {
        match d.wait(x, Duration::from_secs(60)).unwrap() {
            XferStatus::Done => ok += 1,
            XferStatus::Error(_) => failed += 1,
            other => panic!("a transfer after its peer went away: {other:?}"),
        }
    }
    assert_eq!(ok + failed, DEPTH);
    // the connection is gone: the next post fails instead of waiting for a dead peer
    let x = d
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, 4096)],
            &peer,
            vec![Desc::new(dst, 0, 4096)],
            None,
        )
        .unwrap();
    let posted = d.post(x);
    if posted.is_ok() {
        assert!(
            matches!(
                d.wait(x, Duration::from_secs(60)).unwrap(),
                XferStatus::Error(_)
            ),
            "a WRITE to a peer that went away"
        );
    }
}

/// What a driving caller meets and cannot finish without waiting on the socket goes to the
/// connection's threads, in order: a 1 MiB READ's answer (its bytes do not fit what one
/// look reads) to the reader, a 1 MiB WRITE queued between small ones to the writer. With
/// a budget of 200 ms the threads sleep through the test's posts (the window after a pass,
/// 16 ms), so the caller meets both.
#[test]
fn what_a_driving_caller_cannot_finish_goes_to_the_threads_in_order() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", driving(Host::A, 200_000)).unwrap();
    const BIG: u64 = 1 << 20;
    let src = d
        .register(4 * BIG as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let back = d
        .register(BIG as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let dst = p
        .register(4 * BIG as usize, RemoteAccess::READ_WRITE, vec![])
        .unwrap();
    let peer = load(&d, &p);
    let xfer = |op, (local, off): (_, u64), len: u64, notif: Option<&str>| {
        let notif = notif.map(|n| n.as_bytes().to_vec());
        post(&d, op, (local, off, len), (&peer, dst), notif)
    };
    let done = |x| {
        assert_eq!(
            d.wait(x, Duration::from_secs(60)).unwrap(),
            XferStatus::Done
        );
    };
    // (offsets: the READ's bytes at 0 of the target, the WRITEs' at 1, 2 and 3 MiB, the
    // first ones' 8 KiB after the last)
    p.write_region(dst, 0, &pattern(2, BIG as usize)).unwrap();
    for (k, len) in [(1u64, 4096u64), (2, BIG), (3, 4096)] {
        let seed = 10 + k;
        d.write_region(src, k * BIG, &pattern(seed, len as usize))
            .unwrap();
    }
    // small WRITEs first: the caller drives, and the threads go to sleep for the window
    // after its last pass (16 ms), in which the four below are posted (each thread may be
    // waiting on the socket when the first pass comes: it moves one more, then sleeps)
    for _ in 0..3 {
        done(xfer(XferOp::Write, (src, 3 * BIG + 8192), 4096, None));
    }
    let r = xfer(XferOp::Read, (back, 0), BIG, None);
    let a = xfer(XferOp::Write, (src, BIG), 4096, Some("a"));
    let b = xfer(XferOp::Write, (src, 2 * BIG), BIG, Some("b"));
    let c = xfer(XferOp::Write, (src, 3 * BIG), 4096, Some("c"));
    for x in [a, c, b, r] {
        done(x);
    }
    let mut got = vec![0u8; BIG as usize];
    d.read_region(back, 0, &mut got).unwrap();
    assert!(got == pattern(2, BIG as usize), "the 1 MiB READ's bytes");
    for (k, len) in [(1u64, 4096usize), (2, BIG as usize), (3, 4096)] {
        let mut got = vec![0u8; len];
        p.read_region(dst, k * BIG, &mut got).unwrap();
        assert!(got == pattern(10 + k, len), "WRITE {k}'s bytes");
    }
    let notes = collect_notifs(&p, 3, Duration::from_secs(60));
    assert_notifs(notes, vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
}

/// Four threads of one agent post and wait at once (an engine's workers), each with 8 small
/// WRITEs and READs in flight: the callers drive the same connection in turn (each pass tries
/// its locks; whoever holds one sends or reads for all), and every transfer of every thread
/// lands byte-exact and ends done.
#[test]
fn threads_driving_one_connection_at_once_all_land() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", driving(Host::A, 5000)).unwrap();
    const THREADS: u64 = 4;
    const PER: u64 = 8; // in flight per thread
    const LEN: u64 = 4096;
    let r = Regions::new(&d, &p, (THREADS * PER * LEN) as usize);
    let rounds = if on_verbs() { 10 } else { 50 };
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (d, r) = (&d, &r);
            s.spawn(move || {
                for round in 0..rounds {
                    let op = if round % 2 == 0 {
                        XferOp::Write
                    } else {
                        XferOp::Read
                    };
                    let mut xs = Vec::new();
                    for k in 0..PER {
                        let off = (t * PER + k) * LEN;
                        let seed = (t << 32) | (round << 8) | k;
                        let bytes = pattern(seed, LEN as usize);
                        let x = r.stage_and_post(op, off, &bytes, None);
                        xs.push((x, off, bytes));
                    }
                    for (x, off, want) in xs {
                        assert_eq!(
                            d.wait(x, Duration::from_secs(60)).unwrap(),
                            XferStatus::Done
                        );
                        d.release(x).unwrap();
                        assert!(
                            r.landed(op, off, LEN) == want,
                            "thread {t} round {round}: {op:?} at {off} landed wrong"
                        );
                    }
                }
            });
        }
    });
}

/// An engine loop that only asks [`Agent::status`] about every transfer in flight (as
/// NIXL's `check_xfer_state` loops do) drives the connection through those looks: 32 small
/// WRITEs and READs in flight, reposted as they end, every byte checked, a notification on
/// every fourth WRITE delivered once each, in order on TCP.
#[test]
fn a_loop_asking_only_status_lands_every_transfer() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", driving(Host::A, 5000)).unwrap();
    const LEN: u64 = 4096;
    let r = Regions::new(&d, &p, (DEPTH as u64 * LEN) as usize);
    let total = if on_verbs() { 96 } else { 1200 };
    // transfer `n` in `slot` (one transfer a slot at a time: a new one takes the slot of
    // the one that ended)
    let start = |n: u64, slot: u64| {
        let off = slot * LEN;
        let want = pattern(n, LEN as usize);
        let op = if n.is_multiple_of(2) {
            XferOp::Write
        } else {
            XferOp::Read
        };
        let notif = n.is_multiple_of(8).then(|| format!("n{n}").into_bytes());
        let x = r.stage_and_post(op, off, &want, notif);
        (x, n, op, off, want)
    };
    let mut flight: VecDeque<_> = (0..DEPTH as u64).map(|n| start(n, n)).collect();
    let mut next = DEPTH as u64;
    let mut notifs = Vec::new();
    let t = Instant::now();
    while !flight.is_empty() {
        assert!(t.elapsed() < Duration::from_secs(120), "transfers stuck");
        let mut still = VecDeque::new();
        for (x, n, op, off, want) in flight.drain(..) {
            match d.status(x).unwrap() {
                XferStatus::InProgress => still.push_back((x, n, op, off, want)),
                XferStatus::Done => {
                    d.release(x).unwrap();
                    let got = r.landed(op, off, LEN);
                    assert!(got == want, "transfer {n} ({op:?}) landed wrong");
                    if next < total {
                        still.push_back(start(next, off / LEN));
                        next += 1;
                    }
                }
                other => panic!("transfer {n} ended {other:?}"),
            }
        }
        flight = still;
        notifs.extend(p.get_new_notifs().into_iter().map(|(_, b)| b));
    }
    let want: Vec<Vec<u8>> = (0..total)
        .filter(|n| n.is_multiple_of(8))
        .map(|n| format!("n{n}").into_bytes())
        .collect();
    let missing = want.len().saturating_sub(notifs.len());
    notifs.extend(collect_notifs(&p, missing, Duration::from_secs(60)));
    assert_notifs(notifs, want);
}
