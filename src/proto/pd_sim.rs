//! A P/D pair in virtual time with a fault script (quinn's `Pair`, grown up): P's leases and
//! push matcher, D's heartbeats and push receiver, a network with latency between them,
//! transfers that take time, and a script that crashes either side, partitions the network,
//! or makes handshakes or WRITEs fail for a while. Every rule of the protocol runs as the
//! connector runs it; the simulation records what each side reported and when, and checks
//! the invariants after every tick: a side never reports a request twice, D never reports
//! KV that did not land, a completion never precedes its bytes, and P frees a request
//! `Completed` only after its bytes landed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::kvmsg::{Completion, KvMsg, PushReg};
use super::lease::{FreeReason, HeartbeatAction, Heartbeats, LeaseEvent, Leases};
use super::push::{PushAction, PushMatcher, PushReceiver};

/// Pull (D READs) or push (P WRITEs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Pull,
    Push,
}

/// Something the script does to the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// D dies: it sends nothing more, and what is sent to it is lost.
    CrashD,
    /// P dies.
    CrashP,
    /// Every message either way is lost for this long.
    Partition(Duration),
    /// Handshakes fail for this long.
    HandshakesFail(Duration),
    /// WRITEs fail for this long.
    WritesFail(Duration),
}

/// One request's timeline (offsets from the start).
#[derive(Debug, Clone)]
pub(super) struct Req {
    /// P's prefill ends (P pins the blocks; push: the writer learns of them).
    pub(super) finish: Duration,
    /// The request enters D's scheduler (heartbeats start).
    pub(super) admit: Duration,
    /// D schedules the load (pull: the READ; push: the registration goes out).
    pub(super) load: Duration,
}

/// How a side ended a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DEnd {
    /// Every byte landed.
    Received,
    /// Reported failed (the engine recomputes).
    Failed,
    /// The registration watchdog dropped it.
    Expired,
}

enum Xfer {
    Read { p: String, d: String },
    Write { p: String, d: String },
}

/// The simulation.
pub(super) struct Sim {
    mode: Mode,
    t0: Instant,
    pub(super) now: Instant,
    tick: Duration,
    latency: Duration,
    xfer_time: Duration,
    script: Vec<(Duration, Fault, bool)>,
    reqs: Vec<(String, String, Req)>,
    pub(super) p_alive: bool,
    pub(super) d_alive: bool,
    partition_until: Option<Instant>,
    hs_fail_until: Option<Instant>,
    wr_fail_until: Option<Instant>,
    p: Leases,
    matcher: PushMatcher,
    d: Heartbeats,
    recv: PushReceiver,
    net: Vec<(Instant, bool, Vec<u8>)>,
    xfers: Vec<(Instant, Xfer)>,
    pinned: HashSet<String>,
    landed: HashSet<String>,
    /// P request → (why freed, when).
    pub(super) p_freed: HashMap<String, (FreeReason, Instant)>,
    /// D request → (how it ended, when).
    pub(super) d_end: HashMap<String, (DEnd, Instant)>,
    /// When each fault fired.
    pub(super) fired: Vec<(Fault, Instant)>,
    /// A READ that read blocks P had already freed (possible only without fencing, when
    /// heartbeats were lost longer than the lease extension: the lease protocol's limit).
    pub(super) stale_reads: Vec<String>,
    /// P's blocks are fenced (`fence_blocks`, the default): freeing them revokes the grant
    /// D READs through, so a late READ fails instead.
    fenced: bool,
    /// READs refused because P had revoked the grant (fenced).
    pub(super) revoked_reads: Vec<String>,
    pub(super) violations: Vec<String>,
}

const LEASE: Duration = Duration::from_secs(30);
const WATCHDOG: Duration = Duration::from_secs(480);

fn until(t: Option<Instant>, now: Instant) -> bool {
    t.is_some_and(|t| now < t)
}

impl Sim {
    /// `n`-th request ids: P's and D's differ in the per-engine suffix (base-id matching).
    pub(super) fn ids(i: usize) -> (String, String) {
        (
            format!("cmpl-r{i}-0-aaaaaaaa"),
            format!("cmpl-r{i}-0-bbbbbbbb"),
        )
    }

