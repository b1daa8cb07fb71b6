//! Posting a transfer on verbs: its slices planned over the rails, queued per pair, posted as the queue pairs take them, moved to survivors when a rail fails.

use super::*;

impl Verbs {
    /// Plan and post a transfer.
    pub(crate) fn post(&self, shared: &dyn Host, req: PostReq<'_>) -> Result<(), AgentError> {
        let PostReq {
            id,
            op,
            peer,
            local,
            remote,
            meta,
            grants,
        } = req;
        let mut e = lock(&self.engine);
        let mut key = PairKey::shared(peer.clone(), 0);
        let rails = e.live_rails(&mut key, self.rails.len());
        if rails.is_empty() {
            return Err(AgentError::Unsupported(format!(
                "no working queue pair to {peer}"
            )));
        }
        let descs: SmallVec<[DescPair; 4]> = local
            .iter()
            .zip(remote)
            .map(|((_, l), r)| DescPair {
                local_region: l.region.0,
                local_off: l.offset,
                remote_region: r.region.0,
                remote_off: r.offset,
                len: l.len,
            })
            .collect();
        let planner = e
            .planner
            .get_or_insert_with(|| Planner::new(self.rails.len()));
        for r in 0..self.rails.len() {
            planner.set_up(r, rails.contains(&r));
        }
        let plan = planner
            .plan(&descs, self.mode)
            .map_err(|x| AgentError::Unsupported(x.to_string()))?;
        let fenced = grants.iter().any(Option::is_some);
        let mut run = Run {
            progress: Progress::from(Plan::default()),
            peer: key.0.clone(),
            op,
            local: local.iter().map(|(r, _)| r.clone()).collect(),
            meta: meta.clone(),
            grants: if fenced { grants.to_vec() } else { Vec::new() },
        };
        self.enqueue(&mut e, id, &run, &plan, &mut key);
        let (slices, rails_used) = (plan.slices(), plan.rails_used_count());
        // the run keeps the plan's lists (enqueued above: no copy of them)
        run.progress = Progress::from(plan);
        e.runs.insert(id, run);
        if slices == 0 {
            e.runs.remove(&id);
            self.completed(shared, &mut e, id);
            return Ok(());
        }
        // The only transfer in flight, on one rail: post in place (one thread hand-off less,
        // which is what a lone transfer waits on). So too on one rail when callers poll
        // (agent::spin) and a rail has one lane: the thread that polls posts, as perftest's
        // does. Otherwise the posters move the rails (and a rail's lanes) in parallel: on
        // rxe, where a post does its queue pair's packet work, two lanes of one rail posted
        // by one caller moved as one (64 KiB WRITE x 32: 43-68 MB/s in place, 92-96 from
        // the posters, 108-117 with the caller asleep; `ib_write_bw` 68-70). Either way
        // nothing holds the engine lock through a post: rxe does the packet work inside `ibv_post_send`, and the progress
        // thread slept on the lock for the whole of it (a futex wait and a switch a transfer).
        let in_place =
            rails_used == 1 && (e.runs.len() == 1 || (!self.spin.is_zero() && self.lanes == 1));
        let mut mine: SmallVec<[poster::InPlace; 1]> = SmallVec::new();
        for r in 0..self.rails.len() {
            key.1 = r;
            self.pump_with(&mut e, &key, in_place.then_some(&mut mine));
        }
        drop(e);
        // A caller that polls (a budget set) comes back to poll after its post: while the
        // doorbell runs — rxe's packet work, a millisecond at 64 KiB in the lab — completion
        // events stay the callers' to take, not the progress thread's to drain (it took a
        // third of them, each a wake-up of it and of the caller sleeping next).
        let _polling = (!mine.is_empty() && !self.spin.is_zero())
            .then(|| polling::Polling::start(self, shared));
        for c in mine {
            if let Err(msg) = self.post_slices(c.rail, &c.qp, c.xfer, &c.slices) {
                key.1 = c.rail;
                self.post_failed(shared, &mut lock(&self.engine), &key, &c.qp, &msg);
            }
        }
        Ok(())
    }

    /// Queue a plan's slices on the pairs to the run's peer (`key`: that peer, any rail).
    pub(super) fn enqueue(
        &self,
        e: &mut Engine,
        id: u64,
        run: &Run,
        plan: &Plan,
        key: &mut PairKey,
    ) {
        for (r, slices) in plan.per_rail.iter().enumerate() {
            if slices.is_empty() {
                continue;
            }
            key.1 = r;
            let Some(q) = e.pairs.get_mut(key) else {
                continue;
            };
            // the peer's rail this queue pair is connected to (paired when it was set up)
            let peer_rail = q.peer_rail;
            for sl in slices {
                let Some(m) = run.meta.regions.iter().find(|m| m.id == sl.remote_region) else {
                    continue;
                };
                // fenced memory: the key of the grant range that holds the slice
                let granted = run.grants.get(sl.desc).and_then(Option::as_ref).map(|g| {
                    g.covering(sl.remote_region, sl.remote_off, sl.len)
                        .and_then(|r| r.rkeys.get(peer_rail).copied())
                        .unwrap_or_default()
                });
                q.queue.push_back(Pending {
                    xfer: id,
                    op: run.op,
                    region: run.local[sl.desc].clone(),
                    local_off: sl.local_off,
                    remote: RemoteRegion {
                        addr: m.addr,
                        len: m.len,
                        rkey: granted
                            .unwrap_or_else(|| m.rkeys.get(peer_rail).copied().unwrap_or_default()),
                    },
                    remote_off: sl.remote_off,
                    len: sl.len,
                });
            }
        }
    }

