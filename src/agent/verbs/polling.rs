//! Who polls the completion queues: the progress thread, woken by the completion channels,
//! or callers that wait with a polling budget (`agent::spin`, `progress_spin_us`).
//!
//! Each rail's queue is polled under a lock held until what was polled is dispatched, so
//! completions (notifications among them) are dispatched in the order the queue gave them
//! whoever polls. While callers poll — a caller posting in place counts: rxe does the packet
//! work inside the post, and the caller polls again after it — and for one budget after the
//! last one stopped, since a caller that got its answer tends to come back at once, the
//! progress thread takes a completion event without arming the queue again: no wake-up and no
//! lock taken beside the polling caller for each completion. The queues are armed again (and
//! polled once more, for what came before the arm) by a caller that runs out of budget and goes
//! to sleep, or by the progress thread once a budget passed without a poller. The progress
//! thread looks for that after one budget, then — while it keeps finding callers polling —
//! after twice as long each time, up to [`LOOK_MAX`] (or the budget, if longer): with callers
//! polling back to back it woke once a budget for nothing (64 KiB in the lab, 2 ms budget:
//! ~0.6 wake-ups a transfer, the posting process's only context switches). A consumer that
//! does not poll (a `NotifRoute` waiter, a thread sleeping on `Agent::wait` beside a polling
//! one) may so see a completion up to one budget or `LOOK_MAX`, whichever is longer, late
//! after the callers stopped polling without sleeping; with the budget 0 nothing of this runs.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Host;
use super::{lock, Verbs};
use crate::threads::nanos;
use crate::transport::verbs::Completion;

/// The longest the progress thread waits between looks at disarmed queues while callers
/// keep polling (see the module comment), unless the budget is longer.
const LOOK_MAX: Duration = Duration::from_millis(16);

/// Who polls a completion queue.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Poller {
    /// The progress thread (waits its turn).
    Progress,
    /// A waiting caller (skips a queue someone else is polling).
    Caller,
    /// Whoever arms the queues again, right after arming (waits its turn).
    Rearming,
}

/// The polling state of an agent's completion queues.
pub(super) struct PollState {
    /// Per rail: held from polling until dispatched; the buffer polled into.
    bufs: Vec<Mutex<Vec<Completion>>>,
    /// Callers polling now.
    pollers: AtomicUsize,
    /// When the last caller stopped polling without going to sleep, in nanoseconds since
    /// `epoch` plus one; 0 when it went to sleep (or none stopped yet). An atomic, not a
    /// lock: every wait stores it as it ends (a lock and unlock there cost ~27 ns a round
    /// trip in the lab) and the progress thread reads it at every wake-up.
    last: AtomicU64,
    /// What `last` counts from.
    epoch: Instant,
    /// Per rail: an event was taken without arming the queue again.
    disarmed: Vec<AtomicBool>,
    /// How long the progress thread sleeps before its next look at disarmed queues, in
    /// microseconds: one budget, doubled each time it wakes (on its timer or on an event)
    /// and finds callers polling.
    look_us: AtomicU64,
}

impl PollState {
    pub(super) fn new(rails: usize) -> Self {
        Self {
            bufs: (0..rails)
                .map(|_| Mutex::new(Vec::with_capacity(64)))
                .collect(),
            pollers: AtomicUsize::new(0),
            last: AtomicU64::new(0),
            epoch: Instant::now(),
            disarmed: (0..rails).map(|_| AtomicBool::new(false)).collect(),
            look_us: AtomicU64::new(0),
        }
    }

    /// `t` as a `last` stamp.
    fn stamp_at(&self, t: Instant) -> u64 {
        nanos(t.saturating_duration_since(self.epoch)).saturating_add(1)
    }
}

impl Verbs {
    /// The polling budget of a waiting caller (`AgentConfig::progress_spin_us`).
    pub(crate) fn spin(&self) -> Duration {
        self.spin
    }

    /// Poll every rail's completion queue once from the calling thread and dispatch what
    /// they held: how many completions.
    pub(crate) fn poll_once(&self, shared: &dyn Host) -> usize {
        (0..self.rails.len())
            .map(|rail| self.drain(shared, rail, Poller::Caller))
            .sum()
    }

    /// A caller starts polling.
    pub(crate) fn start_polling(&self) {
        self.polling.pollers.fetch_add(1, Ordering::AcqRel);
    }

    /// A caller stops polling; `sleeping`: it ran out of budget and is going to sleep, so
    /// the queues must raise events again and the progress thread must not wait out a
    /// budget before dispatching them (a caller that got its answer tends to come back at
    /// once: for it the queues stay unarmed a budget longer). `seen`: the caller's latest
    /// reading of the clock, taken as the time it stopped (None: read it now).
    pub(crate) fn stop_polling(&self, shared: &dyn Host, sleeping: bool, seen: Option<Instant>) {
        let stamp = if sleeping {
            0
        } else {
            self.polling.stamp_at(seen.unwrap_or_else(Instant::now))
        };
        self.polling.last.store(stamp, Ordering::Release);
        let last = self.polling.pollers.fetch_sub(1, Ordering::AcqRel) == 1;
        if last && sleeping {
            self.rearm(shared);
        }
    }

