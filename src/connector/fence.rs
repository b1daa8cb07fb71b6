//! Fencing of the KV cache peers reach (`fence_blocks`): the grants a worker makes over a
//! request's blocks, answered to the peers that ask, and revoked when the blocks go back to
//! the engine.
//!
//! - Pull, P: a grant (READ) over the request's blocks is made when the lease is pinned; D
//!   ranks ask for it (`GRANT_REQ:`) and get it (`GRANT:`), or hear why not
//!   (`GRANT_NONE:`). When the lease ends (completion, expiry) the grant is revoked before
//!   the blocks are reported free, so a READ that comes later fails on the NIC.
//! - Push, D: a grant (WRITE) over D's blocks travels in the `PUSH_REG`; it is revoked when
//!   D takes the blocks back (received, failed, withdrawn), so a P that WRITEs late fails.
//!
//! The peer accepts a grant only around the post that uses it (the posted transfer keeps
//! its keys), so nothing is kept per request on the using side.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::layout::{KvLayout, LayerAt};
use super::recent::Recent;
use crate::agent::{Agent, Desc, RemoteAccess, XferId, XferOp};
use crate::proto::kvmsg::{GrantMsg, GrantNone, GrantReq};

/// Recently freed requests remembered to answer a late `GRANT_REQ` at once.
const FREED_MEMORY: usize = 4096;
/// Questions about requests not granted yet, held at most (more are refused at once).
const MAX_ASKED: usize = 4096;

/// A `GRANT_REQ` for a request not granted (yet): answered when it is, or refused at
/// `until`.
struct Asked {
    request: String,
    peer: String,
    host: String,
    port: u16,
    until: Instant,
}

/// An answer to send to a peer once connected to it: (peer, host, port, message).
pub(crate) type Reply = (String, String, u16, Vec<u8>);

/// A worker's grants.
pub(crate) struct Fence {
    /// This worker's cache is fenced.
    pub(crate) on: bool,
    /// Grants made, by request id: (grant id, token).
    made: HashMap<String, (u64, Vec<u8>)>,
    /// Requests whose grant could not be made, and why.
    failed: HashMap<String, String>,
    asked: Vec<Asked>,
    freed: Recent,
}

/// Every byte of `blocks` (physical ids) in every layer: all planes of each block.
fn block_descs(layout: &KvLayout, layers: &[LayerAt], blocks: &[u64]) -> Vec<Desc> {
    let mut v = Vec::with_capacity(layers.len() * blocks.len() * layout.planes as usize);
    for at in layers {
        for p in 0..layout.planes {
            for &b in blocks {
                let off = at.base + layout.offset(p, b);
                v.push(Desc::new(at.region, off, layout.block_bytes));
            }
        }
    }
    v
}

impl Fence {
    pub(crate) fn new(on: bool) -> Self {
        Self {
            on,
            made: HashMap::new(),
            failed: HashMap::new(),
            asked: Vec::new(),
            freed: Recent::new(FREED_MEMORY),
        }
    }

    /// Grant `access` over `blocks` (physical ids) of every layer for `request`: its token,
    /// or why not (also kept, for the peers that ask).
    pub(crate) fn grant(
        &mut self,
        agent: &Agent,
        (layout, layers): (&KvLayout, &[LayerAt]),
        request: &str,
        blocks: &[u64],
        access: RemoteAccess,
    ) -> Result<Vec<u8>, String> {
        if let Some((_, token)) = self.made.get(request) {
            return Ok(token.clone());
        }
        if let Some(b) = blocks.iter().find(|b| **b >= layout.num_blocks) {
            let why = format!(
                "block id {b} is past the cache's {} blocks",
                layout.num_blocks
            );
            self.failed.insert(request.to_owned(), why.clone());
            return Err(why);
        }
        match agent.grant(&block_descs(layout, layers, blocks), access) {
            Ok(g) => {
                let token = g.encode();
                self.made.insert(request.to_owned(), (g.id, token.clone()));
                Ok(token)
            }
            Err(e) => {
                let why = e.to_string();
                self.failed.insert(request.to_owned(), why.clone());
                Err(why)
            }
        }
    }

    /// P (or D keeping blocks for a read-back): a peer asks for `r`'s grant. The answer to
    /// send now, or None when the request is not granted yet (answered by [`Fence::due`]
    /// when it is, or refused after `wait`). Every answer carries this worker's clock,
    /// `clock_us`, for the asker's offset.
    pub(crate) fn answer(
        &mut self,
        peer: &str,
        r: GrantReq,
        (now, clock_us): (Instant, i64),
        wait: Duration,
    ) -> Option<Reply> {
        let reply = |m: Vec<u8>| Some((peer.to_owned(), r.host.clone(), r.port, m));
        if !self.on {
            return reply(none(
                &r.request_id,
                "this P does not fence its blocks",
                clock_us,
            ));
        }
        if let Some(m) = self.settled(&r.request_id, clock_us) {
            return reply(m);
        }
        if self.asked.len() >= MAX_ASKED {
            return reply(none(
                &r.request_id,
                "too many questions about unknown requests",
                clock_us,
            ));
        }
        self.asked.push(Asked {
            request: r.request_id,
            peer: peer.to_owned(),
            host: r.host,
            port: r.port,
            until: now + wait,
        });
        None
    }

