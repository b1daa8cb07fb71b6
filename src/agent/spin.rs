//! Adaptive progress on the waiting thread (`AgentConfig::progress_spin_us`).
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

/// A caller polling (see `verbs::polling`): the progress thread stops arming the
/// completion queues meanwhile; `sleeping` once the budget ran out.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
struct Polling<'a> {
    shared: &'a Shared,
    sleeping: bool,
}

impl<'a> Polling<'a> {
    fn start(shared: &'a Shared) -> Self {
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
    /// The polling budget of a waiting caller; zero when the agent sleeps at once.
    pub(crate) fn spin_budget(&self) -> Duration {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            return v.spin();
        }
        Duration::ZERO
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
        deadline: Instant,
        mut ready: impl FnMut() -> Result<Option<T>, AgentError>,
    ) -> Result<Option<T>, AgentError> {
        let budget = self.spin_budget();
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
