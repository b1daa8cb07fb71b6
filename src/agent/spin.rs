//! Adaptive progress on the waiting thread (`AgentConfig::progress_spin_us`).
//!
//! On TCP a waiting caller drives the peers' first connections itself through the budget
//! (`control::driven`): it sends what is queued and reads the answers that are there,
//! while the connections' writer and reader threads sleep (until one budget after the last
//! pass, or at once when the caller goes to sleep). What follows is the verbs backend.
//!
//! A thread that waits — [`Agent::wait`](super::Agent::wait),
//! [`Agent::wait_notifs`](super::Agent::wait_notifs) — first polls the completion queues
//! itself for up to the budget (each completion it finds restarts it), dispatching what it
//! finds in place, and sleeps only when the budget runs out: no wake-up of the progress
//! thread and then of the caller between a completion and the caller seeing it, and a
//! transfer posted right after is posted by this thread too (as perftest's one thread posts
//! and polls). [`Agent::status`](super::Agent::status) polls once. With the budget 0 (the
//! default) nobody polls: the progress thread sleeps on the completion channels and wakes
//! the waiters. An idle agent never spins either way: only a waiting caller does, bounded.
//!
//! Why the waiter and not the progress thread: on the lab's Soft-RoCE, whose packet work is
//! CPU work in the kernel, a spinning progress thread took CPU from it (64 KiB READ, 32 in
//! flight: 62 MB/s sleeping, 58 with 1 ms of progress-thread polling, 35 with 20 ms), while
//! the caller polling made the posting thread carry rxe's packet work inline, as perftest's
//! does (in `perf`, the work moved from `ksoftirqd` into the posting thread).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::control::driven::{Driven, Pass};
use super::{error::AgentError, xfer::XferId, xfer::XferStatus, Shared};

/// On TCP a waiting caller looks for answers of at most this many bytes before sleeping
/// (see [`Shared::spin_budget`]).
const TCP_SPIN_MAX: u64 = 16 << 10;

/// A caller polling (see `verbs::polling`) — or posting in place, to poll after — while
/// this lives: the progress thread stops arming the completion queues meanwhile;
/// `sleeping` once the budget ran out.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) struct Polling<'a> {
    shared: &'a Shared,
    sleeping: bool,
    /// The latest clock reading of the polling caller, if it has one: the time it stopped
    /// (a reading of the clock less: ~120 ns in the lab).
    seen: Option<Instant>,
}

impl<'a> Polling<'a> {
    pub(crate) fn start(shared: &'a Shared) -> Self {
        #[cfg(feature = "verbs")]
        if let Some(v) = &shared.verbs {
            v.start_polling();
        }
        Self {
            shared,
            sleeping: false,
            seen: None,
        }
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.stop_polling(self.shared, self.sleeping, self.seen);
            return;
        }
        if self.sleeping {
            self.shared.release_driven();
        }
    }
}

impl Shared {
    /// The polling budget of a caller waiting for an answer of `bytes()` bytes (`None`: a
    /// notification, small; asked on TCP only); zero when it sleeps at once.
    ///
    /// On TCP the caller drives the connections for a small answer (see the module): 4 KiB
    /// WRITEs, 32 in flight, host loopback, five interleaved rounds, medians: 188k
    /// transfers/s when it only looked for answers the threads delivered, 230k sleeping at
    /// once, 271k driving, 298k with `status` driving only for transfers in progress (five
    /// more rounds, against 257k). For a large one the looking thread takes a CPU the copies need
    /// (64 KiB to 8 MiB, 8 in flight: 0.6-0.8 of the bandwidth on two cores), so it sleeps
    /// at once.
    pub(crate) fn spin_budget(&self, bytes: impl FnOnce() -> Option<u64>) -> Duration {
        let budget = Duration::from_micros(self.config.progress_spin_us.into());
        if budget.is_zero() || self.polls_queues() || bytes().is_none_or(|b| b <= TCP_SPIN_MAX) {
            budget
        } else {
            Duration::ZERO
        }
    }

