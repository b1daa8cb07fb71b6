//! The P/D rules in virtual time: no clock is read; `now` is a base instant plus seconds.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::kvmsg::*;
use super::lease::*;
use super::push::*;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn reg(d_req: &str, p_req: &str, blocks: Vec<u64>) -> PushReg {
    PushReg {
        request_id: d_req.into(),
        engine_id: "decode-engine".into(),
        host: "10.0.0.2".into(),
        port: 5600,
        tp_rank: 0,
        tp_size: 1,
        block_ids: blocks,
        remote_engine_id: "prefill-engine".into(),
        remote_request_id: p_req.into(),
        grant: None,
    }
}

// ---------------------------------------------------------------- ids and wire messages

#[test]
fn base_request_id_strips_only_the_8_hex_suffix() {
    assert_eq!(base_request_id("cmpl-abc-0-1a2b3c4d"), "cmpl-abc-0");
    assert_eq!(base_request_id("cmpl-abc-0-DEADBEEF"), "cmpl-abc-0");
    assert_eq!(
        base_request_id("cmpl-abc-0"),
        "cmpl-abc-0",
        "index kept, nothing stripped"
    );
    assert_eq!(
        base_request_id("cmpl-abc-1-1a2b3c4d"),
        "cmpl-abc-1",
        "sub-requests stay apart"
    );
    assert_eq!(
        base_request_id("cmpl-abc-0-1a2b3c4"),
        "cmpl-abc-0-1a2b3c4",
        "7 digits"
    );
    assert_eq!(
        base_request_id("cmpl-abc-0-1a2b3c4g"),
        "cmpl-abc-0-1a2b3c4g",
        "not hex"
    );
    assert_eq!(base_request_id("-1a2b3c4d"), "-1a2b3c4d");
    assert_eq!(base_request_id(""), "");
}

#[test]
fn golden_bytes() {
    let c = Completion {
        request_id: "cmpl-x-0-1a2b3c4d".into(),
        tp_size: 2,
    };
    assert_eq!(c.encode(), b"cmpl-x-0-1a2b3c4d:2");
    assert_eq!(Completion::decode(b"a:b:4").unwrap().request_id, "a:b");
    assert_eq!(
        encode_heartbeat(&["r1".into(), "r2".into()]),
        b"HB:\x92\xa2r1\xa2r2".to_vec()
    );
    let r = PushReg {
        request_id: "d".into(),
        engine_id: "e".into(),
        host: "h".into(),
        port: 1,
        tp_rank: 0,
        tp_size: 1,
        block_ids: vec![3],
        remote_engine_id: "p".into(),
        remote_request_id: "q".into(),
        grant: None,
    };
    let want: &[u8] =
        b"PUSH_REG:\x89\xaarequest_id\xa1d\xa9engine_id\xa1e\xa4host\xa1h\xa4port\x01\
\xa7tp_rank\x00\xa7tp_size\x01\xa9block_ids\x91\x03\xb0remote_engine_id\xa1p\
\xb1remote_request_id\xa1q";
    assert_eq!(r.encode(), want);
    assert_eq!(KvMsg::decode(want).unwrap(), KvMsg::PushReg(r));
    assert_eq!(
        KvMsg::decode(b"HB:\x91\xa1z").unwrap(),
        KvMsg::Heartbeat(vec!["z".into()])
    );
}

#[test]
fn malformed_messages_are_errors_naming_the_kind() {
    for (b, kind) in [
        (&b"no-colon"[..], "completion"),
        (b"id:x", "completion"),
        (b":3", "completion"),
        (b"id:0", "completion"),
        (b"\xff\xfe:1", "completion"),
        (b"HB:\xc1", "heartbeat"),
        (b"HB:\x92\x01\x02", "heartbeat"),
        (b"PUSH_REG:\x80", "PUSH_REG"),
        (b"PUSH_REG:garbage", "PUSH_REG"),
    ] {
        let e = KvMsg::decode(b).unwrap_err();
        assert_eq!(e.kind, kind, "{b:?}: {e}");
    }
    let mut bad = reg("d", "p", vec![1]);
    bad.tp_rank = 2;
    bad.tp_size = 2;
    assert!(
        PushReg::decode(&bad.encode()).is_err(),
        "rank outside the size"
    );
    let e = PushReg::decode(&reg("d", "p", vec![]).encode()).unwrap_err();
    assert!(e.to_string().contains("no blocks"), "{e}");
}

