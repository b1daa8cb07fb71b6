//! Notifications routed to their consumer by kind: a consumer that owns one kind of message
//! (the push writer's `PUSH_REG:`) takes a [`NotifRoute`] for its prefix, and messages with
//! that prefix go to it alone; the rest go to the engine's queue
//! ([`Agent::get_new_notifs`]). The host bounce's messages never reach either.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::wake::Wake;
use super::Agent;
use crate::threads::lock;

/// The queue of one kind of notification (see the module docs).
pub(crate) struct RouteQueue {
    prefix: Vec<u8>,
    q: Mutex<VecDeque<(String, Vec<u8>)>>,
    cv: Wake,
}

/// A consumer's handle on the notifications that start with its prefix. Dropping it sends
/// them to the engine's queue again.
pub struct NotifRoute {
    agent: Agent,
    queue: Arc<RouteQueue>,
}

impl std::fmt::Debug for NotifRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifRoute")
            .field("prefix", &String::from_utf8_lossy(&self.queue.prefix))
            .finish()
    }
}

impl NotifRoute {
    /// The routed notifications received since the last call, in arrival order.
    pub fn get_new(&self) -> Vec<(String, Vec<u8>)> {
        lock(&self.queue.q).drain(..).collect()
    }

    /// Like [`NotifRoute::get_new`], sleeping until one is there or `timeout` passed.
    pub fn wait(&self, timeout: Duration) -> Vec<(String, Vec<u8>)> {
        drain_waiting(&self.queue.q, &self.queue.cv, timeout)
    }
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

impl Drop for NotifRoute {
    fn drop(&mut self) {
        lock(&self.agent.shared.routes).retain(|r| !Arc::ptr_eq(r, &self.queue));
    }
}

impl Agent {
    /// Route every notification that starts with `prefix` to the returned handle instead of
    /// the engine's queue (one consumer per kind; a later route for the same prefix takes
    /// over).
    pub fn notif_route(&self, prefix: &[u8]) -> NotifRoute {
        let queue = Arc::new(RouteQueue {
            prefix: prefix.to_vec(),
            q: Mutex::new(VecDeque::new()),
            cv: Wake::default(),
        });
        let mut routes = lock(&self.shared.routes);
        routes.retain(|r| r.prefix != prefix);
        routes.push(queue.clone());
        NotifRoute {
            agent: self.clone(),
            queue,
        }
    }
}

impl super::Shared {
    /// Give `bytes` to the route of its kind; `Err` hands them back when none takes them.
    pub(crate) fn route_notif(&self, from: &str, bytes: Vec<u8>) -> Result<(), Vec<u8>> {
        let routes = lock(&self.routes);
        match routes.iter().find(|r| bytes.starts_with(&r.prefix)) {
            Some(r) => {
                lock(&r.q).push_back((from.to_owned(), bytes));
                r.cv.notify_all();
                Ok(())
            }
            None => Err(bytes),
        }
    }
}
