//! A condition variable that makes no wake-up system call when nobody sleeps on it: every
//! finished transfer and every delivered notification notifies, and with callers that poll
//! (`agent::spin`) nobody sleeps — a futex wake per message was a system call on each hop of
//! a notification round trip.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, MutexGuard};
use std::time::Duration;

/// See the module.
#[derive(Default)]
pub(crate) struct Wake {
    cv: Condvar,
    sleepers: AtomicUsize,
}

impl Wake {
    /// Sleep until notified or `timeout` passed. `guard` holds the mutex of the condition:
    /// the sleeper is counted before the mutex is released, so a notifier that changed the
    /// condition under that mutex afterwards sees it.
    pub(crate) fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> MutexGuard<'a, T> {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let g = self
            .cv
            .wait_timeout(guard, timeout)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// Wake every sleeper, after the condition changed under its mutex.
    pub(crate) fn notify_all(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::Wake;

    /// A sleeper is woken by every change made after it checked, never left to its timeout.
    #[test]
    fn no_wake_up_is_lost() {
        let state = Arc::new((Mutex::new(0u64), Wake::default()));
        let waiter = {
            let state = state.clone();
            std::thread::spawn(move || {
                let mut seen = 0;
                while seen < 2000 {
                    let mut g = state.0.lock().unwrap();
                    while *g == seen {
                        let t = Instant::now();
                        g = state.1.wait_timeout(g, Duration::from_secs(2));
                        if t.elapsed() >= Duration::from_secs(2) {
                            return Err(format!("slept out its timeout at {seen}"));
                        }
                    }
                    seen = *g;
                }
                Ok(())
            })
        };
        for _ in 0..2000 {
            *state.0.lock().unwrap() += 1;
            state.1.notify_all();
            std::thread::yield_now();
        }
        waiter.join().unwrap().unwrap();
    }
}