proptest! {
    #[test]
    fn any_bytes_decode_without_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = KvMsg::decode(&b);
        let mut hb = HB_PREFIX.to_vec();
        hb.extend(&b);
        let _ = KvMsg::decode(&hb);
        let mut pr = PUSH_REG_PREFIX.to_vec();
        pr.extend(&b);
        let _ = KvMsg::decode(&pr);
    }

    #[test]
    fn registrations_round_trip(id in "[a-z0-9-]{1,40}", blocks in proptest::collection::vec(any::<u64>(), 1..50), rank in 0u32..8) {
        let mut r = reg(&id, &id, blocks);
        r.tp_size = 8;
        r.tp_rank = rank;
        prop_assert_eq!(PushReg::decode(&r.encode()).unwrap(), r);
    }
}

// ---------------------------------------------------------------- leases

#[test]
fn lease_math_to_the_second() {
    let t0 = Instant::now();
    let mut l = Leases::new(secs(30), 1);
    assert_eq!(l.extension(), secs(20));
    l.pin("r", vec![1, 2], t0);
    assert_eq!(l.expiry("r"), Some(t0 + secs(30)));
    // a heartbeat never shortens: at t0+5, now+20 = t0+25 < t0+30
    assert_eq!(l.handle_heartbeat(&["r".into()], t0 + secs(5)), 1);
    assert_eq!(l.expiry("r"), Some(t0 + secs(30)));
    // at t0+15: max(t0+30, t0+35) = t0+35
    l.handle_heartbeat(&["r".into()], t0 + secs(15));
    assert_eq!(l.expiry("r"), Some(t0 + secs(35)));
    assert_eq!(l.poll_timeout(), Some(t0 + secs(35)));
    l.handle_timeout(t0 + secs(34));
    assert_eq!(l.poll_event(), None, "one second before expiry: kept");
    l.handle_timeout(t0 + secs(35));
    assert_eq!(
        l.poll_event(),
        Some(LeaseEvent::Free {
            request_id: "r".into(),
            blocks: vec![1, 2],
            reason: FreeReason::Expired
        })
    );
    assert!(l.is_empty());
}

#[test]
fn unknown_heartbeat_ids_are_ignored_and_base_ids_match() {
    let t0 = Instant::now();
    let mut l = Leases::new(secs(30), 1);
    l.pin("cmpl-a-0-11111111", vec![1], t0);
    let n = l.handle_heartbeat(
        &[
            "nobody".into(),
            "cmpl-a-0-22222222".into(),
            "cmpl-a-1-11111111".into(),
        ],
        t0 + secs(20),
    );
    assert_eq!(n, 1, "only the base-id match renews");
    assert_eq!(l.unknown_heartbeats, 2);
    assert_eq!(l.expiry("cmpl-a-0-11111111"), Some(t0 + secs(40)));
}

#[test]
fn completions_free_once_per_reading_d_rank() {
    let t0 = Instant::now();
    // P TP 1, D TP 4: four D ranks each read and report
    let mut l = Leases::new(secs(30), 1);
    l.pin("r", vec![7], t0);
    let c = Completion {
        request_id: "r".into(),
        tp_size: 4,
    };
    for _ in 0..3 {
        assert!(l.handle_completion(&c));
        assert_eq!(l.poll_event(), None);
    }
    assert!(l.handle_completion(&c));
    assert!(matches!(
        l.poll_event(),
        Some(LeaseEvent::Free {
            reason: FreeReason::Completed,
            ..
        })
    ));
    assert!(!l.handle_completion(&c), "already freed: unknown");
    // P TP 4, D TP 2: one completion per P rank
    let mut l = Leases::new(secs(30), 4);
    l.pin("s", vec![1], t0);
    l.handle_completion(&Completion {
        request_id: "s".into(),
        tp_size: 2,
    });
    assert!(l.is_empty());
}