    /// The answer about `request` if there is one: its grant, why it has none, or that its
    /// blocks were given back.
    fn settled(&self, request: &str, clock_us: i64) -> Option<Vec<u8>> {
        if let Some((_, token)) = self.made.get(request) {
            return Some(
                GrantMsg {
                    request_id: request.to_owned(),
                    token: token.clone(),
                    clock_us: Some(clock_us),
                }
                .encode(),
            );
        }
        if let Some(why) = self.failed.get(request) {
            let why = format!("no grant could be made: {why}");
            return Some(none(request, &why, clock_us));
        }
        if self.freed.contains(request) {
            let why = "its blocks were given back (lease over)";
            return Some(none(request, why, clock_us));
        }
        None
    }

    /// P: questions that can be answered now (granted since, or waited too long).
    pub(crate) fn due(&mut self, (now, clock_us): (Instant, i64)) -> Vec<Reply> {
        let mut out = Vec::new();
        let mut keep = Vec::new();
        for a in std::mem::take(&mut self.asked) {
            match self.settled(&a.request, clock_us) {
                Some(m) => out.push((a.peer, a.host, a.port, m)),
                None if now >= a.until => {
                    let m = none(&a.request, "this P rank holds no blocks of it", clock_us);
                    out.push((a.peer, a.host, a.port, m));
                }
                None => keep.push(a),
            }
        }
        self.asked = keep;
        out
    }

    /// The blocks of `requests` went back to the engine: revoke their grants first.
    pub(crate) fn release<'a>(
        &mut self,
        agent: &Agent,
        requests: impl Iterator<Item = &'a String>,
    ) {
        for id in requests {
            self.failed.remove(id);
            let Some((grant, _)) = self.made.remove(id) else {
                continue;
            };
            if let Err(e) = agent.revoke(grant) {
                tracing::error!(request = %id, error = %e, "grant not revoked");
            }
            self.freed.insert(id);
        }
    }

    /// Grants not revoked yet.
    pub(crate) fn live(&self) -> usize {
        self.made.len()
    }
}

fn none(request: &str, reason: &str, clock_us: i64) -> Vec<u8> {
    GrantNone {
        request_id: request.to_owned(),
        reason: reason.to_owned(),
        clock_us: Some(clock_us),
    }
    .encode()
}

/// A transfer to post to a peer whose memory may be fenced.
pub(crate) struct Post<'a> {
    pub(crate) op: XferOp,
    pub(crate) local: Vec<Desc>,
    pub(crate) peer: &'a str,
    pub(crate) remote: Vec<Desc>,
    pub(crate) notif: Option<Vec<u8>>,
    /// The peer's grant over `remote` (its memory is fenced), if any.
    pub(crate) token: Option<&'a [u8]>,
}

/// Create and post `p`, through its grant when it has one: the grant is accepted for this
/// post only (the posted transfer keeps its keys). A transfer whose post fails is released.
///
/// # Errors
/// A token that does not decode or fit the peer; what creating or posting returns.
pub(crate) fn post(agent: &Agent, p: Post<'_>) -> Result<XferId, String> {
    let grant = match p.token {
        Some(t) => {
            let g = crate::agent::Grant::decode(t).map_err(|e| e.to_string())?;
            let id = g.id;
            (agent.accept_grant(p.peer, g))
                .map_err(|e| format!("the grant from {}: {e}", p.peer))?;
            Some(id)
        }
        None => None,
    };
    let r = agent
        .create_xfer(p.op, p.local, p.peer, p.remote, p.notif)
        .map_err(|e| e.to_string())
        .and_then(|x| match agent.post(x) {
            Ok(()) => Ok(x),
            Err(e) => {
                let _ = agent.release(x);
                Err(e.to_string())
            }
        });
    if let Some(id) = grant {
        agent.forget_grant(p.peer, id);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::kvmsg::KvMsg;

    fn ask(id: &str) -> GrantReq {
        GrantReq {
            request_id: id.into(),
            host: "127.0.0.1".into(),
            port: 9,
        }
    }

    fn kind(m: &[u8]) -> KvMsg {
        KvMsg::decode(m).unwrap()
    }

    #[test]
    fn questions_wait_for_the_grant_or_the_bound_and_are_bounded() {
        let t0 = Instant::now();
        let wait = Duration::from_secs(30);
        let mut f = Fence::new(true);
        // not granted yet: held, then answered once it is
        assert!(f.answer("d", ask("a"), (t0, 5), wait).is_none());
        f.made.insert("a".into(), (7, b"token".to_vec()));
        let due = f.due((t0, 5));
        assert_eq!(due.len(), 1);
        // (every answer carries the answering worker's clock)
        assert!(
            matches!(kind(&due[0].3), KvMsg::Grant(g) if g.token == b"token" && g.clock_us == Some(5))
        );
        // never granted: refused once the bound passed, not before
        assert!(f.answer("d", ask("b"), (t0, 5), wait).is_none());
        assert!(f.due((t0 + Duration::from_secs(29), 5)).is_empty());
        let due = f.due((t0 + wait, 5));
        assert!(
            matches!(kind(&due[0].3), KvMsg::GrantNone(n) if n.reason.contains("holds no blocks"))
        );
        // a flood of questions about unknown requests is bounded
        for i in 0..MAX_ASKED {
            assert!(f
                .answer("x", ask(&format!("u{i}")), (t0, 5), wait)
                .is_none());
        }
        let r = f
            .answer("x", ask("one-more"), (t0, 5), wait)
            .expect("refused at once");
        assert!(matches!(kind(&r.3), KvMsg::GrantNone(n) if n.reason.contains("too many")));
        // an unfenced worker says so
        let mut off = Fence::new(false);
        let r = off.answer("d", ask("a"), (t0, 5), wait).unwrap();
        assert!(
            matches!(kind(&r.3), KvMsg::GrantNone(n) if n.reason.contains("does not fence") && n.clock_us == Some(5))
        );
    }
}
