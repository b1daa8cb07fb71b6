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
use super::{AgentError, Shared, XferId, XferStatus};

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
            let xfers = super::lock(&self.xfers);
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
    pub(crate) fn spin_until<T>(
        &self,
        budget: Duration,
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
            if self.poll_once(Pass::Wait) > 0 {
                last = now;
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
