//! The WRITEs of a matched request (whole or streamed), and a streamed request that ends or fails.

use super::*;

impl Loop {
    /// Streamed matches that will never complete (their request evicted, their registration
    /// withdrawn): failed, so D is never told they are done.
    pub(super) fn fail_streamed(&mut self, which: impl Fn(&PairKey, &Streamed) -> bool) {
        let keys: Vec<PairKey> = (self.streamed.iter())
            .filter(|(k, s)| which(k, s))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            if let Some(s) = self.streamed.get_mut(&k) {
                s.failed = true;
            }
            self.settle(&k);
        }
    }

    /// A WRITE for `id` is over (done or failed).
    pub(super) fn ended(&self, id: &str) {
        let mut w = lock(&self.sh.writing);
        if let Some(e) = w.get_mut(id) {
            e.0 = e.0.saturating_sub(1);
            if e.0 == 0 && !e.1 {
                w.remove(id);
            }
        }
    }

    pub(super) fn write(
        &mut self,
        id: &str,
        local: &[u64],
        remote: &[u64],
        part: Part,
        reg: &PushReg,
    ) -> Result<(), String> {
        let (rank, tp) = self.sh.tp;
        let notif = Completion {
            request_id: reg.request_id.clone(),
            tp_size: tp,
        }
        .encode();
        let key = (!part.only).then(|| pair_key(id, reg));
        if let Some(k) = &key {
            let s = self.streamed.entry(k.clone()).or_insert_with(|| Streamed {
                engine: reg.engine_id.clone(),
                completion: notif.clone(),
                d_tp: reg.tp_size.max(1),
                last_posted: false,
                failed: false,
            });
            if s.failed {
                return Ok(()); // an earlier part failed: the rest is moot (already counted)
            }
            s.last_posted |= part.last;
            if local.is_empty() {
                self.settle(k);
                return Ok(());
            }
        }
        let (slices, peer_heads) =
            head_slices(self.sh.layout.kv_heads.max(1), rank, tp, reg.tp_size)
                .map_err(|e| e.to_string())?;
        let slice = slices
            .iter()
            .find(|s| s.peer_rank == reg.tp_rank)
            .ok_or_else(|| {
                format!(
                    "D rank {} of {} holds none of P rank {rank}'s heads",
                    reg.tp_rank, reg.tp_size
                )
            })?;
        let peer = peer_kv(&self.sh.agent, &reg.engine_id, &self.sh.layout, peer_heads)?;
        let sel = Select {
            tokens: self.tokens.get(id).copied().unwrap_or(0),
            first: Some(part.first_block),
            ..self.sh.sel
        };
        let (l, r) =
            self.sh
                .layout
                .transfer_descs(&self.sh.regions, local, &peer, remote, slice, sel)?;
        let bytes: u64 = l.iter().map(|d| d.len).sum();
        {
            // a retired request's blocks may already be free: never read them
            let mut w = lock(&self.sh.writing);
            let e = w.entry(id.to_owned()).or_insert((0, false));
            if e.1 {
                return Err("the request's lease ended".into());
            }
            e.0 += 1;
        }
        let attach = key.is_none().then_some(notif);
        // D's blocks are fenced when its registration carries a grant: WRITE through it
        let write = super::super::fence::Post {
            op: XferOp::Write,
            local: l,
            peer: &reg.engine_id,
            remote: r,
            notif: attach,
            token: reg.grant.as_deref(),
        };
        // counted before the post: its notification may reach D, and D's report the engine,
        // before this thread runs again (a test that read P's count on D's report saw 0 in
        // the lab, on a busy host); taken back if nothing was posted
        self.sh.bytes.fetch_add(bytes, Ordering::Relaxed);
        let posted = super::super::fence::post(&self.sh.agent, write);
        match posted {
            Ok(x) => {
                let target = (reg.engine_id.clone(), reg.request_id.clone());
                self.inflight
                    .push((x, id.to_owned(), reg.tp_size.max(1), key, target));
                Ok(())
            }
            Err(e) => {
                self.sh.bytes.fetch_sub(bytes, Ordering::Relaxed);
                self.ended(id);
                Err(e)
            }
        }
    }
}