// ---------------------------------------------------------------- heartbeats (D)

fn drain_hb(h: &mut Heartbeats) -> Vec<HeartbeatAction> {
    std::iter::from_fn(|| h.poll_action()).collect()
}

#[test]
fn heartbeats_start_when_the_request_enters_the_scheduler_with_a_proactive_handshake() {
    let t0 = Instant::now();
    let mut h = Heartbeats::new(secs(30));
    assert_eq!(h.interval(), secs(5));
    h.track("d-req-1", "P0", "p-req-1", t0);
    assert_eq!(
        h.poll_timeout(),
        Some(t0),
        "due at once, not when scheduled"
    );
    h.handle_timeout(t0);
    assert_eq!(
        drain_hb(&mut h),
        vec![HeartbeatAction::Handshake {
            engine: "P0".into()
        }]
    );
    // the heartbeat follows the handshake, carrying P's request id (regression: push
    // heartbeats once carried D's id, so P never renewed)
    h.handshake_done("P0", true);
    let a = drain_hb(&mut h);
    assert_eq!(
        a,
        vec![HeartbeatAction::Send {
            engine: "P0".into(),
            ids: vec!["p-req-1".into()],
            message: encode_heartbeat(&["p-req-1".into()]),
        }]
    );
    // one batched heartbeat per engine per interval
    h.track("d-req-2", "P0", "p-req-2", t0 + secs(1));
    h.track("d-req-3", "P1", "p-req-3", t0 + secs(1));
    h.handle_timeout(t0 + secs(4));
    assert!(drain_hb(&mut h).is_empty(), "not yet due");
    h.handle_timeout(t0 + secs(5));
    let a = drain_hb(&mut h);
    assert_eq!(a.len(), 2, "{a:?}");
    assert!(a.contains(&HeartbeatAction::Send {
        engine: "P0".into(),
        ids: vec!["p-req-1".into(), "p-req-2".into()],
        message: encode_heartbeat(&["p-req-1".into(), "p-req-2".into()]),
    }));
    assert!(a.contains(&HeartbeatAction::Handshake {
        engine: "P1".into()
    }));
    // a failed handshake is retried at the next round, not in a loop
    h.handshake_done("P1", false);
    assert!(drain_hb(&mut h).is_empty());
    h.handle_timeout(t0 + secs(10));
    assert!(drain_hb(&mut h).contains(&HeartbeatAction::Handshake {
        engine: "P1".into()
    }));
    // untracked after the transfer: nothing more
    for r in ["d-req-1", "d-req-2", "d-req-3"] {
        h.untrack(r);
    }
    assert_eq!(h.poll_timeout(), None);
    h.handle_timeout(t0 + secs(100));
    assert!(drain_hb(&mut h).is_empty());
}

// ---------------------------------------------------------------- a P/D pair in virtual time

/// P and D with a network between them that delivers each step; D can crash.
struct Pair {
    now: Instant,
    p: Leases,
    d: Heartbeats,
    to_p: VecDeque<Vec<u8>>,
    d_alive: bool,
    freed: Vec<(String, FreeReason, Instant)>,
}

impl Pair {
    fn new(lease: u64) -> Self {
        Self {
            now: Instant::now(),
            p: Leases::new(secs(lease), 1),
            d: Heartbeats::new(secs(lease)),
            to_p: VecDeque::new(),
            d_alive: true,
            freed: Vec::new(),
        }
    }

