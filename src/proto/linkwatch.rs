//! `link_down_exit_s` (SPEC §2): an instance that has lost all its local links exits after
//! that many seconds, so a deployment can replace it. Only a producer sets it: a decode
//! instance is replaced from outside while it keeps its requests.
//!
//! The clock starts when the last link goes down and stops when any link comes back; the
//! exit fires once, `exit_after` after the clock started. With no links to watch it never
//! fires (there is nothing to lose).

use std::time::{Duration, Instant};

/// The link-loss clock.
#[derive(Debug, Clone)]
pub struct LinkWatch {
    exit_after: Duration,
    down_since: Option<Instant>,
    fired: bool,
    exit: bool,
}

impl LinkWatch {
    /// Exit once every link has been down for `exit_after`.
    pub fn new(exit_after: Duration) -> Self {
        Self {
            exit_after,
            down_since: None,
            fired: false,
            exit: false,
        }
    }

    /// What the links are at `now`: `up` of `total` are up.
    pub fn handle_links(&mut self, up: usize, total: usize, now: Instant) {
        if total == 0 || up > 0 {
            self.down_since = None;
        } else {
            self.down_since.get_or_insert(now);
        }
        self.handle_timeout(now);
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if let Some(t) = self.poll_timeout() {
            if now >= t {
                self.fired = true;
                self.exit = true;
            }
        }
    }

    /// When the exit fires if no link comes back (None: links are up, or it fired).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.fired {
            return None;
        }
        self.down_since.map(|t| t + self.exit_after)
    }

    /// Since when every link has been down.
    pub fn down_since(&self) -> Option<Instant> {
        self.down_since
    }

    /// True once, when the instance must exit.
    pub fn poll_exit(&mut self) -> bool {
        std::mem::take(&mut self.exit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_once_when_every_link_stayed_down_for_the_whole_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = LinkWatch::new(s(10));
        w.handle_links(2, 2, t0);
        assert_eq!(w.poll_timeout(), None);
        // one of two down: not lost
        w.handle_links(1, 2, t0 + s(1));
        assert_eq!(w.poll_timeout(), None);
        // both down at 2 s
        w.handle_links(0, 2, t0 + s(2));
        assert_eq!(w.poll_timeout(), Some(t0 + s(12)));
        w.handle_links(0, 2, t0 + s(11));
        assert!(!w.poll_exit(), "9 s down: not yet");
        // one comes back at 11.5 s: the clock stops
        w.handle_links(1, 2, t0 + s(11) + Duration::from_millis(500));
        w.handle_timeout(t0 + s(13));
        assert!(!w.poll_exit());
        // down again at 20 s: a fresh 10 s
        w.handle_links(0, 2, t0 + s(20));
        w.handle_timeout(t0 + s(30) - Duration::from_millis(1));
        assert!(!w.poll_exit());
        w.handle_timeout(t0 + s(30));
        assert!(w.poll_exit(), "exactly 10 s after every link went down");
        assert!(!w.poll_exit(), "once");
        w.handle_links(0, 2, t0 + s(60));
        assert!(!w.poll_exit(), "never again");
        assert_eq!(w.poll_timeout(), None);
    }

    #[test]
    fn nothing_to_watch_never_exits() {
        let t0 = Instant::now();
        let mut w = LinkWatch::new(Duration::from_secs(1));
        w.handle_links(0, 0, t0);
        w.handle_timeout(t0 + Duration::from_secs(100));
        assert!(!w.poll_exit());
    }
}