    pub(super) fn new(mode: Mode, reqs: Vec<Req>, script: Vec<(Duration, Fault)>) -> Self {
        let t0 = Instant::now();
        Self {
            mode,
            t0,
            now: t0,
            tick: Duration::from_millis(100),
            latency: Duration::from_millis(300),
            xfer_time: Duration::from_millis(700),
            script: script.into_iter().map(|(t, f)| (t, f, false)).collect(),
            reqs: reqs
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    let (p, d) = Self::ids(i);
                    (p, d, r)
                })
                .collect(),
            p_alive: true,
            d_alive: true,
            partition_until: None,
            hs_fail_until: None,
            wr_fail_until: None,
            p: Leases::new(LEASE, 1),
            matcher: PushMatcher::new(WATCHDOG),
            d: Heartbeats::new(LEASE),
            recv: PushReceiver::new(WATCHDOG, 1),
            net: Vec::new(),
            xfers: Vec::new(),
            pinned: HashSet::new(),
            landed: HashSet::new(),
            p_freed: HashMap::new(),
            d_end: HashMap::new(),
            fired: Vec::new(),
            stale_reads: Vec::new(),
            fenced: true,
            revoked_reads: Vec::new(),
            violations: Vec::new(),
        }
    }

    /// Without fencing (`fence_blocks` false): what the lease protocol alone guarantees.
    pub(super) fn unfenced(mut self) -> Self {
        self.fenced = false;
        self
    }

    /// Network latency and transfer time.
    pub(super) fn timing(mut self, latency: Duration, xfer: Duration) -> Self {
        self.latency = latency;
        self.xfer_time = xfer;
        self
    }

    /// When a fault fired, by kind.
    pub(super) fn fired_at(&self, f: Fault) -> Option<Instant> {
        self.fired.iter().find(|(g, _)| *g == f).map(|(_, t)| *t)
    }

    /// The time `d` after the start.
    pub(super) fn at(&self, d: Duration) -> Instant {
        self.t0 + d
    }

    fn send(&mut self, to_p: bool, m: Vec<u8>) {
        if !until(self.partition_until, self.now) {
            self.net.push((self.now + self.latency, to_p, m));
        }
    }

    fn d_ends(&mut self, d: &str, how: DEnd) {
        if self.d_end.contains_key(d) {
            self.violations.push(format!("D reported {d} twice"));
            return;
        }
        if how == DEnd::Received && !self.landed.contains(d) {
            self.violations
                .push(format!("D reported {d} received before its bytes landed"));
        }
        self.d_end.insert(d.to_owned(), (how, self.now));
        self.d.untrack(d);
    }

    fn p_frees(&mut self, p: &str, why: FreeReason) {
        if self.p_freed.contains_key(p) {
            self.violations.push(format!("P freed {p} twice"));
        }
        if why == FreeReason::Completed
            && !self
                .reqs
                .iter()
                .any(|r| r.0 == p && self.landed.contains(&r.1))
        {
            self.violations
                .push(format!("P freed {p} as completed before its bytes landed"));
        }
        self.p_freed.insert(p.to_owned(), (why, self.now));
        self.pinned.remove(p);
        self.matcher.evict(p);
    }

    /// Run until `end` (offset from the start).
    pub(super) fn run(&mut self, end: Duration) {
        while self.now < self.t0 + end {
            self.step();
        }
    }

    fn step(&mut self) {
        self.now += self.tick;
        let now = self.now;
        // the script
        for i in 0..self.script.len() {
            let (t, f, done) = self.script[i];
            if done || self.t0 + t > now {
                continue;
            }
            self.script[i].2 = true;
            self.fired.push((f, now));
            match f {
                Fault::CrashD => self.d_alive = false,
                Fault::CrashP => self.p_alive = false,
                Fault::Partition(d) => self.partition_until = Some(now + d),
                Fault::HandshakesFail(d) => self.hs_fail_until = Some(now + d),
                Fault::WritesFail(d) => self.wr_fail_until = Some(now + d),
            }
        }
        self.requests();
        self.deliver();
        self.transfers();
        if self.p_alive {
            self.p_side();
        }
        if self.d_alive {
            self.d_side();
        }
    }

    fn requests(&mut self) {
        let now = self.now;
        let reqs = self.reqs.clone();
        for (p, d, r) in &reqs {
            if self.t0 + r.finish > now - self.tick && self.t0 + r.finish <= now && self.p_alive {
                self.p.pin(p, vec![1, 2], now);
                self.pinned.insert(p.clone());
                if self.mode == Mode::Push {
                    self.matcher.on_finished(p, vec![1, 2]);
                }
            }
            if self.t0 + r.admit > now - self.tick && self.t0 + r.admit <= now && self.d_alive {
                self.d.track(d, "P", p, now);
            }
            if self.t0 + r.load > now - self.tick && self.t0 + r.load <= now && self.d_alive {
                let reachable = self.p_alive && !until(self.hs_fail_until, now);
                match self.mode {
                    Mode::Pull if !reachable => self.d_ends(d, DEnd::Failed),
                    Mode::Pull => {
                        let x = Xfer::Read {
                            p: p.clone(),
                            d: d.clone(),
                        };
                        self.xfers.push((now + self.xfer_time, x));
                    }
                    Mode::Push => {
                        self.recv.registered(d, now);
                        if reachable {
                            let reg = PushReg {
                                request_id: d.clone(),
                                engine_id: "D".into(),
                                host: "10.0.0.2".into(),
                                port: 1,
                                tp_rank: 0,
                                tp_size: 1,
                                block_ids: vec![7, 8],
                                remote_engine_id: "P".into(),
                                remote_request_id: p.clone(),
                                grant: None,
                            };
                            self.send(true, reg.encode());
                        } else {
                            // the D-side handshake or send failed: reported at once
                            self.recv.send_failed(d);
                        }
                    }
                }
            }
        }
    }

    fn deliver(&mut self) {
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.net)
            .into_iter()
            .partition(|(t, _, _)| *t <= now);
        self.net = later;
        for (_, to_p, m) in due {
            let alive = if to_p { self.p_alive } else { self.d_alive };
            if !alive {
                continue;
            }
            match KvMsg::decode(&m) {
                Ok(KvMsg::Heartbeat(ids)) if to_p => {
                    self.p.handle_heartbeat(&ids, now);
                }
                Ok(KvMsg::Completion(c)) if to_p => {
                    self.p.handle_completion(&c);
                }
                Ok(KvMsg::PushReg(r)) if to_p => self.matcher.on_registration(r, now),
                Ok(KvMsg::Completion(c)) => {
                    if !self.landed.contains(&c.request_id) {
                        self.violations
                            .push(format!("completion for {} before its bytes", c.request_id));
                    }
                    self.recv.handle_completion(&c);
                }
                other => self
                    .violations
                    .push(format!("unexpected message {other:?}")),
            }
        }
    }

    fn transfers(&mut self) {
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.xfers)
            .into_iter()
            .partition(|(t, _)| *t <= now);
        self.xfers = later;
        for (_, x) in due {
            match x {
                Xfer::Read { p, d } => {
                    if !self.d_alive {
                        continue;
                    }
                    if !self.p_alive || until(self.partition_until, now) {
                        self.d_ends(&d, DEnd::Failed); // the READ errors out
                        continue;
                    }
                    if !self.pinned.contains(&p) {
                        if self.fenced {
                            // the grant was revoked when P freed the blocks: the NIC refuses
                            self.revoked_reads.push(d.clone());
                            self.d_ends(&d, DEnd::Failed);
                            continue;
                        }
                        self.stale_reads.push(d.clone());
                    }
                    self.landed.insert(d.clone());
                    self.d_ends(&d, DEnd::Received);
                    let c = Completion {
                        request_id: p,
                        tp_size: 1,
                    };
                    self.send(true, c.encode());
                }
                Xfer::Write { p, d } => {
                    if !self.p_alive {
                        continue;
                    }
                    if !self.d_alive || until(self.partition_until, now) {
                        self.matcher.write_failed(); // the lease and the watchdog clean up
                        continue;
                    }
                    self.landed.insert(d.clone());
                    let c = Completion {
                        request_id: d,
                        tp_size: 1,
                    };
                    self.send(false, c.encode());
                    // the writer reports the WRITE done: P frees
                    self.p.handle_completion(&Completion {
                        request_id: p,
                        tp_size: 1,
                    });
                }
            }
        }
    }

    fn p_side(&mut self) {
        let now = self.now;
        self.matcher.handle_timeout(now);
        while let Some(a) = self.matcher.poll_action() {
            match a {
                PushAction::Handshake { engine, .. } => {
                    let ok = self.d_alive && !until(self.hs_fail_until, now);
                    let r = if ok { Ok(1) } else { Err("refused".into()) };
                    self.matcher.handshake_done(&engine, r);
                }
                PushAction::Write {
                    request_id, reg, ..
                } => {
                    if until(self.wr_fail_until, now) {
                        self.matcher.write_failed();
                    } else if !self.pinned.contains(&request_id) {
                        self.violations
                            .push(format!("WRITE of {request_id} after P freed it"));
                    } else {
                        let x = Xfer::Write {
                            p: request_id,
                            d: reg.request_id,
                        };
                        self.xfers.push((now + self.xfer_time, x));
                    }
                }
            }
        }
        self.p.handle_timeout(now);
        while let Some(LeaseEvent::Free {
            request_id, reason, ..
        }) = self.p.poll_event()
        {
            self.p_frees(&request_id, reason);
        }
    }

    fn d_side(&mut self) {
        let now = self.now;
        self.d.handle_timeout(now);
        while let Some(a) = self.d.poll_action() {
            match a {
                HeartbeatAction::Handshake { engine } => {
                    let ok = self.p_alive && !until(self.hs_fail_until, now);
                    self.d.handshake_done(&engine, ok);
                }
                HeartbeatAction::Send { message, .. } => self.send(true, message),
            }
        }
        self.recv.handle_timeout(now);
        let (ok, failed) = self.recv.get_finished();
        for d in ok {
            self.d_ends(&d, DEnd::Received);
        }
        for d in failed {
            self.d_ends(&d, DEnd::Failed);
        }
        for d in std::mem::take(&mut self.recv.expired) {
            self.d_ends(&d, DEnd::Expired);
        }
    }

    /// The checks every run must pass: no violation; every request P pinned is freed
    /// once (while P lives); every request D admitted ends once (while D lives).
    pub(super) fn check(&self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        for (p, d, _) in &self.reqs {
            if self.p_alive && self.pinned.contains(p) {
                return Err(format!("P still holds {p}"));
            }
            if self.d_alive && !self.d_end.contains_key(d) {
                return Err(format!("D never ended {d}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(x: f64) -> Duration {
        Duration::from_secs_f64(x)
    }

    fn req(finish: f64, admit: f64, load: f64) -> Req {
        Req {
            finish: s(finish),
            admit: s(admit),
            load: s(load),
        }
    }

    fn end(sim: &Sim, i: usize) -> (Option<DEnd>, Option<FreeReason>) {
        let (p, d) = Sim::ids(i);
        (
            sim.d_end.get(&d).map(|e| e.0),
            sim.p_freed.get(&p).map(|e| e.0),
        )
    }

    const OK: (Option<DEnd>, Option<FreeReason>) =
        (Some(DEnd::Received), Some(FreeReason::Completed));

    #[test]
    fn every_arrival_order_completes_without_faults() {
        // pull: D learns of the request after P finished; push: D may register first
        let orders = [
            req(1.0, 2.0, 3.0),
            req(1.0, 2.0, 2.0),
            req(5.0, 1.0, 2.0),  // push: registration 3 s before the prefill ends
            req(2.0, 2.0, 2.0),  // all at once
            req(1.0, 1.0, 90.0), // D queued for three leases
        ];
        for mode in [Mode::Pull, Mode::Push] {
            for latency in [0.0, 0.3, 2.0] {
                let reqs: Vec<Req> = orders
                    .iter()
                    .filter(|r| mode == Mode::Push || r.load > r.finish)
                    .cloned()
                    .collect();
                let n = reqs.len();
                let mut sim = Sim::new(mode, reqs, vec![]).timing(s(latency), s(0.5));
                sim.run(s(200.0));
                sim.check().unwrap();
                for i in 0..n {
                    assert_eq!(end(&sim, i), OK, "{mode:?} latency {latency} request {i}");
                }
                assert!(sim.stale_reads.is_empty());
            }
        }
    }

    #[test]
    fn a_d_crash_lets_p_free_every_request_within_the_extension() {
        for mode in [Mode::Pull, Mode::Push] {
            // D holds three requests in its queue (loads far later) and dies at 61 s
            let reqs = vec![
                req(1.0, 2.0, 500.0),
                req(3.0, 3.0, 500.0),
                req(4.0, 10.0, 500.0),
            ];
            let mut sim = Sim::new(mode, reqs, vec![(s(61.0), Fault::CrashD)]);
            sim.run(s(700.0));
            sim.check().unwrap();
            let crash = sim.fired_at(Fault::CrashD).unwrap();
            for i in 0..3 {
                let (p, _) = Sim::ids(i);
                let (why, at) = sim.p_freed[&p];
                assert_eq!(why, FreeReason::Expired);
                // the last heartbeat left at most one interval (5 s) before the crash and
                // extends by 20 s: freed 15..20 s after the crash (plus the latency), never
                // after the 480 s of the old design
                let after = at - crash;
                assert!(
                    after > s(14.0) && after <= s(20.5),
                    "{mode:?} {p}: {after:?}"
                );
            }
        }
    }

    #[test]
    fn a_p_crash_fails_d_cleanly() {
        // pull: P dies before D's READ: failed at the load, at once
        let mut sim = Sim::new(
            Mode::Pull,
            vec![req(1.0, 2.0, 20.0)],
            vec![(s(10.0), Fault::CrashP)],
        );
        sim.run(s(600.0));
        sim.check().unwrap();
        let (_, d) = Sim::ids(0);
        assert_eq!(sim.d_end[&d], (DEnd::Failed, sim.at(s(20.0))));
        // push, P dead when D registers: the send fails and the next get_finished says so
        // (public bug 1: not after a whole lease)
        let mut sim = Sim::new(
            Mode::Push,
            vec![req(30.0, 2.0, 20.0)],
            vec![(s(10.0), Fault::CrashP)],
        );
        sim.run(s(600.0));
        sim.check().unwrap();
        assert_eq!(sim.d_end[&d], (DEnd::Failed, sim.at(s(20.0))));
        // push, P dies after the registration reached it, before its prefill ends: the
        // watchdog drops the registration at 480 s, without a failure D did not see
        let mut sim = Sim::new(
            Mode::Push,
            vec![req(30.0, 2.0, 5.0)],
            vec![(s(10.0), Fault::CrashP)],
        );
        sim.run(s(600.0));
        sim.check().unwrap();
        assert_eq!(sim.d_end[&d], (DEnd::Expired, sim.at(s(485.0))));
    }

    #[test]
    fn a_partition_shorter_than_the_extension_changes_nothing() {
        for mode in [Mode::Pull, Mode::Push] {
            let reqs = vec![req(1.0, 2.0, 60.0), req(2.0, 2.0, 70.0)];
            let mut sim = Sim::new(mode, reqs, vec![(s(20.0), Fault::Partition(s(14.0)))]);
            sim.run(s(200.0));
            sim.check().unwrap();
            assert_eq!(end(&sim, 0), OK, "{mode:?}");
            assert_eq!(end(&sim, 1), OK, "{mode:?}");
        }
    }

    #[test]
    fn a_partition_longer_than_the_extension_is_fenced() {
        // pull: heartbeats are lost for 60 s, P frees at expiry; D's later READ targets
        // blocks P no longer holds. The lease protocol cannot see this (one-sided READ):
        // without fencing the READ reads them; with it (the default) P revoked the grant
        // when it freed them, the READ fails and D ends the request as failed.
        let run = |sim: Sim| {
            let mut sim = sim;
            sim.run(s(300.0));
            sim.check().unwrap();
            sim
        };
        let make = || {
            Sim::new(
                Mode::Pull,
                vec![req(1.0, 2.0, 100.0)],
                vec![(s(10.0), Fault::Partition(s(60.0)))],
            )
        };
        let (p, d) = Sim::ids(0);
        let sim = run(make().unfenced());
        assert_eq!(sim.p_freed[&p].0, FreeReason::Expired);
        assert_eq!(sim.stale_reads, vec![d.clone()]);
        let sim = run(make());
        assert_eq!(sim.p_freed[&p].0, FreeReason::Expired);
        assert!(sim.stale_reads.is_empty());
        assert_eq!(sim.revoked_reads, vec![d.clone()]);
        assert_eq!(sim.d_end[&d].0, DEnd::Failed);
        // push: the registration is lost in the partition; P frees at expiry, never WRITEs
        // freed blocks; D's watchdog drops the registration
        let mut sim = Sim::new(
            Mode::Push,
            vec![req(1.0, 2.0, 11.0)],
            vec![(s(10.0), Fault::Partition(s(60.0)))],
        );
        sim.run(s(700.0));
        sim.check().unwrap();
        assert_eq!(sim.p_freed[&p].0, FreeReason::Expired);
        assert_eq!(sim.d_end[&d].0, DEnd::Expired);
    }

    #[test]
    fn p_side_handshake_and_write_failures_drop_and_the_lease_cleans_up() {
        for fault in [Fault::HandshakesFail(s(3.0)), Fault::WritesFail(s(3.0))] {
            // D registered at 2 s (fine); P's prefill ends at 10 s, in the failure window:
            // P drops the work (counted, no retry); D's watchdog gives up at 482 s, its
            // heartbeats stop, and P's lease runs out 20 s after the last one
            let mut sim = Sim::new(Mode::Push, vec![req(10.0, 1.0, 2.0)], vec![(s(9.5), fault)]);
            sim.run(s(700.0));
            sim.check().unwrap();
            let (p, d) = Sim::ids(0);
            assert_eq!(sim.matcher.dropped, 1, "{fault:?}");
            assert_eq!(
                sim.d_end[&d],
                (DEnd::Expired, sim.at(s(482.0))),
                "{fault:?}"
            );
            let (why, at) = sim.p_freed[&p];
            assert_eq!(why, FreeReason::Expired);
            assert!(at > sim.at(s(482.0)) && at <= sim.at(s(503.0)), "{fault:?}");
        }
    }

    #[test]
    fn long_d_queues_keep_the_lease_by_p_ids_and_report_completion() {
        // public bug 2: heartbeats named D's ids and leases never renewed; here a push
        // request queued on D for 10 leases still completes, and (public bug 3) D hears of it
        let mut sim = Sim::new(Mode::Push, vec![req(1.0, 2.0, 300.0)], vec![]);
        sim.run(s(400.0));
        sim.check().unwrap();
        assert_eq!(end(&sim, 0), OK);
    }

    fn fault() -> impl Strategy<Value = (Duration, Fault)> {
        let at = (1u64..200).prop_map(Duration::from_secs);
        let len = (1u64..80).prop_map(Duration::from_secs);
        (
            at,
            prop_oneof![
                Just(Fault::CrashD),
                Just(Fault::CrashP),
                len.clone().prop_map(Fault::Partition),
                len.clone().prop_map(Fault::HandshakesFail),
                len.prop_map(Fault::WritesFail),
            ],
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Any timeline and any fault script: no side reports a request twice, D never
        /// reports bytes that did not land, a completion never precedes its bytes, P frees
        /// as completed only what landed, and every request ends on every living side.
        /// Without faults every request completes.
        #[test]
        fn any_fault_script_keeps_the_invariants(
            push in any::<bool>(),
            times in proptest::collection::vec((11u64..120, 0u64..20, 0u64..200), 1..5),
            script in proptest::collection::vec(fault(), 0..4),
            latency_ms in 0u64..2000,
        ) {
            let mode = if push { Mode::Push } else { Mode::Pull };
            // D admits within 20 s of the prefill's end, up to 10 s before it (push: the
            // proxy sends both legs at once); the initial lease covers the proxy's hop.
            // D loads whenever its queue lets it (pull: once P's blocks exist).
            let reqs: Vec<Req> = times
                .iter()
                .map(|&(f, a, l)| {
                    let admit = f + a - 10;
                    let load = if push { admit + l } else { (admit + l).max(f + 3) };
                    req(f as f64, admit as f64, load as f64)
                })
                .collect();
            let n = reqs.len();
            let clean = script.is_empty();
            // heartbeats kept from P for 10 s or more (lost, or no connection to send them)
            let hb_outage = script.iter().any(|(_, f)| {
                matches!(f, Fault::Partition(d) | Fault::HandshakesFail(d) if *d >= s(10.0))
            });
            let make = || Sim::new(mode, reqs.clone(), script.clone())
                .timing(Duration::from_millis(latency_ms), s(0.5));
            let mut sim = make();
            sim.run(s(1200.0));
            prop_assert_eq!(sim.check(), Ok(()));
            // fenced (the default): no READ ever reads freed blocks
            prop_assert!(sim.stale_reads.is_empty(), "{:?}", sim.stale_reads);
            // unfenced, a READ of freed blocks needs a heartbeat outage near the extension
            let mut sim = make().unfenced();
            sim.run(s(1200.0));
            prop_assert_eq!(sim.check(), Ok(()));
            prop_assert!(sim.stale_reads.is_empty() || hb_outage, "{:?}", sim.stale_reads);
            if clean {
                for i in 0..n {
                    prop_assert_eq!(end(&sim, i), OK);
                }
            }
        }
    }
}
