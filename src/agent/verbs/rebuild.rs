//! Rebuilding a rail's queue pairs to a peer after they failed. A dead pair whose port is
//! ACTIVE again (and whose backoff has passed) gets a fresh queue pair; its endpoint goes to
//! the peer over the attach connection (`QpOpen`), the peer answers with its new endpoint
//! (`QpOpened`, answers come in request order), and the connected pair replaces the dead one.
//! Transfers posted from then on use the rail again.

use std::time::Instant;

use super::{lock, Verbs};
use crate::transport::verbs::{Access, ConnectOptions, Endpoint};

/// Queue pairs asked of a peer: (local rail, peer rail, endpoint of the local queue pair).
pub(crate) type QpRequest = Vec<(u32, u32, Endpoint)>;

impl Verbs {
    /// New queue pairs for the dead pairs on `rails` that are due for a rebuild and not
    /// being rebuilt already; returns the request to send to each peer.
    pub(super) fn start_rebuilds(&self, rails: &[usize]) -> Vec<(String, QpRequest)> {
        let mut e = lock(&self.engine);
        let now = Instant::now();
        let busy = |e: &super::Engine, peer: &str, rail: usize| {
            e.rebuilding
                .get(peer)
                .is_some_and(|q| q.iter().flatten().any(|(r, _, _)| *r == rail))
        };
        let mut due: Vec<(super::PairKey, usize)> = e
            .pairs
            .iter()
            .filter(|(k, q)| {
                q.dead.is_some()
                    && rails.contains(&k.1)
                    && e.retry.get(*k).is_none_or(|(t, _)| *t <= now)
                    && !busy(&e, &k.0, k.1)
                    // one kind of request out per peer: the answers carry no kind
                    && !e.chan_rebuilding.contains_key(&*k.0)
            })
            .map(|(k, q)| (k.clone(), q.peer_rail))
            .collect();
        // by peer, then rail: one request per peer, its rails in order
        due.sort_unstable_by(|(a, _), (b, _)| (&a.0, a.1).cmp(&(&b.0, b.1)));
        let mut out: Vec<(String, QpRequest)> = Vec::new();
        for (key, peer_rail) in due {
            if let Some((t, b)) = e.retry.get_mut(&key) {
                *t = now + *b; // no second attempt before this one is answered or times out
            }
            let (peer, rail) = (key.0.to_string(), key.1);
            let qp = match self.new_qp(rail, Access::NONE) {
                Ok(qp) => qp,
                Err(err) => {
                    tracing::warn!(rail = %self.rails[rail].name, %peer, error = %err, "cannot rebuild the queue pair");
                    continue;
                }
            };
            let ep = qp.endpoint();
            tracing::info!(rail = %self.rails[rail].name, %peer, "rail is ACTIVE again: rebuilding its queue pair");
            let q = e.rebuilding.entry(peer.clone()).or_default();
            match out.last_mut() {
                Some((p, req)) if *p == peer => {
                    req.push((rail as u32, peer_rail as u32, ep));
                    if let Some(last) = q.back_mut() {
                        last.push((rail, peer_rail, qp));
                    }
                }
                _ => {
                    out.push((peer.clone(), vec![(rail as u32, peer_rail as u32, ep)]));
                    q.push_back(vec![(rail, peer_rail, qp)]);
                }
            }
        }
        out
    }

    /// The peer answered the oldest rebuild request sent to it: connect the new queue pairs
    /// and put them in service, or keep the rails dead until the next attempt.
    pub(crate) fn rebuilt(&self, peer: &str, answer: Result<Vec<Endpoint>, String>) {
        if let Err(why) = &answer {
            // a refusal answers the channel request when that is the one out
            if lock(&self.engine).chan_rebuilding.contains_key(peer) {
                self.chan_rebuilt(peer, Err(why.clone()));
                return;
            }
        }
        let mut e = lock(&self.engine);
        let Some(list) = e.rebuilding.get_mut(peer).and_then(|q| q.pop_front()) else {
            tracing::warn!(%peer, "queue pair answer without a rebuild request; ignored");
            return;
        };
        let eps = match answer {
            Ok(eps) if eps.len() == list.len() => eps,
            Ok(eps) => {
                tracing::warn!(%peer, "rebuild: asked for {} queue pairs, got {}", list.len(), eps.len());
                return;
            }
            Err(why) => {
                tracing::warn!(%peer, error = %why, "rebuild refused by the peer");
                return;
            }
        };
        for ((rail, peer_rail, qp), ep) in list.into_iter().zip(eps) {
            match qp.connect(&ep, &ConnectOptions::default()) {
                Ok(()) => {
                    tracing::info!(rail = %self.rails[rail].name, %peer, "queue pair rebuilt; rail back in service");
                    e.install(peer, rail, peer_rail, qp);
                    if let Some(s) = self.stats.get() {
                        s.rebuilds[rail].inc();
                    }
                }
                Err(err) => {
                    tracing::warn!(rail = %self.rails[rail].name, %peer, error = %err, "rebuild: connect failed")
                }
            }
        }
    }
}