    /// A rail's queue pair to a peer failed on the path (retries exhausted, flushed): its
    /// outstanding slices move to the rails still working to that peer; with none left the
    /// transfers fail. The queue pair stays dead; later transfers use the survivors.
    pub(super) fn fail_over(&self, shared: &dyn Host, e: &mut Engine, key: &PairKey, why: &str) {
        let (peer, rail) = (key.0.clone(), key.1);
        if let Some(s) = self.stats.get() {
            s.failovers[rail].inc();
        }
        e.mark_dead(key, why);
        if let Some(q) = e.pairs.get_mut(key) {
            // Stop the device working on it before its work is redone elsewhere.
            if let Err(err) = q.qp.set_error() {
                tracing::error!(
                    "cannot retire the queue pair on {}: {err}",
                    self.rails[rail].name
                );
            }
            q.queue.clear(); // every queued slice is also pending in its run: re-planned below
        }
        let mut pk = key.clone();
        let survivors = e.live_rails(&mut pk, self.rails.len());
        let ids: Vec<u64> = e
            .runs
            .iter()
            .filter(|(_, r)| *r.peer == *peer && !r.progress.pending(rail).is_empty())
            .map(|(id, _)| *id)
            .collect();
        tracing::warn!(
            rail = %self.rails[rail].name, %peer, transfers = ids.len(),
            "rail failed ({why}); moving its outstanding slices to {} surviving rail(s)", survivors.len()
        );
        for id in ids {
            let Some(mut run) = e.runs.remove(&id) else {
                continue;
            };
            let slices = run.progress.fail_rail(rail);
            let planner = e
                .planner
                .get_or_insert_with(|| Planner::new(self.rails.len()));
            planner.release(rail, slices.iter().map(|s| s.len).sum());
            for r in 0..self.rails.len() {
                planner.set_up(r, survivors.contains(&r));
            }
            match planner.replan(&slices) {
                Ok(plan) => {
                    run.progress.add(&plan);
                    self.enqueue(e, id, &run, &plan, &mut pk);
                    e.runs.insert(id, run);
                }
                Err(no_rail) => shared.xfer_failed(id, format!("{why}; {no_rail}")),
            }
        }
        let keys: Vec<PairKey> = e.pairs.keys().filter(|k| k.is(&peer)).cloned().collect();
        for k in keys {
            self.pump(e, &k);
        }
    }

    /// Hand queued slices of one pair to its rail's poster while its send queue has room, in
    /// chunks of one transfer each (the last request of a chunk signaled).
    pub(super) fn pump(&self, e: &mut Engine, key: &PairKey) {
        self.pump_with(e, key, None);
    }

    /// [`Verbs::pump`]; with `in_place`, a chunk the rail's poster has nothing queued before
    /// goes there instead, for this thread to post once it let go of the engine lock (see
    /// [`poster`]).
    pub(super) fn pump_with(
        &self,
        e: &mut Engine,
        key: &PairKey,
        mut in_place: Option<&mut SmallVec<[poster::InPlace; 1]>>,
    ) {
        let rail = key.1;
        let Some(q) = e.pairs.get_mut(key) else {
            return;
        };
        loop {
            if q.dead.is_some() || q.queue.is_empty() {
                return;
            }
            let room = (DEPTH as usize).saturating_sub(q.in_flight);
            if room == 0 {
                return;
            }
            let xfer = q.queue[0].xfer;
            let n = q
                .queue
                .iter()
                .take(CHUNK.min(room))
                .take_while(|p| p.xfer == xfer)
                .count();
            q.in_flight += n;
            if let Some(mine) = in_place.as_deref_mut() {
                if self.posters.queued[rail].load(Ordering::Acquire) == 0 {
                    // posted by the caller: no chunk (and no copy of the pair's key) to build
                    mine.push(poster::InPlace {
                        rail,
                        qp: q.qp.clone(),
                        xfer,
                        slices: q.queue.drain(..n).collect(),
                    });
                    continue;
                }
            }
            let c = poster::Chunk {
                key: key.clone(),
                qp: q.qp.clone(),
                xfer,
                slices: q.queue.drain(..n).collect(),
            };
            self.posters.queued[rail].fetch_add(1, Ordering::AcqRel);
            if self.posters.tx[rail].send(poster::Job::Post(c)).is_err() {
                return; // the poster stopped: the agent is shutting down
            }
        }
    }
}