    /// Whether a waiting caller has completion queues to poll (verbs).
    fn polls_queues(&self) -> bool {
        #[cfg(feature = "verbs")]
        if self.verbs.is_some() {
            return true;
        }
        false
    }

    /// Poll every completion queue once from this thread and dispatch what was there (verbs
    /// with a polling budget), or drive the peers' TCP connections once (TCP with a budget:
    /// `control::driven`; a [`Pass::Look`] reads a socket only if nobody did just before);
    /// nothing otherwise. Returns how many completions or answers.
    pub(crate) fn poll_once(&self, pass: Pass) -> usize {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            if !v.spin().is_zero() {
                return v.poll_once(self);
            }
            return 0;
        }
        let budget = Duration::from_micros(self.config.progress_spin_us.into());
        if budget.is_zero() {
            return 0;
        }
        let driven = self.driven.read().unwrap_or_else(|p| p.into_inner());
        driven.iter().map(|d| d.drive(self, budget, pass)).sum()
    }

    /// [`Agent::status`](super::Agent::status)'s look with a budget: on verbs, poll the
    /// completion queues once; on TCP, drive the connections once for a small transfer
    /// still in progress (as a waiting caller would: [`Shared::spin_budget`]; one that
    /// ended needs no look), reading the socket only if nobody did within
    /// `driven::LOOK_GAP`: a loop asking about every transfer in flight made a receive call
    /// for each, ~1.2 a transfer with kvrail-perf's loop (4 KiB x 32, `perf stat`), 0.31
    /// with the gap, and seven interleaved rounds went from 255k to 344k transfers/s
    /// (medians; the README's "Looks that find nothing new").
    pub(crate) fn poll_for_status(&self, id: XferId) {
        let mut in_progress = true;
        let budget = self.spin_budget(|| {
            let xfers = crate::threads::lock(&self.xfers);
            in_progress = xfers.status(id).is_ok_and(|s| *s == XferStatus::InProgress);
            xfers.bytes(id)
        });
        // (on verbs `spin_budget` asks nothing: the queues are polled either way)
        if !budget.is_zero() && in_progress {
            self.poll_once(Pass::Look);
        }
    }

    /// A caller stops driving the TCP connections (it sleeps next): their threads resume.
    fn release_driven(&self) {
        if self.config.progress_spin_us == 0 || self.polls_queues() {
            return; // nothing is driven
        }
        let driven = self.driven.read().unwrap_or_else(|p| p.into_inner());
        for d in driven.iter() {
            d.release();
        }
    }

    /// Waiting callers may drive `d` (a peer's first TCP connection) from now on.
    pub(crate) fn drive_tcp_conn(&self, d: &Arc<Driven>) {
        let mut driven = self.driven.write().unwrap_or_else(|p| p.into_inner());
        driven.push(d.clone());
    }

    /// `d` ended: nobody drives it any more.
    pub(crate) fn undrive_tcp_conn(&self, d: &Arc<Driven>) {
        let mut driven = self.driven.write().unwrap_or_else(|p| p.into_inner());
        driven.retain(|x| !Arc::ptr_eq(x, d));
    }

    /// Poll the completion queues until `ready` gives a value, `deadline` passes, or the
    /// budget runs out without a completion; `Ok(None)` then (the caller sleeps instead).
    /// `start` is the caller's reading of the clock as it began to wait (its deadline's).
    ///
    /// The clock is read after a poll that found nothing (and after every
    /// [`LOOKS_BETWEEN_READINGS`]th poll), not at every pass: a reading is ~120 ns in the lab
    /// (an uncontended lock ~25), and a wait answered by its first poll read it four times
    /// (callgrind of a notification ping-pong); it now reads it once, the caller's `start`,
    /// which is also the time it stopped polling unless a later reading was taken.
    pub(crate) fn spin_until<T>(
        &self,
        budget: Duration,
        start: Instant,
        deadline: Instant,
        mut ready: impl FnMut() -> Result<Option<T>, AgentError>,
    ) -> Result<Option<T>, AgentError> {
        if budget.is_zero() {
            // the caller sleeps at once (a large answer on TCP): the connections' threads
            // read it, not the next driving pass
            self.release_driven();
            return Ok(None);
        }
        let mut polling = Polling::start(self);
        polling.seen = Some(start);
        // the budget counts from `last`: the start, or the reading after the last find
        let mut last = start;
        let mut looks = Looks::default();
        loop {
            if let Some(t) = ready()? {
                return Ok(Some(t));
            }
            if looks.due() {
                let now = Instant::now();
                polling.seen = Some(now);
                if looks.restarts() {
                    last = now;
                }
                if now >= deadline || now.duration_since(last) >= budget {
                    polling.sleeping = true; // the caller sleeps next (or gives up)
                    return Ok(None);
                }
            }
            let found = self.poll_once(Pass::Wait) > 0;
            looks.polled(found);
            if !found {
                std::hint::spin_loop();
            }
        }
    }
}

