//! Transfers: create, post, look, wait, release; a handle's notification.

use super::*;

impl Agent {
    /// Create a transfer: `op` between `local` descriptors and the peer's `remote` ones
    /// (equal counts, pairwise equal sizes), with an optional notification the peer gets
    /// after all bytes landed. Validated here; nothing moves until [`Agent::post`]. A remote
    /// descriptor the loaded metadata does not cover, of a peer loaded from the metadata
    /// store, is checked once more after loading the store's newer revision, when it has
    /// one (a region the peer registered a moment ago, before the store's watch delivered it).
    ///
    /// # Errors
    /// [`AgentError::LengthMismatch`], [`AgentError::InvalidDesc`] naming the index,
    /// [`AgentError::UnknownPeer`], [`AgentError::NotifTooLarge`].
    pub fn create_xfer(
        &self,
        op: XferOp,
        local: Vec<Desc>,
        peer: &str,
        remote: Vec<Desc>,
        notif: Option<Vec<u8>>,
    ) -> Result<XferId, AgentError> {
        check_notif_len(notif.as_deref())?;
        let epoch = match self.checked_epoch(op, &local, peer, &remote) {
            // the peer may have registered it a moment ago: ask the store once
            Err(AgentError::InvalidDesc { side: "remote", .. })
                if self.refresh_from_store(peer) =>
            {
                self.checked_epoch(op, &local, peer, &remote)?
            }
            r => r?,
        };
        Ok(lock(&self.shared.xfers).create(op, (peer, epoch), local, remote, notif))
    }

