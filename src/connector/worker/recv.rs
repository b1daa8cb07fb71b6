//! D's side of a pull: where a request's KV comes from, the READs posted per source rank, the grants asked for and received, a receive that fails.

use super::*;

/// A read-back is declined when the keeper's blocks expire less than this long after it
/// would start (microseconds): the READ itself, and the engine step before it.
const READ_BACK_MARGIN_US: i64 = 1_000_000;

impl Worker {
    /// The P ranks whose heads this worker shares when P runs TP `p_tp`, each with its
    /// agent name and head slice; and P's heads per block.
    pub(super) fn sources(
        &self,
        engine: &str,
        p_tp: u32,
    ) -> Result<(Vec<(String, HeadSlice)>, u64), String> {
        let (slices, peer_heads) = head_slices(
            self.layout.kv_heads.max(1),
            self.tp_rank,
            self.tp_size,
            p_tp,
        )
        .map_err(|e| e.to_string())?;
        let v = slices
            .into_iter()
            .map(|s| (rank_agent_name(engine, s.peer_rank), s))
            .collect();
        Ok((v, peer_heads))
    }

    /// Start a handshake with peer agent `peer` at `host:port` on a helper thread (once);
    /// with a metadata store, by name through the store (P's `kv_transfer_params` may then
    /// name its engine only: no host, no ports).
    pub(super) fn connect(&mut self, peer: &str, host: &str, port: u16) {
        let addr = format!("{host}:{port}");
        // up while its connection is, at the address asked for: a P that died, or came back
        // elsewhere (restarted), is loaded again
        let current = match self.conns.get(peer) {
            Some(Conn::Up) => self.agent.peer_current(peer, &addr),
            Some(_) => true,
            None => false,
        };
        if current {
            return;
        }
        self.conns.insert(peer.to_owned(), Conn::Connecting);
        let (agent, tx, name) = (
            self.agent.clone(),
            self.handshakes.0.clone(),
            peer.to_owned(),
        );
        let spawned = crate::threads::spawn(format!("kvrail-load-{peer}"), move || {
            let r = agent.load_peer(&name, &addr);
            let _ = tx.send((name, r));
        });
        if let Err(e) = spawned {
            // asked again at the next step
            self.conns.remove(peer);
            tracing::warn!(%peer, error = %e, "no thread to connect to the peer");
        }
    }

    pub(super) fn fail_recv(&mut self, id: &str, why: &str) {
        let _span = tracing::info_span!("request", id = %id).entered();
        tracing::warn!(request = %id, error = %why, "KV receive failed");
        if let Some(r) = self.recvs.remove(id) {
            // handshake again before the next READ from those ranks: their connections may
            // be gone (a restarted P at the same address is then found again)
            for (peer, _) in &r.sources {
                if matches!(self.conns.get(peer), Some(Conn::Up)) {
                    self.conns.remove(peer);
                }
            }
        }
        self.done.failed_recving.push(id.to_owned());
    }

    /// Post one READ per source rank. A rank whose READ cannot be posted fails the receive,
    /// reported once the READs already posted have ended.
    pub(super) fn post_reads(&mut self, id: &str) {
        let _span = tracing::info_span!("request", id = %id).entered();
        let Some(r) = self.recvs.get(id) else {
            return;
        };
        let (req, sources, peer_heads) = (r.req.clone(), r.sources.clone(), r.peer_heads);
        let tokens: HashMap<String, Vec<u8>> = (r.grants.iter())
            .filter_map(|(p, g)| match g {
                Granted::Token(t) => Some((p.clone(), t.clone())),
                _ => None,
            })
            .collect();
        let mut xfers = Vec::new();
        let mut error = None;
        for (peer, slice) in &sources {
            let token = tokens.get(peer).map(Vec::as_slice);
            match self.post_read(&req, (peer, slice), peer_heads, token) {
                Ok(x) => xfers.push(x),
                Err(e) => {
                    error = Some(format!("READ from {peer}: {e}"));
                    break;
                }
            }
        }
        if let Some(r) = self.recvs.get_mut(id) {
            r.posted = true;
            r.xfers = xfers;
            r.error = error;
        }
    }

    pub(super) fn post_read(
        &mut self,
        r: &RecvReq,
        (peer, slice): (&str, &HeadSlice),
        peer_heads: u64,
        token: Option<&[u8]>,
    ) -> Result<XferId, String> {
        let p = &r.params;
        // both lists are logical: each side's blocks as physical ones, by its own ratio
        // (P's from its handshake)
        let p_ratio = self
            .agent
            .remote_metadata(peer)
            .map_or(1, |m| u64::from(m.handshake.physical_per_logical));
        let remote_ids = physical(&p.remote_block_ids, p_ratio);
        let local_ids = physical(&r.local_block_ids, self.layout.physical_per_logical);
        let mut remote_blocks = self.layout.prompt_blocks(&remote_ids, r.tokens);
        let bs = u64::from(self.layout.block_size.max(1));
        let short = if r.tokens > 0 {
            (remote_blocks.len() as u64) < r.tokens.div_ceil(bs)
        } else {
            remote_blocks.len() < r.local_block_ids.len()
        };
        if short {
            return Err(format!(
                "P names {} blocks for a {}-token prompt ({} local blocks)",
                remote_ids.len(),
                r.tokens,
                local_ids.len()
            ));
        }
        if r.read_back {
            // the remote's list starts at the request's first token, ours after the blocks
            // cached here (whole ones: a physical block is the smallest unit cached)
            let cached = (r.computed / bs) as usize;
            remote_blocks = &remote_blocks[cached.min(remote_blocks.len())..];
        }
        // D's blocks past the prompt (for tokens it will generate) take no part
        let local = &local_ids[..local_ids.len().min(remote_blocks.len())];
        let pk = peer_kv(&self.agent, peer, &self.layout, peer_heads)?;
        let sel = Select {
            tokens: r.tokens,
            chunk: self.chunk,
            swa: self.cfg.swa_window_mode,
            first: None,
        };
        // D may hold a prefix already: the lists are aligned at their ends
        let (local, remote) =
            self.layout
                .transfer_descs(&self.layers, local, &pk, remote_blocks, slice, sel)?;
        let bytes: u64 = local.iter().map(|d| d.len).sum();
        let notif = Completion {
            request_id: p.remote_request_id.clone(),
            tp_size: self.tp_size,
        }
        .encode();
        // a fenced P rank's blocks are read through its grant
        let read = Post {
            op: XferOp::Read,
            local,
            peer,
            remote,
            notif: Some(notif),
            token,
        };
        let x = post(&self.agent, read)?;
        self.read_bytes += bytes;
        Ok(x)
    }