    /// Advance one second: D's heartbeats go out, P handles what arrived and its timers.
    fn tick(&mut self) {
        self.now += secs(1);
        if self.d_alive {
            self.d.handle_timeout(self.now);
            while let Some(a) = self.d.poll_action() {
                match a {
                    HeartbeatAction::Handshake { engine } => self.d.handshake_done(&engine, true),
                    HeartbeatAction::Send { message, .. } => self.to_p.push_back(message),
                }
            }
        }
        while let Some(m) = self.to_p.pop_front() {
            match KvMsg::decode(&m).unwrap() {
                KvMsg::Heartbeat(ids) => {
                    self.p.handle_heartbeat(&ids, self.now);
                }
                KvMsg::Completion(c) => {
                    self.p.handle_completion(&c);
                }
                other => unreachable!("{other:?}"),
            }
        }
        self.p.handle_timeout(self.now);
        while let Some(LeaseEvent::Free {
            request_id, reason, ..
        }) = self.p.poll_event()
        {
            self.freed.push((request_id, reason, self.now));
        }
    }
}

#[test]
fn d_crash_frees_p_blocks_within_the_extension_of_the_last_heartbeat() {
    let mut s = Pair::new(30);
    let t0 = s.now;
    s.p.pin("p-1", vec![1, 2, 3], t0);
    s.d.track("d-1", "P0", "p-1", t0);
    for _ in 0..60 {
        s.tick();
    }
    assert!(s.freed.is_empty(), "heartbeats kept it for a minute");
    let crash = s.now;
    s.d_alive = false;
    for _ in 0..60 {
        s.tick();
    }
    let (id, reason, at) = s.freed[0].clone();
    assert_eq!((id.as_str(), reason), ("p-1", FreeReason::Expired));
    // the last heartbeat went at most one interval (5 s) before the crash; expiry is 20 s
    // after it: freed within 20 s of the crash, not 480
    assert!(
        at - crash <= secs(20) && at - crash > secs(14),
        "{:?}",
        at - crash
    );
}

#[test]
fn d_overloaded_for_ten_leases_keeps_the_blocks_then_completes() {
    let mut s = Pair::new(30);
    s.p.pin("p-1", vec![9], s.now);
    s.d.track("d-1", "P0", "p-1", s.now);
    for _ in 0..300 {
        s.tick(); // the request waits in D's queue for 300 s = 10 leases
    }
    assert!(s.freed.is_empty(), "blocks kept while D heartbeats");
    s.d.untrack("d-1");
    s.to_p.push_back(
        Completion {
            request_id: "p-1".into(),
            tp_size: 1,
        }
        .encode(),
    );
    s.tick();
    assert_eq!(s.freed.len(), 1);
    assert_eq!(s.freed[0].1, FreeReason::Completed);
}

#[test]
fn without_heartbeats_the_initial_lease_runs_out_at_30_s() {
    let mut s = Pair::new(30);
    let t0 = s.now;
    s.p.pin("p-1", vec![1], t0);
    for _ in 0..40 {
        s.tick();
    }
    assert_eq!(s.freed[0].2 - t0, secs(30));
}

// ---------------------------------------------------------------- push: P's matching

fn drain_push(m: &mut PushMatcher) -> Vec<PushAction> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn writes(a: &[PushAction]) -> Vec<(String, Vec<u64>, String)> {
    a.iter()
        .filter_map(|a| match a {
            PushAction::Write {
                request_id,
                remote_blocks,
                reg,
                ..
            } => Some((
                request_id.clone(),
                remote_blocks.clone(),
                reg.request_id.clone(),
            )),
            PushAction::Handshake { .. } => None,
        })
        .collect()
}