/// A waiting caller reads the clock at least every this many polls, finding or not (for
/// its deadline while completions keep coming).
const LOOKS_BETWEEN_READINGS: u32 = 16;

/// When a polling caller reads the clock (see [`Shared::spin_until`]): before a pass that
/// follows a poll that found nothing, and before every [`LOOKS_BETWEEN_READINGS`]th pass.
#[derive(Default)]
struct Looks {
    pass: u32,
    /// The last poll found nothing.
    empty: bool,
    /// A poll found something since the last reading: the budget restarts at the next one.
    restart: bool,
}

impl Looks {
    /// A new pass begins: whether to read the clock before its poll.
    fn due(&mut self) -> bool {
        self.pass = self.pass.wrapping_add(1);
        self.empty || self.pass.is_multiple_of(LOOKS_BETWEEN_READINGS)
    }

    /// The pass's poll found something, or not.
    fn polled(&mut self, found: bool) {
        self.restart |= found;
        self.empty = !found;
    }

    /// Whether the reading being taken restarts the budget (taken once).
    fn restarts(&mut self) -> bool {
        std::mem::take(&mut self.restart)
    }
}

#[cfg(test)]
mod tests {
    use super::{Looks, LOOKS_BETWEEN_READINGS};

    /// Which of `passes` passes read the clock, each poll finding as `finds` says.
    fn readings(passes: u32, finds: impl Fn(u32) -> bool) -> Vec<(u32, bool)> {
        let mut l = Looks::default();
        let mut read = Vec::new();
        for p in 1..=passes {
            if l.due() {
                read.push((p, l.restarts()));
            }
            l.polled(finds(p));
        }
        read
    }

    #[test]
    fn the_clock_is_read_after_each_empty_poll_only() {
        // an answer found by the first poll: no reading at all before it
        assert!(readings(1, |_| true).is_empty());
        // nothing found: every pass after the first reads it, and the budget never restarts
        let r = readings(40, |_| false);
        assert_eq!(r.len(), 39);
        assert!(r.iter().all(|&(p, restart)| p >= 2 && !restart));
        // a find, then nothing: the pass after the find polls at once; the reading after the
        // next (empty) poll restarts the budget, the later ones do not
        let r = readings(5, |p| p == 1);
        assert_eq!(r, vec![(3, true), (4, false), (5, false)]);
    }

    /// Polls that keep finding work (other transfers completing) still look at the clock
    /// every few passes: the deadline is seen, and each look restarts the budget.
    #[test]
    fn polls_that_keep_finding_still_read_the_clock() {
        let n = LOOKS_BETWEEN_READINGS;
        let r = readings(10 * n, |_| true);
        assert_eq!(r.len(), 10);
        assert!(
            r.iter().all(|&(p, restart)| p.is_multiple_of(n) && restart),
            "{r:?}"
        );
    }
}