    /// Pull, D: whether every fenced P rank of receive `id` gave its grant (asking the ones
    /// not asked yet: every rank is connected by now).
    ///
    /// # Errors
    /// A rank refused, or did not answer within a lease.
    pub(super) fn grants_ready(&mut self, id: &str, now: Instant) -> Result<bool, String> {
        let Some(r) = self.recvs.get_mut(id) else {
            return Ok(false);
        };
        let mut ready = true;
        let mut refused = None;
        // a read-back with an expiry asks every keeper rank: its answer carries its clock
        let expiry = (r.req.params.remote_blocks_expiry_time).filter(|_| r.req.read_back);
        for (peer, _) in &r.sources {
            let fenced = (self.agent.remote_metadata(peer))
                .is_some_and(|m| m.regions.iter().any(|m| m.fenced));
            if !fenced && expiry.is_none() {
                continue;
            }
            match r.grants.get(peer) {
                None => {
                    let addr = self.agent.side_channel_addr();
                    let ask = GrantReq {
                        request_id: r.req.params.remote_request_id.clone(),
                        host: addr.ip().to_string(),
                        port: addr.port(),
                    };
                    self.agent
                        .send_notif(peer, ask.encode())
                        .map_err(|e| format!("asking {peer} for its grant: {e}"))?;
                    let until = now + Duration::from_secs(self.cfg.lease_duration_s.max(1));
                    let sent = super::super::clock::now_us() + self.clock_skew_us;
                    r.grants.insert(peer.clone(), Granted::Asked(until, sent));
                    ready = false;
                }
                Some(Granted::Asked(until, _)) if now >= *until => {
                    return Err(format!("{peer} gave no grant for the blocks in time"));
                }
                Some(Granted::Asked(..)) => ready = false,
                Some(Granted::Refused(why)) if fenced => {
                    refused.get_or_insert_with(|| format!("{peer} gives no grant: {why}"));
                }
                Some(Granted::Refused(_) | Granted::Token(_)) => {}
            }
        }
        // every rank answered: an expiry passed is said as such (and counted) before the
        // refusal that follows from it
        if let (true, Some(expiry)) = (ready, expiry) {
            self.check_expiry(id, expiry)?;
        }
        match refused {
            Some(e) if ready => Err(e),
            _ => Ok(ready),
        }
    }

    /// A read-back whose keeper answered: declined when the keeper's blocks expire (its
    /// `remote_blocks_expiry_time`, converted with the offset measured from each rank's
    /// answer) before the READ would end ([`READ_BACK_MARGIN_US`] from now). The engine
    /// then computes the tokens (`kv_load_failure_policy` recompute), as NixlConnector
    /// declines an expired turn-2 read. A late READ would fail anyway: the keeper revokes
    /// its grant before it reuses the blocks.
    fn check_expiry(&mut self, id: &str, expiry_s: f64) -> Result<(), String> {
        let Some(r) = self.recvs.get(id) else {
            return Ok(());
        };
        let now = self.clock_us();
        let expiry_us = (expiry_s * 1e6) as i64;
        for (peer, &(off, err)) in &r.offsets {
            if super::super::clock::expired(expiry_us, (off, err), now, READ_BACK_MARGIN_US) {
                let left = expiry_us.saturating_sub(off).saturating_sub(now) as f64 / 1e6;
                self.expired_reads += 1;
                return Err(format!(
                    "{peer} keeps the blocks until {expiry_s:.3} s in its clock, {left:.3} s from \
                     now here (offset {:.3} s +- {:.3} ms, measured from its answer): too late \
                     to read them back; the tokens are computed here",
                    off as f64 / 1e6,
                    err as f64 / 1e3
                ));
            }
        }
        Ok(())
    }

    /// Whether a receive asked `peer` about `request` (the remote's request id) and waits
    /// for the answer.
    pub(super) fn waits_for_grant(&self, peer: &str, request: &str) -> bool {
        self.recvs.values().any(|r| {
            r.req.params.remote_request_id == request
                && matches!(r.grants.get(peer), Some(Granted::Asked(..)))
        })
    }

    /// Pull, D: a P rank's answer about its blocks of P's request `request`, stamped with
    /// its clock (`clock_us`: the offset to it is measured from the round trip).
    pub(super) fn granted(&mut self, peer: &str, request: &str, g: Granted, clock_us: Option<i64>) {
        let received = self.clock_us();
        for r in self.recvs.values_mut() {
            if r.req.params.remote_request_id == request && r.grants.contains_key(peer) {
                if let (Some(Granted::Asked(_, sent)), Some(c)) = (r.grants.get(peer), clock_us) {
                    let o = super::super::clock::offset(*sent, c, received);
                    r.offsets.insert(peer.to_owned(), o);
                }
                r.grants.insert(peer.to_owned(), g);
                return;
            }
        }
    }
}