#[test]
fn push_matches_in_both_arrival_orders_with_the_handshake_ratio() {
    let t0 = Instant::now();
    for reg_first in [true, false] {
        let mut m = PushMatcher::new(secs(480));
        let r = reg("d-1", "p-1", vec![5, 6]);
        if reg_first {
            m.on_registration(r.clone(), t0);
            assert_eq!(m.pending_registrations(), 1);
            assert!(drain_push(&mut m).is_empty());
            m.on_finished("p-1", vec![50, 51, 52, 53]);
        } else {
            m.on_finished("p-1", vec![50, 51, 52, 53]);
            assert!(m.has_unmatched_blocks(), "the writer self-polls now");
            m.on_registration(r.clone(), t0);
        }
        assert!(!m.has_unmatched_blocks());
        // first contact with D: a handshake, the WRITE deferred behind it
        assert_eq!(
            drain_push(&mut m),
            vec![PushAction::Handshake {
                engine: "decode-engine".into(),
                host: "10.0.0.2".into(),
                port: 5600
            }]
        );
        m.handshake_done("decode-engine", Ok(2));
        let a = drain_push(&mut m);
        assert_eq!(
            a,
            vec![PushAction::Write {
                request_id: "p-1".into(),
                local_blocks: vec![50, 51, 52, 53],
                remote_blocks: vec![10, 11, 12, 13],
                first_block: 0,
                last: true,
                only: true,
                reg: Box::new(r),
            }],
            "logical 5, 6 at 2 physical per logical"
        );
        // a second registration for the same engine goes straight to a WRITE
        m.on_finished("p-2", vec![60, 61]);
        m.on_registration(reg("d-2", "p-2", vec![1]), t0);
        assert_eq!(
            writes(&drain_push(&mut m)),
            vec![("p-2".into(), vec![2, 3], "d-2".into())],
            "two P blocks into the two physical blocks of D's logical block 1"
        );
    }
}

/// A WRITE: (P blocks, D blocks, first block, last, only).
type Part = (Vec<u64>, Vec<u64>, usize, bool, bool);

/// The WRITEs of `a`.
fn parts(a: &[PushAction]) -> Vec<Part> {
    a.iter()
        .filter_map(|a| match a {
            PushAction::Write {
                local_blocks,
                remote_blocks,
                first_block,
                last,
                only,
                ..
            } => Some((
                local_blocks.clone(),
                remote_blocks.clone(),
                *first_block,
                *last,
                *only,
            )),
            PushAction::Handshake { .. } => None,
        })
        .collect()
}

#[test]
fn push_stream_writes_each_closed_block_once_and_the_rest_at_the_end() {
    let t0 = Instant::now();
    // a 5-block prompt (P blocks 10..14) into D blocks 20..24; steps close 2, 2, 0, 1 blocks
    let p: Vec<u64> = (10..15).collect();
    let d: Vec<u64> = (20..25).collect();
    for reg_after_steps in 0..=3 {
        let mut m = PushMatcher::new(secs(480));
        m.handshake_done("decode-engine", Ok(1));
        let r = reg("d-1", "p-1", d.clone());
        let steps: [usize; 3] = [2, 4, 4];
        let mut all = Vec::new();
        for (i, closed) in steps.iter().enumerate() {
            if i == reg_after_steps {
                m.on_registration(r.clone(), t0);
            }
            m.on_stream("p-1", p[..*closed].to_vec(), 5);
            all.extend(parts(&drain_push(&mut m)));
        }
        if reg_after_steps == 3 {
            assert!(all.is_empty(), "nothing goes before the registration");
            assert!(m.has_unmatched_blocks(), "the writer self-polls meanwhile");
            m.on_registration(r.clone(), t0);
            all.extend(parts(&drain_push(&mut m)));
        }
        m.on_finished("p-1", p.clone());
        all.extend(parts(&drain_push(&mut m)));
        // every block exactly once, pair for pair, in order; the first pair's index right
        let local: Vec<u64> = all.iter().flat_map(|w| w.0.clone()).collect();
        let remote: Vec<u64> = all.iter().flat_map(|w| w.1.clone()).collect();
        assert_eq!(
            local, p,
            "registration after {reg_after_steps} steps: {all:?}"
        );
        assert_eq!(remote, d);
        for w in &all {
            if let Some(&b) = w.0.first() {
                assert_eq!(w.2 as u64, b - 10, "first_block of {w:?}");
            }
        }
        // only the last WRITE is last; it is the only one exactly when nothing streamed
        assert!(all.last().unwrap().3);
        assert!(all[..all.len() - 1].iter().all(|w| !w.3));
        assert_eq!(all.last().unwrap().4, all.len() == 1);
        let expect_parts = match reg_after_steps {
            // [10,11] and [12,13] as their steps close them (or at the registration after
            // the first step), then [14] at the end
            0 | 1 => 3,
            // the 4 closed blocks at the registration, then [14]
            _ => 2,
        };
        assert_eq!(all.len(), expect_parts, "{all:?}");
    }
    // D holding a prefix: the lists align at their ends, streamed blocks D has are skipped
    let mut m = PushMatcher::new(secs(480));
    m.handshake_done("decode-engine", Ok(1));
    m.on_registration(reg("d-2", "p-2", vec![7, 8]), t0);
    m.on_stream("p-2", vec![1, 2], 4);
    assert!(
        parts(&drain_push(&mut m)).is_empty(),
        "D holds blocks 0 and 1"
    );
    m.on_stream("p-2", vec![1, 2, 3], 4);
    m.on_finished("p-2", vec![1, 2, 3, 4]);
    assert_eq!(
        parts(&drain_push(&mut m)),
        vec![
            (vec![3], vec![7], 2, false, false),
            (vec![4], vec![8], 3, true, false)
        ]
    );
}

