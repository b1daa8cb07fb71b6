//! Notifications routed to their consumer by kind: a consumer that owns one kind of message
//! (the push writer's `PUSH_REG:`) takes a `NotifRoute` for its prefix, and messages with
//! that prefix go to it alone; the rest go to the engine's queue
//! (`Agent::get_new_notifs`). The host bounce's messages never reach either.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wake::Wake;
use crate::threads::lock;

/// The queue of one kind of notification (see the module docs).
pub(crate) struct RouteQueue {
    pub(crate) prefix: Vec<u8>,
    pub(crate) q: Mutex<VecDeque<(String, Vec<u8>)>>,
    pub(crate) cv: Wake,
}

/// Everything in `q`, sleeping on `cv` until something is there or `timeout` passed.
pub(crate) fn drain_waiting<T>(q: &Mutex<VecDeque<T>>, cv: &Wake, timeout: Duration) -> Vec<T> {
    let deadline = Instant::now() + timeout;
    let mut q = lock(q);
    while q.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        q = cv.wait_timeout(q, left);
    }
    q.drain(..).collect()
}

/// Wait until `q` holds something or `timeout` passed; take nothing. True when it does.
pub(crate) fn wait_nonempty<T>(q: &Mutex<VecDeque<T>>, cv: &Wake, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut q = lock(q);
    while q.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        q = cv.wait_timeout(q, left);
    }
    true
}
