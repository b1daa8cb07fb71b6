//! D's registrations as P's writer sees them: sent for, withdrawn, confirmed, settled against P's finished requests.

use super::*;

impl Loop {
    /// Send the registration to every P rank it goes to.
    pub(super) fn send_regs(&mut self, peers: &[String], r: &RecvReq, grant: Option<&[u8]>) {
        for p in peers {
            self.send_reg(p, r.clone(), grant);
        }
        self.sent_to.insert(r.request_id.clone(), peers.to_vec());
    }

    /// D: withdraw registration `id` (the engine aborted the request, or the watchdog gave
    /// up): not sent yet — dropped here; sent — `PUSH_CANCEL` to each P rank, confirmed by
    /// each (a rank that cannot be reached any more counts as confirmed).
    pub(super) fn withdraw(&mut self, id: &str, report: bool) {
        self.waiting.retain(|w| w.reg.request_id != id);
        let mut left = Vec::new();
        let addr = self.sh.agent.side_channel_addr();
        let msg = PushCancel {
            request_id: id.to_owned(),
            engine_id: self.sh.agent.name().to_owned(),
            host: addr.ip().to_string(),
            port: addr.port(),
        }
        .encode();
        for peer in self.sent_to.remove(id).unwrap_or_default() {
            match self.sh.agent.send_notif(&peer, msg.clone()) {
                Ok(()) => left.push(peer),
                Err(e) => tracing::warn!(request = %id, %peer, error = %e, "PUSH_CANCEL not sent"),
            }
        }
        if left.is_empty() {
            if report {
                self.event(WriterEvent::Cancelled(id.to_owned()));
            }
        } else {
            self.withdrawing.insert(id.to_owned(), (left, report));
        }
    }

    /// D: P rank `from` confirmed the withdrawal of `id`.
    pub(super) fn withdrawn(&mut self, from: &str, id: &str) {
        let Some((left, report)) = self.withdrawing.get_mut(id) else {
            return;
        };
        left.retain(|p| p != from);
        if left.is_empty() {
            let report = *report;
            self.withdrawing.remove(id);
            if report {
                self.event(WriterEvent::Cancelled(id.to_owned()));
            }
        }
    }

    /// P: confirm the withdrawals no WRITE in flight writes into any more (connecting to a
    /// D this P never wrote to first; without a connection D gives the blocks back on its own
    /// after `push_registration_timeout`).
    pub(super) fn confirm_cancels(&mut self) {
        let inflight = &self.inflight;
        let (done, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.cancelling)
            .into_iter()
            .partition(|(d, id, _)| !inflight.iter().any(|f| &f.4 .0 == d && &f.4 .1 == id));
        self.cancelling = wait;
        for (d, id, addr) in done {
            if self.conns.get(&d) != Some(&Conn::Up) {
                self.handshake(&d, addr.clone()); // once; a failure forgets the connection
                if self.conns.contains_key(&d) {
                    self.cancelling.push((d, id, addr)); // answered once connected
                }
                continue;
            }
            let ack = PushCancelled {
                request_id: id.clone(),
                tp_size: self.sh.tp.1,
            };
            if let Err(e) = self.sh.agent.send_notif(&d, ack.encode()) {
                tracing::warn!(request = %id, peer = %d, error = %e, "PUSH_CANCELLED not sent");
            }
        }
    }

    /// P: tell D that registrations which found no prefill here get no WRITE (`GRANT_NONE`
    /// naming D's request id), connecting to D first where this P never wrote to it; D
    /// then withdraws them and fails their receives instead of waiting out
    /// `push_registration_timeout`.
    pub(super) fn refuse_unheld(&mut self) {
        for (d, id, addr, why) in std::mem::take(&mut self.refusing) {
            if self.conns.get(&d) != Some(&Conn::Up) {
                self.handshake(&d, addr.clone()); // once; a failure forgets the connection
                if self.conns.contains_key(&d) {
                    self.refusing.push((d, id, addr, why)); // told once connected
                }
                continue;
            }
            let no = GrantNone {
                request_id: id.clone(),
                reason: why,
                clock_us: None,
            };
            if let Err(e) = self.sh.agent.send_notif(&d, no.encode()) {
                tracing::warn!(request = %id, peer = %d, error = %e, "GRANT_NONE not sent");
            }
        }
    }

    /// D: registrations out to a P rank whose connection ended (it crashed or stopped, its
    /// metadata left the store, or it came back as another process) fail now: that rank
    /// writes nothing more into them, and D's grant over their blocks is revoked when the
    /// engine takes them back. Without this D waited out `push_registration_timeout`
    /// (480 s by default; the router's client had given up long before).
    pub(super) fn fail_orphaned(&mut self) {
        let agent = &self.sh.agent;
        let gone: Vec<(String, String)> = self
            .sent_to
            .iter()
            .filter_map(|(id, peers)| {
                let dead = peers.iter().find(|p| !agent.peer_connected(p))?;
                Some((id.clone(), dead.clone()))
            })
            .collect();
        for (id, peer) in gone {
            self.sent_to.remove(&id);
            self.event(WriterEvent::RegistrationFailed(
                id,
                format!("{peer} went away before it wrote (its connection ended: crashed, stopped or restarted)"),
            ));
        }
    }

    pub(super) fn send_reg(&self, peer: &str, r: RecvReq, grant: Option<&[u8]>) {
        if r.local_block_ids.is_empty() {
            // P refuses a registration without blocks: say so here instead of timing out
            self.event(WriterEvent::RegistrationFailed(
                r.request_id,
                "PUSH_REG: no blocks to receive into".into(),
            ));
            return;
        }
        let reg = PushReg {
            request_id: r.request_id.clone(),
            engine_id: self.sh.agent.name().to_owned(),
            host: self.sh.agent.side_channel_addr().ip().to_string(),
            port: self.sh.agent.side_channel_addr().port(),
            tp_rank: self.sh.tp.0,
            tp_size: self.sh.tp.1,
            block_ids: r.local_block_ids.clone(),
            remote_engine_id: r.params.remote_engine_id.clone(),
            remote_request_id: r.params.remote_request_id.clone(),
            grant: grant.map(<[u8]>::to_vec),
        };
        if let Err(e) = self.sh.agent.send_notif(peer, reg.encode()) {
            self.event(WriterEvent::RegistrationFailed(
                r.request_id,
                format!("sending PUSH_REG: {e}"),
            ));
        }
    }

    /// A streamed match: tell D once its last WRITE was posted and none is in flight; a
    /// failed one is dropped (counted when its WRITE failed) and D is never told.
    pub(super) fn settle(&mut self, key: &PairKey) {
        let n = self
            .inflight
            .iter()
            .filter(|f| f.3.as_ref() == Some(key))
            .count();
        let Some(s) = self.streamed.get(key) else {
            return;
        };
        if n > 0 || !(s.last_posted || s.failed) {
            return;
        }
        let s = self.streamed.remove(key).unwrap_or_else(|| unreachable!());
        if s.failed {
            return;
        }
        match self.sh.agent.send_notif(&s.engine, s.completion) {
            Ok(()) => self.event(WriterEvent::Pushed(key.0.clone(), s.d_tp)),
            Err(e) => {
                tracing::warn!(request = %key.0, error = %e, "push completion not sent");
                self.sh.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
