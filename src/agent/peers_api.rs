//! The agent's peers: its metadata, loading a peer's (over its side channel or as bytes),
//! forgetting one, and what is known of each.

use super::*;

impl Agent {
    /// This agent's metadata.
    pub fn metadata(&self) -> AgentMetadata {
        self.shared.metadata()
    }

    /// Fetch a peer's metadata from its side channel, check the handshake, and connect.
    /// Returns the peer's name. Load again after the peer registered more memory: the
    /// metadata is replaced and the connection kept.
    ///
    /// # Errors
    /// [`AgentError::Connection`] naming the address tried; [`AgentError::Handshake`]
    /// (including a loopback address advertised to a peer on another host);
    /// [`AgentError::Metadata`].
    pub fn load_remote(&self, addr: SocketAddr) -> Result<String, AgentError> {
        let r = crate::proto::handshake::check_advertised(self.shared.addr.ip(), addr.ip())
            .map_err(AgentError::from)
            .and_then(|()| {
                control::fetch_metadata(addr, self.shared.config.cluster_secret.as_ref())
            })
            .and_then(|bytes| self.load(&bytes, Some(addr)));
        if r.is_err() {
            self.shared.stats.handshake_failures.inc();
        }
        r
    }

    /// Load a peer's metadata given as bytes (exchanged some other way) and connect to the
    /// data address it advertises (or `via`, when given).
    ///
    /// # Errors
    /// As [`Agent::load_remote`].
    pub fn load_remote_metadata(
        &self,
        bytes: &[u8],
        via: Option<SocketAddr>,
    ) -> Result<String, AgentError> {
        let r = self.load(bytes, via);
        if r.is_err() {
            self.shared.stats.handshake_failures.inc();
        }
        r
    }

    pub(super) fn load(&self, bytes: &[u8], via: Option<SocketAddr>) -> Result<String, AgentError> {
        self.load_decoded(AgentMetadata::decode(bytes)?, via)
    }

    pub(super) fn load_decoded(
        &self,
        meta: AgentMetadata,
        via: Option<SocketAddr>,
    ) -> Result<String, AgentError> {
        crate::proto::handshake::check(
            &self.shared.handshake,
            &meta.handshake,
            self.shared.config.enforce_handshake_compat,
        )?;
        let addr: SocketAddr = match (via, meta.tcp_data.as_deref()) {
            (Some(a), _) => a,
            (None, Some(s)) => s.parse().map_err(|_| AgentError::Connection {
                what: "bad data address",
                addr: s.to_owned(),
                message: "not host:port".into(),
            })?,
            (None, None) => {
                return Err(AgentError::Unsupported(format!(
                    "peer {} has no TCP data address",
                    meta.name()
                )))
            }
        };
        crate::proto::handshake::check_advertised(self.shared.addr.ip(), addr.ip())?;
        let name = meta.name().to_owned();
        // One load of a peer at a time: two concurrent first loads would each connect, and the
        // second would close the first's connection with messages still on it.
        let serial = lock(&self.shared.loading)
            .entry(name.clone())
            .or_default()
            .clone();
        let _serial = lock(&serial);
        // Reloading a connected peer (after it registered more memory) keeps its connection.
        {
            let mut peers = lock(&self.shared.peers);
            if let Some(p) = peers.get_mut(&name) {
                if p.addr == addr && p.conn.is_open() {
                    p.meta = Arc::new(meta);
                    tracing::debug!(agent = %self.shared.name, peer = %name, "peer metadata reloaded");
                    return Ok(name);
                }
            }
        }
        let conn = control::PeerConn::connect(self.shared.clone(), addr, &name, &meta)?;
        tracing::info!(agent = %self.shared.name, peer = %name, %addr, "handshake done; peer connected");
        lock(&self.shared.grants).given.remove(&name);
        if let Some(old) = lock(&self.shared.peers).insert(
            name.clone(),
            Peer {
                meta: Arc::new(meta),
                conn,
                addr,
                epoch: self
                    .shared
                    .next_conn
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            },
        ) {
            old.conn.close();
        }
        Ok(name)
    }

    /// Forget a peer: what this agent queued for it is sent first (given up after 2 s
    /// without progress), then its connection closes and its
    /// in-progress transfers fail. A peer loaded by name is no longer followed in the
    /// metadata store (a restart is not loaded again).
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`].
    pub fn invalidate(&self, peer: &str) -> Result<(), AgentError> {
        self.unfollow(peer);
        // what this agent queued for the peer goes first (a READ's notification is queued
        // before the READ is done, and a caller may forget the peer as soon as it is)
        let writers = lock(&self.shared.peers)
            .get(peer)
            .map(|p| p.conn.writers())
            .unwrap_or_default();
        self.shared.flush_writers(writers, "invalidated");
        self.invalidate_because(peer, "peer metadata invalidated")
    }

    /// [`Agent::invalidate`], with the reason its failed transfers carry.
    pub(crate) fn invalidate_because(&self, peer: &str, why: &str) -> Result<(), AgentError> {
        let p = lock(&self.shared.peers)
            .remove(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.into()))?;
        // Fail its transfers first: closing the connection wakes its reader, which would
        // otherwise fail them with "closed by the peer" (a race the cause must not depend on).
        self.shared.fail_peer(peer, why);
        lock(&self.shared.grants).given.remove(peer);
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.remove_peer(&*self.shared, peer);
        }
        if let Some(b) = self.shared.bounce.get() {
            b.forget(peer);
        }
        p.conn.close();
        Ok(())
    }

    /// The metadata last loaded from `peer` (its regions, with the layers each holds).
    pub fn remote_metadata(&self, peer: &str) -> Option<Arc<AgentMetadata>> {
        lock(&self.shared.peers).get(peer).map(|p| p.meta.clone())
    }

    /// True while `peer` is loaded and its connection is up (false once the peer closed
    /// it, died, or was invalidated): a waiting caller can stop waiting for its answer.
    pub fn peer_connected(&self, peer: &str) -> bool {
        lock(&self.shared.peers)
            .get(peer)
            .is_some_and(|p| p.conn.is_open())
    }

    /// True while `peer` is connected and was loaded from `addr` (`host:port`): a peer that
    /// died, or came back at another address (restarted), must be loaded again.
    pub(crate) fn peer_connected_at(&self, peer: &str, addr: &str) -> bool {
        let Ok(addr) = addr.parse::<SocketAddr>() else {
            return false;
        };
        lock(&self.shared.peers)
            .get(peer)
            .is_some_and(|p| p.addr == addr && p.conn.is_open())
    }

    /// Names of the loaded peers.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = lock(&self.shared.peers).keys().cloned().collect();
        v.sort();
        v
    }
}
