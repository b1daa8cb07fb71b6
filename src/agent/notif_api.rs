//! Notifications: send one, take those that arrived, wait for them; the rail they ride.

use std::time::Duration;

use super::route::{drain_waiting, RouteQueue};
use super::wake::Wake;
use super::*;

impl Agent {
    /// Send a notification to a peer; peers receive them in the order they were sent.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvrail::agent::{Agent, AgentConfig};
    /// let cfg = || AgentConfig { listen: "127.0.0.1:0".parse().unwrap(), ..AgentConfig::default() };
    /// let (p, d) = (Agent::new("prefill-0", cfg())?, Agent::new("decode-0", cfg())?);
    /// let peer = d.load_remote(p.side_channel_addr())?;
    /// d.send_notif(&peer, b"req-7:1".to_vec())?;
    /// d.send_notif(&peer, b"req-8:1".to_vec())?;
    /// let mut got = Vec::new();
    /// while got.len() < 2 && p.wait_for_notifs(Duration::from_secs(10)) {
    ///     got.extend(p.get_new_notifs());
    /// }
    /// assert_eq!(got, [("decode-0".to_string(), b"req-7:1".to_vec()), ("decode-0".to_string(), b"req-8:1".to_vec())]);
    /// # Ok::<(), kvrail::agent::AgentError>(())
    /// ```
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], [`AgentError::NotifTooLarge`].
    pub fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), AgentError> {
        check_notif_len(Some(&bytes))?;
        // A peer with a verbs channel is known: sent there without a look in the peer table.
        #[cfg(feature = "verbs")]
        let bytes = match &self.shared.verbs {
            Some(v) => match v.notify_on_chan(&*self.shared, peer, bytes) {
                Ok(()) => {
                    self.shared.stats.notifs_sent.inc();
                    return Ok(());
                }
                Err(bytes) => bytes,
            },
            None => bytes,
        };
        if !lock(&self.shared.peers).contains_key(peer) {
            return Err(AgentError::UnknownPeer(peer.into()));
        }
        self.shared.stats.notifs_sent.inc();
        // Lock order: the verbs engine is taken without `peers` held.
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.notify(&*self.shared, peer, bytes);
            return Ok(());
        }
        self.shared.send_tcp_notif(peer, None, bytes);
        Ok(())
    }

    /// Notifications received since the last call, in arrival order (per peer: send order).
    /// With [`AgentConfig::progress_spin_us`] it polls the completion queues once first, as
    /// [`Agent::status`] does: a NIXL-style loop that only reads notifications drives their
    /// arrival itself instead of waiting for the progress thread.
    pub fn get_new_notifs(&self) -> Vec<(String, Vec<u8>)> {
        self.shared.poll_once(control::driven::Pass::Look);
        lock(&self.shared.notifs).drain(..).collect()
    }

    /// Like [`Agent::get_new_notifs`], but sleeps until at least one notification is there
    /// or `timeout` passed (then the list is empty). With
    /// [`AgentConfig::progress_spin_us`] it polls the completion queues itself first (on
    /// TCP it looks for the notifications before sleeping).
    pub fn wait_notifs(&self, timeout: std::time::Duration) -> Vec<(String, Vec<u8>)> {
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        let budget = self.shared.spin_budget(|| None);
        let polled = self.shared.spin_until(budget, start, deadline, || {
            let mut q = lock(&self.shared.notifs);
            Ok((!q.is_empty()).then(|| q.drain(..).collect()))
        });
        if let Ok(Some(got)) = polled {
            self.shared.stats.waits[0].inc();
            return got;
        }
        self.shared.stats.waits[1].inc();
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        route::drain_waiting(&self.shared.notifs, &self.shared.notif_cv, left)
    }

    /// Sleep until a notification is queued for [`Agent::get_new_notifs`] (true) or
    /// `timeout` passed (false); takes none. For a thread that serves notifications under a
    /// lock of its own: it takes that lock, then the notifications, so that they are handled
    /// in arrival order whoever takes them.
    pub fn wait_for_notifs(&self, timeout: std::time::Duration) -> bool {
        route::wait_nonempty(&self.shared.notifs, &self.shared.notif_cv, timeout)
    }

    /// The rail that carries notifications to `peer` (verbs backend, on a SEND/RECV channel
    /// of its own); `None` when they go over the TCP connection (TCP backend, or after that
    /// channel failed).
    pub fn notif_rail(&self, peer: &str) -> Option<String> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.notif_rail(peer);
        }
        let _ = peer;
        None
    }

    /// Fault injection, for tests (not part of the API): `frame` as it is on the verbs
    /// notification channel to `peer`, as a broken or foreign peer would send it.
    ///
    /// # Errors
    /// [`AgentError::Unsupported`]: no live channel to `peer`, or it has no room now.
    #[doc(hidden)]
    pub fn inject_notif_frame(&self, peer: &str, frame: &[u8]) -> Result<(), AgentError> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.inject_frame(peer, frame).map_err(AgentError::Unsupported);
        }
        let _ = (peer, frame);
        Err(AgentError::Unsupported("no verbs backend".into()))
    }
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