#[test]
fn push_matches_exact_ids_first_then_base_ids_keeping_sub_requests_apart() {
    let t0 = Instant::now();
    let mut m = PushMatcher::new(secs(480));
    m.handshake_done("decode-engine", Ok(1));
    // P and D wrap the proxy's id with different random suffixes
    m.on_finished("cmpl-x-0-aaaaaaaa", vec![1]);
    m.on_finished("cmpl-x-1-aaaaaaaa", vec![2]);
    m.on_registration(reg("d-0", "cmpl-x-0-bbbbbbbb", vec![10]), t0);
    m.on_registration(reg("d-1", "cmpl-x-1-bbbbbbbb", vec![11]), t0);
    let w = writes(&drain_push(&mut m));
    assert_eq!(
        w,
        vec![
            ("cmpl-x-0-aaaaaaaa".into(), vec![10], "d-0".into()),
            ("cmpl-x-1-aaaaaaaa".into(), vec![11], "d-1".into())
        ]
    );
    // an exact id wins over a base-id match
    m.on_finished("cmpl-y-0-cccccccc", vec![3]);
    m.on_finished("cmpl-y-0", vec![4]);
    m.on_registration(reg("d-y", "cmpl-y-0", vec![12]), t0);
    assert_eq!(writes(&drain_push(&mut m))[0].0, "cmpl-y-0");
    // registrations first, then the prefill: exact before base
    let mut m = PushMatcher::new(secs(480));
    m.handshake_done("decode-engine", Ok(1));
    m.on_registration(reg("d-b", "cmpl-z-0-dddddddd", vec![1]), t0);
    m.on_registration(reg("d-e", "cmpl-z-0-eeeeeeee", vec![2]), t0);
    m.on_finished("cmpl-z-0-eeeeeeee", vec![9]);
    let w = writes(&drain_push(&mut m));
    assert_eq!(w.len(), 2, "{w:?}");
    assert_eq!(w[0].2, "d-e", "the exact match first");
}

#[test]
fn push_failures_drop_and_count_without_retrying() {
    let t0 = Instant::now();
    let mut m = PushMatcher::new(secs(480));
    m.on_finished("p-1", vec![1]);
    m.on_registration(reg("d-1", "p-1", vec![1]), t0);
    assert_eq!(drain_push(&mut m).len(), 1); // the handshake
    m.handshake_done("decode-engine", Err("refused".into()));
    assert!(drain_push(&mut m).is_empty(), "no retry loop");
    assert_eq!(m.dropped, 1);
    m.write_failed();
    assert_eq!(m.dropped, 2);
    // eviction (lease over) forgets the blocks; a late registration waits, then expires
    m.evict("p-1");
    m.on_registration(reg("d-9", "p-1", vec![1]), t0);
    assert_eq!(m.pending_registrations(), 1);
    assert_eq!(m.poll_timeout(), Some(t0 + secs(480)));
    m.handle_timeout(t0 + secs(479));
    assert_eq!(m.pending_registrations(), 1);
    m.handle_timeout(t0 + secs(480));
    assert_eq!(m.pending_registrations(), 0);
}

