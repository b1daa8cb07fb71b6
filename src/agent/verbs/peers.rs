//! Peers on verbs: their queue pairs per rail, added, looked up, killed and removed; bytes per rail.

use super::*;

impl Verbs {
    /// Pair local rails with the peer's: same IPv4 subnet, else by index.
    pub(crate) fn pairs_with(&self, peer: &AgentMetadata) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for (i, l) in self.rails.iter().enumerate() {
            let by_subnet = peer.rails.iter().position(|p| {
                let pa = p.ipv4.as_deref().and_then(|s| s.parse::<Ipv4If>().ok());
                matches!((l.ipv4, pa), (Some(a), Some(b)) if a.same_subnet(b.addr))
            });
            if let Some(j) = by_subnet.or((i < peer.rails.len()).then_some(i)) {
                v.push((i, j));
            }
        }
        v
    }

    /// A queue pair on local rail `rail` (initiator side: no remote access).
    pub(crate) fn new_qp(&self, rail: usize, remote_access: Access) -> Result<Qp, AgentError> {
        let r = &self.rails[rail];
        let mut o = QpOptions::new(r.port, r.gid_index);
        o.max_mtu = self.max_mtu;
        o.max_send_wr = DEPTH;
        o.max_recv_wr = 1;
        o.remote_access = remote_access;
        Qp::new(&r.pd, &r.cq, &r.cq, &o).map_err(verr)
    }

    /// Remember the connected queue pairs to `peer`: (local rail, peer rail, queue pair).
    pub(crate) fn add_peer(&self, peer: &str, qps: Vec<(usize, usize, Qp)>) {
        lock(&self.peers).insert(peer.to_owned());
        let mut e = lock(&self.engine);
        e.pairs.retain(|k, _| !k.is(peer));
        e.qpn.retain(|_, k| !k.is(peer));
        e.retry.retain(|k, _| !k.is(peer));
        e.rebuilding.remove(peer);
        for (rail, peer_rail, qp) in qps {
            e.install(peer, rail, peer_rail, qp);
        }
    }

    /// (rail name, bytes completed on it) for every rail.
    pub(crate) fn rail_bytes(&self) -> Vec<(String, u64)> {
        let e = lock(&self.engine);
        self.rails
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), e.done_bytes.get(i).copied().unwrap_or(0)))
            .collect()
    }

    /// The local rails with a connected queue pair to `peer`.
    pub(crate) fn peer_rails(&self, peer: &str) -> Vec<String> {
        let e = lock(&self.engine);
        let mut v: Vec<usize> = e
            .pairs
            .iter()
            .filter(|(k, q)| k.is(peer) && q.dead.is_none())
            .map(|(k, _)| k.1)
            .collect();
        v.sort_unstable();
        v.into_iter().map(|r| self.rails[r].name.clone()).collect()
    }

    /// Forget `peer`: its transfers fail, its queue pairs are destroyed.
    pub(crate) fn remove_peer(&self, shared: &dyn Host, peer: &str) {
        lock(&self.peers).remove(peer);
        let mut e = lock(&self.engine);
        let keys: Vec<PairKey> = e.pairs.keys().filter(|k| k.is(peer)).cloned().collect();
        for k in &keys {
            self.kill_pair(shared, &mut e, k, "peer metadata invalidated");
        }
        e.pairs.retain(|k, _| !k.is(peer));
        e.qpn.retain(|_, k| !k.is(peer));
        e.retry.retain(|k, _| !k.is(peer));
        e.rebuilding.remove(peer);
        if let Some(id) = e.out_ids.remove(peer) {
            e.outs.remove(&id);
            e.chan_qpn.retain(|_, k| *k != notif::ChanKey::Out(id));
        }
    }

    pub(crate) fn has_peer(&self, peer: &str) -> bool {
        lock(&self.peers).contains(peer)
    }

    /// A pair's queue pair failed: every transfer with slices on it fails.
    pub(super) fn kill_pair(&self, shared: &dyn Host, e: &mut Engine, key: &PairKey, why: &str) {
        self.kill_pair_as(shared, e, key, why, false);
    }

    /// [`Verbs::kill_pair`]; `refused` (the peer's NIC refused a key): the transfers that
    /// went through grants fail as [`XferError::GrantRevoked`](crate::agent::error::XferError).
    pub(super) fn kill_pair_as(
        &self,
        shared: &dyn Host,
        e: &mut Engine,
        key: &PairKey,
        why: &str,
        refused: bool,
    ) {
        let mut victims: Vec<u64> = Vec::new();
        e.mark_dead(key, why);
        if let Some(q) = e.pairs.get_mut(key) {
            victims.extend(q.queue.drain(..).map(|p| p.xfer));
        }
        victims.extend(
            e.runs
                .iter()
                .filter(|(_, r)| !r.progress.pending(key.1).is_empty())
                .map(|(id, _)| *id),
        );
        victims.sort_unstable();
        victims.dedup();
        // nothing more of a failed transfer goes out on the other rails either
        for q in e.pairs.values_mut() {
            q.queue.retain(|p| victims.binary_search(&p.xfer).is_err());
        }
        for id in victims {
            let Some(run) = e.runs.remove(&id) else {
                continue;
            };
            if refused && run.grants.iter().any(Option::is_some) {
                let err = crate::agent::error::XferError::GrantRevoked {
                    peer: run.peer.to_string(),
                    why: why.to_owned(),
                };
                shared.finish(id, Err(err));
            } else {
                shared.xfer_failed(id, why.to_owned());
            }
        }
    }
}