    /// [`Agent::create_xfer`]'s checks against `peer`'s loaded metadata; its epoch.
    pub(super) fn checked_epoch(
        &self,
        op: XferOp,
        local: &[Desc],
        peer: &str,
        remote: &[Desc],
    ) -> Result<u64, AgentError> {
        let peers = lock(&self.shared.peers);
        let p = peers
            .get(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.into()))?;
        let regions = lock(&self.shared.regions);
        table::validate(op, local, remote, &p.meta, |r| {
            regions.get(&r.0).map(|r| r.len())
        })?;
        drop(regions);
        self.shared
            .grants_for(peer, &p.meta, remote, op == XferOp::Write)?;
        Ok(p.epoch)
    }

    /// Post a transfer (again, once it is no longer active).
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`], [`AgentError::UnknownPeer`],
    /// [`AgentError::InvalidDesc`] when a local region was deregistered since.
    pub fn post(&self, id: XferId) -> Result<(), AgentError> {
        let peers = lock(&self.shared.peers);
        let mut xfers = lock(&self.shared.xfers);
        let x = xfers.postable(id)?;
        let p = peers
            .get(&*x.peer)
            .ok_or_else(|| AgentError::UnknownPeer(x.peer.to_string()))?;
        if !p.conn.is_open() {
            // the peer is gone (its queue pairs too): nothing posted would ever complete
            return Err(AgentError::Connection {
                what: "connection to",
                addr: p.addr.to_string(),
                message: format!("{} closed; load the peer again", x.peer),
            });
        }
        if p.epoch != x.peer_epoch {
            // loaded again since (reconnected, or a restarted process under the same name):
            // its descriptors named the old connection's memory
            return Err(AgentError::Connection {
                what: "connection to",
                addr: p.addr.to_string(),
                message: format!(
                    "{} was loaded again after this transfer was created (reconnected or \
                     restarted); create the transfer again",
                    x.peer
                ),
            });
        }
        let mut held: Vec<Arc<Region>> = Vec::with_capacity(x.local.len());
        {
            // held busy under the regions' lock: a deregistration sees them busy, or they
            // see it gone
            let regions = lock(&self.shared.regions);
            for (i, d) in x.local.iter().enumerate() {
                let r = regions
                    .get(&d.region.0)
                    .ok_or_else(|| AgentError::InvalidDesc {
                        side: "local",
                        index: i,
                        reason: format!("region {} is no longer registered", d.region.0),
                    })?;
                if !held.iter().any(|h| Arc::ptr_eq(h, r)) {
                    held.push(r.clone());
                }
            }
            for r in &held {
                r.acquire();
            }
        }
        // fenced memory of the peer is named through the grants it gave (checked again: one
        // may have been forgotten since the transfer was created)
        let grants =
            match self
                .shared
                .grants_for(&x.peer, &p.meta, &x.remote, x.op == XferOp::Write)
            {
                Ok(g) => g,
                Err(e) => {
                    for r in &held {
                        r.release();
                    }
                    return Err(e);
                }
            };
        let x = xfers.begin(id, held)?;
        let _span = tracing::debug_span!("xfer", agent = %self.shared.name, id = id.0, op = ?x.op, peer = %x.peer)
            .entered();
        let posted = backend::Posted {
            id: id.0,
            op: x.op,
            peer: x.peer.clone(),
            local: x
                .local
                .iter()
                .filter_map(|d| {
                    let r = x.held.iter().find(|h| h.id == d.region)?;
                    Some((r.clone(), *d))
                })
                .collect(),
            remote: x.remote.clone(),
            notif: x.notif.clone(),
            meta: p.meta.clone(),
            grants,
        };
        // device memory on either side goes through the host bounce (on verbs); the rest
        // on the peer's queue pairs, else its TCP connection. Only an agent with a bounce
        // engine looks, and it scans the descriptors only when the peer has device memory.
        let device = self.shared.bounce.get().is_some() && {
            let peer_dev: Vec<u32> = (p.meta.regions.iter())
                .filter(|m| m.kind != MemKind::Host)
                .map(|m| m.id)
                .collect();
            x.held.iter().any(|r| r.kind != MemKind::Host)
                || (!peer_dev.is_empty() && x.remote.iter().any(|d| peer_dev.contains(&d.region.0)))
        };
        #[cfg(feature = "verbs")]
        let lanes = (self.shared.verbs.as_deref())
            .filter(|v| v.has_peer(&posted.peer))
            .map(|lanes| backend::VerbsPath {
                lanes,
                host: &*self.shared,
            });
        #[cfg(feature = "verbs")]
        let verbs = lanes.as_ref().map(|v| v as &dyn backend::Backend);
        #[cfg(not(feature = "verbs"))]
        let verbs: Option<&dyn backend::Backend> = None;
        let tcp;
        let chosen: &dyn backend::Backend = match (verbs, self.shared.bounce.get()) {
            (Some(_), Some(engine)) if device => &**engine,
            (Some(v), _) => v,
            (None, _) => {
                // the peer's TCP connection (one of its lanes, for a large transfer)
                let bytes = posted.local.iter().map(|(_, d)| d.len).sum();
                let (tx, open) = p.conn.sender_for(bytes, posted.notif.is_some());
                tcp = backend::TcpPath {
                    core: &self.shared.core,
                    tx,
                    open,
                };
                &tcp
            }
        };
        // Nothing is handed over with the agent's maps locked: a backend that fails the
        // transfer takes them again (and the verbs engine is never taken under them).
        drop(xfers);
        drop(peers);
        if let Err(e) = chosen.start(posted) {
            self.shared
                .finish(id.0, Err(XferError::Post(e.to_string())));
            return Err(e);
        }
        Ok(())
    }

    /// Replace the notification a transfer sends when it next completes (None: none), for a
    /// transfer posted again with another message (NIXL's `transfer(handle, notif_msg)`).
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`], [`AgentError::NotifTooLarge`].
    pub fn set_notif(&self, id: XferId, notif: Option<Vec<u8>>) -> Result<(), AgentError> {
        check_notif_len(notif.as_deref())?;
        lock(&self.shared.xfers).set_notif(id, notif)
    }

    /// Where a transfer stands.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub fn status(&self, id: XferId) -> Result<XferStatus, AgentError> {
        self.shared.poll_for_status(id); // adaptive progress: the caller's poll
        lock(&self.shared.xfers).status(id).cloned()
    }

    /// Block until transfer `id` is no longer in progress, or `timeout` passed; returns its
    /// status then (still [`XferStatus::InProgress`] on a timeout). Sleeps; an engine
    /// thread that would otherwise spin on [`Agent::status`] can wait here instead. With
    /// [`AgentConfig::progress_spin_us`] it polls the completion queues itself first (on
    /// TCP it looks for the answer of a transfer of at most 16 KiB before sleeping).
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub fn wait(&self, id: XferId, timeout: std::time::Duration) -> Result<XferStatus, AgentError> {
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        let budget = self
            .shared
            .spin_budget(|| lock(&self.shared.xfers).bytes(id));
        let ended = &self.shared.ended;
        let mut seen = None; // the count of ended transfers at the last look
        let polled = self.shared.spin_until(budget, start, deadline, || {
            let now = ended.load(std::sync::atomic::Ordering::Acquire);
            if seen == Some(now) {
                return Ok(None); // nothing ended since: no need to look
            }
            seen = Some(now);
            let st = lock(&self.shared.xfers).status(id)?.clone();
            Ok((st != XferStatus::InProgress).then_some(st))
        })?;
        if let Some(st) = polled {
            self.shared.stats.waits[0].inc();
            return Ok(st);
        }
        self.shared.stats.waits[1].inc();
        let mut xfers = lock(&self.shared.xfers);
        loop {
            let st = xfers.status(id)?;
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if *st != XferStatus::InProgress || left.is_zero() {
                return Ok(st.clone());
            }
            xfers = self.shared.xfer_done_cv.wait_timeout(xfers, left);
        }
    }

    /// Release a transfer that is not in progress.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`].
    pub fn release(&self, id: XferId) -> Result<(), AgentError> {
        lock(&self.shared.xfers).release(id)?;
        if let Some(b) = self.shared.bounce.get() {
            b.forget_xfer(id.0);
        }
        Ok(())
    }
}