// ---------------------------------------------------------------- push: D's accounting

#[test]
fn push_receiver_watchdog_failures_and_completions() {
    let t0 = Instant::now();
    let mut d = PushReceiver::new(secs(480), 1);
    d.registered("d-1", t0);
    d.registered("d-2", t0);
    d.registered("d-3", t0);
    // regression: a failed send is reported by the next get_finished, not after a lease
    d.send_failed("d-2");
    assert_eq!(d.get_finished(), (vec![], vec!["d-2".to_string()]));
    // regression: a successful push reports completion (P sends D's own id)
    d.handle_completion(&Completion {
        request_id: "d-1".into(),
        tp_size: 1,
    });
    assert_eq!(d.get_finished(), (vec!["d-1".to_string()], vec![]));
    // the watchdog: to the second, and a dropped registration is not a failure
    d.handle_timeout(t0 + secs(479));
    assert!(d.is_pending("d-3"));
    d.handle_timeout(t0 + secs(480));
    assert!(!d.is_pending("d-3"));
    assert_eq!(d.expired, vec!["d-3".to_string()]);
    assert_eq!(d.get_finished(), (vec![], vec![]));
    d.handle_completion(&Completion {
        request_id: "d-3".into(),
        tp_size: 1,
    });
    assert_eq!(d.unknown_completions, 1, "late completion ignored");
    // P TP 4 writing into D TP 2: two P ranks per D rank must report
    let mut d = PushReceiver::new(secs(480), 2);
    d.registered("r", t0);
    let c = Completion {
        request_id: "r".into(),
        tp_size: 4,
    };
    d.handle_completion(&c);
    assert_eq!(d.get_finished().0.len(), 0);
    d.handle_completion(&c);
    assert_eq!(d.get_finished().0, vec!["r".to_string()]);
}

/// The whole push exchange in virtual time: D registers, P prefills later, P handshakes,
/// WRITEs, and reports completion with D's id; D finishes the receive and stops
/// heartbeating; P frees on the lease path only if D never completes.
#[test]
fn push_end_to_end_in_virtual_time() {
    let t0 = Instant::now();
    let mut p_match = PushMatcher::new(secs(480));
    let mut p_lease = Leases::new(secs(30), 1);
    let mut d_recv = PushReceiver::new(secs(480), 1);
    let mut d_hb = Heartbeats::new(secs(30));
    // D: the request enters the scheduler (heartbeats), blocks allocated, registration sent
    d_hb.track("d-1", "P0", "p-1-aaaaaaaa", t0);
    let wire = reg("d-1", "p-1-aaaaaaaa", vec![4]).encode();
    d_recv.registered("d-1", t0);
    // P receives it before its prefill finished
    let KvMsg::PushReg(r) = KvMsg::decode(&wire).unwrap() else {
        panic!()
    };
    p_match.on_registration(r, t0 + secs(1));
    // P's prefill finishes 3 s later (its own suffix differs)
    p_lease.pin("p-1-bbbbbbbb", vec![40], t0 + secs(4));
    p_match.on_finished("p-1-bbbbbbbb", vec![40]);
    let mut completions = Vec::new();
    while let Some(a) = p_match.poll_action() {
        match a {
            PushAction::Handshake { engine, .. } => p_match.handshake_done(&engine, Ok(1)),
            PushAction::Write { reg, .. } => completions.push(
                Completion {
                    request_id: reg.request_id,
                    tp_size: 1,
                }
                .encode(),
            ),
        }
    }
    assert_eq!(completions, vec![b"d-1:1".to_vec()]);
    for c in completions {
        let KvMsg::Completion(c) = KvMsg::decode(&c).unwrap() else {
            panic!()
        };
        d_recv.handle_completion(&c);
    }
    let (done, failed) = d_recv.get_finished();
    assert_eq!((done, failed), (vec!["d-1".to_string()], vec![]));
    d_hb.untrack("d-1");
    // P: the WRITE finished -> finished_sending clears the lease
    assert!(p_lease.abort("p-1-bbbbbbbb"));
    p_match.evict("p-1-bbbbbbbb");
    assert!(!p_match.has_unmatched_blocks());
}

