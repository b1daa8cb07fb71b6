//! Serving peers between engine steps: the messages peers send (grant questions, completions, heartbeats, withdrawals) and the work they start.

use super::*;

impl Worker {
    /// Start what waited for a handshake: grant questions, READs, heartbeats and answers.
    pub(super) fn pump(&mut self, now: Instant) {
        while let Ok((peer, r)) = self.handshakes.1.try_recv() {
            let conn = match r {
                Ok(()) => Conn::Up,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "handshake failed");
                    Conn::Failed(e)
                }
            };
            self.conns.insert(peer, conn);
        }
        // heartbeats whose P rank is up go now; a failed rank's are dropped
        let hbs = std::mem::take(&mut self.deferred);
        for (peer, msg) in hbs {
            match self.conns.get(&peer) {
                Some(Conn::Up) => {
                    if let Err(e) = self.agent.send_notif(&peer, msg) {
                        tracing::warn!(%peer, error = %e, "heartbeat");
                        self.conns.remove(&peer);
                    }
                }
                Some(Conn::Connecting) => self.deferred.push((peer, msg)),
                _ => {}
            }
        }
        let ids: Vec<String> = self
            .recvs
            .iter()
            .filter(|(_, r)| !r.posted)
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            let mut failed = None;
            let mut ready = true;
            for (peer, _) in &self.recvs[&id].sources {
                match self.conns.get(peer) {
                    Some(Conn::Up) => {}
                    Some(Conn::Failed(e)) => failed = Some(format!("handshake with {peer}: {e}")),
                    _ => ready = false,
                }
            }
            if let Some(e) = failed {
                self.fail_recv(&id, &e);
            } else if ready {
                match self.grants_ready(&id, now) {
                    Ok(true) => self.post_reads(&id),
                    Ok(false) => {}
                    Err(e) => self.fail_recv(&id, &e),
                }
            }
        }
        // what waited for a failed handshake has failed; the next request tries again
        // (the engine may be back)
        self.conns.retain(|_, c| !matches!(c, Conn::Failed(_)));
    }

    pub(super) fn handle_msg(&mut self, from: &str, m: &[u8], now: Instant) {
        match KvMsg::decode(m) {
            Ok(KvMsg::GrantReq(r)) => {
                let wait = Duration::from_secs(self.cfg.lease_duration_s.max(1));
                let at = (now, self.clock_us());
                if let Some((peer, host, port, msg)) = self.fence.answer(from, r, at, wait) {
                    self.connect(&peer, &host, port);
                    self.deferred.push((peer, msg));
                }
            }
            Ok(KvMsg::Grant(g)) => {
                self.granted(from, &g.request_id, Granted::Token(g.token), g.clock_us);
            }
            Ok(KvMsg::GrantNone(g)) => match self.cfg.direction {
                // an answer a READ waits for (pull, or a read-back in either mode)
                _ if self.waits_for_grant(from, &g.request_id) => {
                    self.granted(from, &g.request_id, Granted::Refused(g.reason), g.clock_us);
                }
                Direction::Pull => {}
                // push: a P rank holds no prefill for our registration, so no WRITE comes;
                // withdrawn from every rank it went to before the receive is reported failed
                Direction::Push if self.receiver.is_pending(&g.request_id) => {
                    let why = format!("{from} refused the registration: {}", g.reason);
                    tracing::warn!(request = %g.request_id, error = %why, "KV receive failed");
                    self.receiver.cancel(&g.request_id);
                    self.withdraw(&g.request_id, Withdrawn::Expired, now);
                }
                Direction::Push => {}
            },
            Ok(KvMsg::Heartbeat(ids)) => {
                self.stats.heartbeats_in.inc();
                if self.heard.insert(from) {
                    tracing::info!(
                        tp_rank = self.tp_rank,
                        d_rank = %from,
                        "heartbeats from a D rank reach this P rank: its leases renew"
                    );
                }
                self.leases.handle_heartbeat(&ids, now);
            }
            Ok(KvMsg::Completion(c)) => match self.cfg.direction {
                // pull: D's READs finished; push: P's WRITEs into us finished; either: a
                // read-back of blocks D kept finished
                Direction::Pull => {
                    self.leases.handle_completion(&c);
                }
                Direction::Push if self.leases.holds(&c.request_id) => {
                    self.leases.handle_completion(&c);
                }
                Direction::Push => self.receiver.handle_completion(&c),
            },
            // the writer's
            Ok(KvMsg::PushReg(_) | KvMsg::PushCancel(_) | KvMsg::PushCancelled(_)) => {}
            Err(e) => {
                self.malformed += 1;
                tracing::warn!(error = %e, "dropped a malformed notification");
            }
        }
    }

    /// Withdraw registration `id` from the P ranks (reported once they confirmed, or after
    /// `push_registration_timeout`); without a writer there is nothing to withdraw.
    pub(super) fn withdraw(&mut self, id: &str, how: Withdrawn, now: Instant) {
        match &self.writer {
            Some(w) => {
                w.cancel(id, true);
                let t = Duration::from_secs(self.cfg.push_registration_timeout_s);
                self.cancels.insert(id.to_owned(), (now + t, how));
            }
            None => self.withdrawn(id.to_owned(), how),
        }
    }

    /// A withdrawn registration is over on every P rank (confirmed, or past the bound).
    pub(super) fn withdrawn(&mut self, id: String, how: Withdrawn) {
        let ended = self.reported.contains(&id)
            || self.done.recving.contains(&id)
            || self.done.failed_recving.contains(&id);
        if ended {
            // its receive was reported already (the engine freed it then): once is all
            tracing::debug!(request = %id, "withdrawn after its receive ended; nothing more to report");
            return;
        }
        match how {
            Withdrawn::Aborted => self.done.sending.push(id),
            Withdrawn::Expired => self.done.failed_recving.push(id),
        }
    }

    /// Everything a step does but report: take peers' notifications (grant questions,
    /// heartbeats, completions), start what waited, look at transfers, leases and
    /// withdrawals; what finished waits for the next [`Worker::get_finished`]. An engine
    /// that idles between requests (no steps) has it called while idle — P answers a D's
    /// grant question, frees blocks on D's completion, ends leases — by its own thread
    /// (the Python package does, woken by [`Agent::wait_for_notifs`](crate::agent::Agent::wait_for_notifs)).
    pub fn serve(&mut self, now: Instant) {
        // the agent routes PUSH_REG to the writer; everything else is the worker's
        for (from, m) in self.agent.get_new_notifs() {
            self.handle_msg(&from, &m, now);
        }
        let events = self.writer.as_ref().map(|w| {
            w.wake();
            w.events()
        });
        for ev in events.into_iter().flatten() {
            match ev {
                WriterEvent::Unparsed(from, m) => self.handle_msg(&from, &m, now),
                WriterEvent::Refused => self.malformed += 1,
                WriterEvent::Cancelled(id) => {
                    if let Some((_, how)) = self.cancels.remove(&id) {
                        self.withdrawn(id, how);
                    }
                }
                WriterEvent::Pushed(id, d_tp) => {
                    self.stats.pushed.inc();
                    // a WRITE and its completion are done: P frees once every D rank that
                    // takes its heads has been written
                    self.leases.handle_completion(&Completion {
                        request_id: id,
                        tp_size: d_tp,
                    });
                }
                WriterEvent::RegistrationFailed(id, why) => {
                    tracing::warn!(request = %id, error = %why, "push registration failed");
                    self.receiver.send_failed(&id);
                }
            }
        }
        for (peer, host, port, msg) in self.fence.due((now, self.clock_us())) {
            self.connect(&peer, &host, port);
            self.deferred.push((peer, msg));
        }
        self.pump(now);
        // pull receives: done when every READ ended; failed when one failed
        let ids: Vec<String> = self
            .recvs
            .iter()
            .filter(|(_, r)| r.posted)
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            let Some(r) = self.recvs.get_mut(&id) else {
                continue;
            };
            let mut still = Vec::new();
            for x in std::mem::take(&mut r.xfers) {
                match self.agent.status(x) {
                    Ok(XferStatus::InProgress) => still.push(x),
                    Ok(XferStatus::Done) => {
                        let _ = self.agent.release(x);
                    }
                    other => {
                        let _ = self.agent.release(x);
                        let why = match other {
                            Ok(XferStatus::Error(e)) => e.to_string(),
                            o => format!("{o:?}"),
                        };
                        r.error.get_or_insert(why);
                    }
                }
            }
            r.xfers = still;
            if r.xfers.is_empty() {
                match r.error.clone() {
                    Some(e) => self.fail_recv(&id, &e),
                    None => {
                        if self.recvs.remove(&id).is_some_and(|r| r.req.read_back) {
                            self.read_backs += 1;
                        }
                        self.done.recving.push(id);
                    }
                }
            }
        }
        // withdrawals no P rank confirmed in time: the blocks go back (P is unreachable)
        let late: Vec<String> = (self.cancels.iter())
            .filter(|(_, (t, _))| *t <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in late {
            tracing::warn!(request = %id, "no P rank confirmed the withdrawn registration in time; blocks given back");
            if let Some((_, how)) = self.cancels.remove(&id) {
                self.withdrawn(id, how);
            }
        }
        // push receives
        let (ok, failed) = self.receiver.get_finished();
        if let Some(w) = &self.writer {
            for id in ok.iter().chain(&failed) {
                w.ended(id);
            }
        }
        self.done.recving.extend(ok);
        self.done.failed_recving.extend(failed);
        // leases
        self.leases.handle_timeout(now);
        while let Some(LeaseEvent::Free {
            request_id, reason, ..
        }) = self.leases.poll_event()
        {
            match reason {
                crate::proto::lease::FreeReason::Expired => {
                    self.leases_expired += 1;
                    tracing::info!(
                        request = %request_id,
                        "lease expired: blocks freed (no completion or heartbeat from D in time)"
                    );
                }
                crate::proto::lease::FreeReason::Completed => {
                    tracing::debug!(request = %request_id, "lease over: D has the blocks");
                }
            }
            match &self.writer {
                Some(w) => {
                    w.evict(&request_id);
                    // blocks a WRITE still reads are freed when it ends
                    if w.retire(&request_id) {
                        self.done.sending.push(request_id);
                    } else {
                        self.retiring.push(request_id);
                    }
                }
                None => self.done.sending.push(request_id),
            }
        }
        if let Some(w) = &self.writer {
            let (free, keep): (Vec<String>, Vec<String>) = std::mem::take(&mut self.retiring)
                .into_iter()
                .partition(|id| w.quiet(id));
            self.retiring = keep;
            self.done.sending.extend(free);
        }
        // blocks given back to the engine: nothing reaches them through a grant any more
        let d = &self.done;
        let back = d.sending.iter().chain(&d.recving).chain(&d.failed_recving);
        self.fence.release(&self.agent, back);
    }
}
