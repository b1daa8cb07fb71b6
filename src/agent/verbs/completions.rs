//! Completions on verbs: a slice done or failed, a transfer completed, the progress thread's loop and its port checks.

use super::*;

impl Verbs {
    pub(super) fn on_completion(
        &self,
        shared: &dyn Host,
        e: &mut Engine,
        rail: usize,
        c: &Completion,
    ) {
        if let Some(k) = e.chan_qpn.get(&(rail, c.qpn)).cloned() {
            self.on_chan_completion(shared, e, &k, c);
            return;
        }
        let Some(key) = e.qpn.get(&(rail, c.qpn)).cloned() else {
            return;
        };
        if e.pairs.get(&key).is_some_and(|q| q.dead.is_some()) {
            return; // flushes of a queue pair that already failed
        }
        if let Err(err) = &c.status {
            let why = format!("{} on {}", err, self.rails[rail].name);
            // A request fault would fail on any rail: the transfers fail. A path fault moves
            // the work to other rails (see WcError::is_request_fault).
            if err.is_request_fault() {
                let why = if err.is_remote_access() {
                    format!(
                        "{why}: the peer's NIC refused the key (it deregistered the region, \
                         revoked the grant, or does not allow this access)"
                    )
                } else {
                    why
                };
                self.kill_pair_as(shared, e, &key, &why, err.is_remote_access());
            } else {
                self.fail_over(shared, e, &key, &why);
            }
            return;
        }
        if !e.retry.is_empty() {
            e.retry.remove(&key); // this pair works: a later failure starts a fresh backoff
        }
        let (xfer, n) = (c.wr_id >> 16, (c.wr_id & 0xffff) as usize);
        if let Some(q) = e.pairs.get_mut(&key) {
            q.in_flight = q.in_flight.saturating_sub(n);
        }
        let mut done = false;
        if let Some(run) = e.runs.get_mut(&xfer) {
            let b = run.progress.complete(rail, n);
            if let Some(p) = e.planner.as_mut() {
                p.release(rail, b);
            }
            if e.done_bytes.len() <= rail {
                e.done_bytes.resize(rail + 1, 0);
            }
            e.done_bytes[rail] += b;
            if let Some(s) = self.stats.get() {
                s.bytes[rail][crate::agent::stats::op_index(run.op)].add(b);
            }
            done = run.progress.state() == XferState::Done;
        }
        if done {
            e.runs.remove(&xfer);
            self.completed(shared, e, xfer);
        }
        self.pump(e, &key);
    }

    /// Transfer `id` is complete (every slice in place; its run removed): done, then its
    /// notification. The notification is taken before the transfer is marked done (an
    /// engine that releases a done transfer at once must not lose it), and the transfer is
    /// marked done before the notification goes out: a peer that exits on it closes its
    /// connection, whose end fails the peer's transfers still in progress — this one too,
    /// bytes all landed, when that came first (the lab's two-process test, once in a CI run).
    /// What needs the notification queued — a later post or notification to the peer, a
    /// dropping agent's flush — takes the engine lock, held here, first.
    pub(super) fn completed(&self, shared: &dyn Host, e: &mut Engine, id: u64) {
        let notif = shared.xfer_notif(id);
        shared.finish(id, Ok(()));
        if let Some((peer, n)) = notif {
            self.notify_locked(shared, e, &peer, n);
        }
    }

    /// The progress thread: sleep on the rails' completion channels; dispatch completions.
    pub(crate) fn run(self: &Arc<Self>, shared: Arc<dyn Host>) -> Result<(), AgentError> {
        let mut poll = lock(&self.poll)
            .take()
            .ok_or_else(|| verr("progress thread already started"))?;
        self.spawn_posters(&shared)?;
        let me = self.clone();
        crate::threads::spawn(format!("kvrail-progress-{}", shared.name), move || {
            let _span = tracing::info_span!("agent", name = %shared.name).entered();
            let mut events = Events::with_capacity(16);
            let mut checked = std::time::Instant::now();
            loop {
                // While transfers are in flight, look at the ports every 200 ms (not at
                // every wake-up: that was two port queries per completion event): a
                // port that went DOWN is retired and its work moved, without waiting
                // for the transport's retries to run out.
                // A dead pair is looked at too, to be rebuilt when its port is back.
                // The engine lock busy means work is under way: watch then, rather than
                // wait for it (the port look never queues behind a caller that posts or
                // dispatches, nor makes that caller wake this thread).
                let watch = match me.engine.try_lock() {
                    Ok(e) => e.needs_watching(),
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().needs_watching(),
                    Err(std::sync::TryLockError::WouldBlock) => true,
                };
                let mut timeout = watch.then(|| PORT_CHECK.saturating_sub(checked.elapsed()));
                if let Some(t) = me.rearm_after() {
                    timeout = Some(timeout.map_or(t, |w| w.min(t)));
                }
                if let Err(e) = poll.poll(&mut events, timeout) {
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    tracing::error!(error = %e, "kvrail progress thread: poll failed");
                    return;
                }
                if shared.stopping() {
                    return;
                }
                if watch && checked.elapsed() >= PORT_CHECK {
                    me.check_ports(&*shared);
                    checked = std::time::Instant::now();
                }
                for ev in events.iter() {
                    let Token(rail) = ev.token();
                    if rail < me.rails.len() {
                        me.on_cq_event(&*shared, rail);
                    }
                }
                me.rearm_if_quiet(&*shared);
            }
        })
        .map_err(verr)?;
        Ok(())
    }

    /// Retire every live queue pair on a rail whose port is no longer ACTIVE; start
    /// rebuilding dead pairs on rails whose port is.
    pub(super) fn check_ports(&self, shared: &dyn Host) {
        let mut active = Vec::new();
        for (rail, r) in self.rails.iter().enumerate() {
            let state = match r.ctx.query_port(r.port) {
                Ok(a) if a.state == crate::transport::verbs::PortState::Active => {
                    active.push(rail);
                    continue;
                }
                Ok(a) => a.state.to_string(),
                Err(err) => err.to_string(),
            };
            let mut e = lock(&self.engine);
            let keys: Vec<PairKey> = e
                .pairs
                .iter()
                .filter(|(k, q)| k.1 == rail && q.dead.is_none())
                .map(|(k, _)| k.clone())
                .collect();
            let why = format!("port {} is {state}", r.name);
            for k in keys {
                self.fail_over(shared, &mut e, &k, &why);
            }
            self.fail_chans_on(shared, &mut e, rail, &why);
        }
        for (peer, req) in self.start_rebuilds(&active) {
            shared.request_qps(&peer, req);
        }
        for (peer, rail, ep) in self.start_chan_rebuilds(&active) {
            shared.request_chan(&peer, rail, ep);
        }
    }

    /// Wake the progress thread (to see the shutdown flag) and stop the posters.
    pub(crate) fn wake(&self) {
        let _ = self.waker.wake();
        self.stop_posters();
    }
}