    /// The progress thread saw rail `rail`'s channel readable.
    pub(super) fn on_cq_event(&self, shared: &dyn Host, rail: usize) {
        let cq = &self.rails[rail].cq;
        if self.callers_polling() {
            // theirs to poll; armed again when they stop
            if cq.take_event().unwrap_or(false) {
                self.polling.disarmed[rail].store(true, Ordering::Release);
            }
            return;
        }
        if let Err(err) = cq.consume_event() {
            tracing::error!(rail = %self.rails[rail].name, error = %err,
                "kvrail: reading the completion event failed");
        }
        self.drain(shared, rail, Poller::Progress);
    }

    /// Callers poll now, or stopped less than one budget ago.
    fn callers_polling(&self) -> bool {
        if self.spin.is_zero() {
            return false; // nobody polls: no lock taken per completion event
        }
        if self.polling.pollers.load(Ordering::Acquire) > 0 {
            return true;
        }
        match self.polling.last.load(Ordering::Acquire) {
            0 => false,
            t => self.polling.stamp_at(Instant::now()).saturating_sub(t) < nanos(self.spin),
        }
    }

    /// The first wait before a look at disarmed queues: one budget (at least 1 ms).
    fn first_look(&self) -> Duration {
        self.spin.max(Duration::from_millis(1))
    }

    /// How long the progress thread may sleep before it must look whether to arm the
    /// queues again (`None`: nothing is disarmed).
    pub(super) fn rearm_after(&self) -> Option<Duration> {
        let any = self
            .polling
            .disarmed
            .iter()
            .any(|d| d.load(Ordering::Acquire));
        let look = Duration::from_micros(self.polling.look_us.load(Ordering::Relaxed));
        any.then(|| look.max(self.first_look()))
    }

    /// The progress thread, after each wake-up: arm the queues again once no caller polled
    /// for a budget; while callers still poll, look again after twice as long as the last
    /// time (up to [`LOOK_MAX`], or the budget if longer).
    pub(super) fn rearm_if_quiet(&self, shared: &dyn Host) {
        let Some(look) = self.rearm_after() else {
            return;
        };
        if self.callers_polling() {
            let next = (look * 2).min(LOOK_MAX.max(self.first_look()));
            let us = u64::try_from(next.as_micros()).unwrap_or(u64::MAX);
            self.polling.look_us.store(us, Ordering::Relaxed);
        } else {
            self.rearm(shared);
        }
    }

    /// Arm every disarmed queue, then poll it (what completed before the arm raises no
    /// event). The next time callers poll, the progress thread looks after one budget again.
    fn rearm(&self, shared: &dyn Host) {
        self.polling.look_us.store(0, Ordering::Relaxed);
        for (rail, r) in self.rails.iter().enumerate() {
            if !self.polling.disarmed[rail].swap(false, Ordering::AcqRel) {
                continue;
            }
            if let Err(err) = r.cq.arm() {
                tracing::error!(rail = %r.name, error = %err,
                    "kvrail: arming the completion queue failed");
            }
            self.drain(shared, rail, Poller::Rearming);
        }
    }

    /// Poll rail `rail`'s completion queue until it is empty and dispatch what it held:
    /// how many completions. A caller gets 0 when someone else is polling it.
    pub(super) fn drain(&self, shared: &dyn Host, rail: usize, by: Poller) -> usize {
        use std::sync::TryLockError::{Poisoned, WouldBlock};
        let buf = &self.polling.bufs[rail];
        let mut cs = match buf.try_lock() {
            Ok(cs) => cs,
            Err(Poisoned(p)) => p.into_inner(),
            Err(WouldBlock) if by != Poller::Caller => lock(buf),
            Err(WouldBlock) => return 0,
        };
        cs.clear();
        if let Err(err) = self.rails[rail].cq.poll(&mut cs) {
            tracing::error!(rail = %self.rails[rail].name, error = %err,
                "kvrail: polling the completion queue failed");
            return 0;
        }
        if cs.is_empty() {
            return 0;
        }
        let mut e = lock(&self.engine);
        for c in cs.iter() {
            self.on_completion(shared, &mut e, rail, c);
        }
        if let Some(s) = self.stats.get() {
            s.completions[usize::from(by == Poller::Caller)].add(cs.len() as u64);
        }
        cs.len()
    }
}

/// A caller of the lanes polling (or posting in place, to poll after) while this lives:
/// the progress thread stops arming the completion queues meanwhile.
pub(super) struct Polling<'a> {
    lanes: &'a Verbs,
    host: &'a dyn Host,
}

impl<'a> Polling<'a> {
    pub(super) fn start(lanes: &'a Verbs, host: &'a dyn Host) -> Self {
        lanes.start_polling();
        Self { lanes, host }
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        self.lanes.stop_polling(self.host, false, None);
    }
}
