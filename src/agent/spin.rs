//! Adaptive progress on the waiting thread (`AgentConfig::progress_spin_us`).
//!
//! On TCP there is no completion queue: a waiting caller looks for its answer (which the
//! connection's reader thread delivers) through the budget before it sleeps, which saves
//! the sleep and the wake-up per answer; what follows is the verbs backend.
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

use std::time::{Duration, Instant};

use super::{AgentError, Shared};

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
        }
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.stop_polling(self.shared, self.sleeping);
        }
    }
}

impl Shared {
    /// The polling budget of a caller waiting for an answer of `bytes()` bytes (`None`: a
    /// notification, small; asked on TCP only); zero when it sleeps at once.
    ///
    /// On TCP the caller has no queue to poll (the connections' reader threads deliver),
    /// but looking for a small answer through the budget before sleeping saves a sleep and
    /// a wake-up per answer (4 KiB WRITEs, 32 in flight, host loopback, five interleaved
    /// rounds: 205-235k transfers/s sleeping at once, 264-307k looking). For a large one
    /// the looking thread takes a CPU the copies need (64 KiB to 8 MiB, 8 in flight:
    /// 0.6-0.8 of the bandwidth on two cores), so it sleeps at once.
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
    /// with a polling budget; nothing otherwise): how many completions.
    pub(crate) fn poll_once(&self) -> usize {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            if !v.spin().is_zero() {
                return v.poll_once(self);
            }
        }
        0
    }

    /// Poll the completion queues until `ready` gives a value, `deadline` passes, or the
    /// budget runs out without a completion; `Ok(None)` then (the caller sleeps instead).
    pub(crate) fn spin_until<T>(
        &self,
        budget: Duration,
        deadline: Instant,
        mut ready: impl FnMut() -> Result<Option<T>, AgentError>,
    ) -> Result<Option<T>, AgentError> {
        if budget.is_zero() {
            return Ok(None);
        }
        let mut polling = Polling::start(self);
        let mut last = Instant::now();
        loop {
            if let Some(t) = ready()? {
                return Ok(Some(t));
            }
            let now = Instant::now();
            if now >= deadline || now.duration_since(last) >= budget {
                polling.sleeping = true; // the caller sleeps next (or gives up)
                return Ok(None);
            }
            if self.poll_once() > 0 {
                last = now;
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