#[test]
fn withdrawals_round_trip_and_drop_a_registration_wherever_it_is() {
    use super::kvmsg::{PushCancel, PushCancelled};
    let c = PushCancel {
        request_id: "d1".into(),
        engine_id: "decode-0".into(),
        host: "10.0.0.2".into(),
        port: 5600,
    };
    assert_eq!(
        KvMsg::decode(&c.encode()).unwrap(),
        KvMsg::PushCancel(c.clone())
    );
    let a = PushCancelled {
        request_id: "d1".into(),
        tp_size: 2,
    };
    assert_eq!(KvMsg::decode(&a.encode()).unwrap(), KvMsg::PushCancelled(a));
    assert!(KvMsg::decode(b"PUSH_CANCEL:\x80").is_err());
    let t0 = Instant::now();
    // pending (no prefill yet): dropped, the prefill then finds nothing to write
    let mut m = PushMatcher::new(Duration::from_secs(60));
    let mut r = reg("d1", "p1", vec![5, 6]);
    r.engine_id = "decode-0".into();
    m.on_registration(r.clone(), t0);
    assert!(
        !m.cancel("other-engine", "d1"),
        "another D's withdrawal touches nothing"
    );
    assert!(m.cancel("decode-0", "d1"));
    m.on_finished("p1", vec![1, 2]);
    assert_eq!(m.poll_action(), None, "nothing matched, nothing written");
    // matched and waiting for its handshake: dropped, the handshake replays nothing
    let mut m = PushMatcher::new(Duration::from_secs(60));
    m.on_finished("p1", vec![1, 2]);
    m.on_registration(r.clone(), t0);
    assert!(matches!(
        m.poll_action(),
        Some(PushAction::Handshake { .. })
    ));
    assert!(m.cancel("decode-0", "d1"));
    m.handshake_done("decode-0", Ok(1));
    assert_eq!(m.poll_action(), None);
    // streaming: the WRITE not yet taken and the rest are dropped
    let mut m = PushMatcher::new(Duration::from_secs(60));
    m.handshake_done("decode-0", Ok(1));
    m.on_stream("p1", vec![1], 3);
    m.on_registration(r, t0);
    assert!(m.cancel("decode-0", "d1"));
    m.on_stream("p1", vec![1, 2], 3);
    m.on_finished("p1", vec![1, 2, 3]);
    assert_eq!(m.poll_action(), None);
    assert!(!m.cancel("decode-0", "d1"), "twice: nothing left");
}

#[test]
fn a_registration_that_finds_no_prefill_expires_for_the_writer_to_refuse() {
    let t0 = Instant::now();
    let mut m = PushMatcher::new(secs(10));
    m.on_registration(reg("d-1", "p-gone", vec![5]), t0);
    m.on_registration(reg("d-2", "p-late", vec![6]), t0 + secs(5));
    m.handle_timeout(t0 + secs(9));
    assert!(m.expired.is_empty(), "inside its TTL it waits");
    m.handle_timeout(t0 + secs(10));
    let gone: Vec<String> = m.expired.drain(..).map(|r| r.request_id).collect();
    assert_eq!(
        gone,
        vec!["d-1".to_string()],
        "the first expired, named by D's id"
    );
    assert_eq!((m.pending_registrations(), m.dropped), (1, 1));
    // the other one still matches when its prefill comes
    m.on_finished("p-late", vec![60]);
    assert!(!drain_push(&mut m).is_empty());
    m.handle_timeout(t0 + secs(100));
    assert!(m.expired.is_empty(), "a matched registration never expires");
}
