//! The agent's use of the metadata store: publish this agent's metadata (at start and
//! after every registration change), load peers by name, and follow the namespace watch
//! (see `store.rs` for the connection).

use super::metadata::AgentMetadata;
#[cfg(feature = "etcd")]
use super::store::AgentStore;
use super::{error::AgentError, Agent, Shared};
use crate::store::StoreError;
#[cfg(feature = "etcd")]
use crate::threads::lock;

impl Shared {
    /// Write this agent's current metadata to the store (a failure is logged: the value is
    /// kept and written when the store returns).
    pub(crate) fn republish(&self) {
        #[cfg(feature = "etcd")]
        if let Some(s) = &self.store {
            let r = self
                .metadata()
                .encode()
                .map_err(|e| StoreError::Unavailable(e.to_string()))
                .and_then(|b| s.etcd.publish(&self.name, b));
            if let Err(e) = r {
                tracing::warn!(agent = %self.name, error = %e, "metadata not published now");
            }
        }
    }

    /// Take this agent's key out of the store (a clean stop).
    pub(crate) fn withdraw(&self) {
        #[cfg(feature = "etcd")]
        if let Some(s) = &self.store {
            s.etcd.withdraw();
        }
    }
}

impl Agent {
    /// Load peer `peer`, whose side channel is `addr` (`host:port`): by name through the
    /// store when this agent has one (the address is then not needed), else from `addr`.
    /// The error names what was tried.
    pub(crate) fn load_peer(&self, peer: &str, addr: &str) -> Result<(), String> {
        let name = if self.store_up().is_some() {
            self.load_by_name(peer).map_err(|e| e.to_string())?
        } else {
            let a = addr
                .parse::<std::net::SocketAddr>()
                .map_err(|e| format!("{addr}: {e}"))?;
            self.load_remote(a).map_err(|e| e.to_string())?
        };
        if name == peer {
            Ok(())
        } else {
            Err(format!("{addr} is agent {name:?}, expected {peer:?}"))
        }
    }

    /// Whether `peer` is loaded and current: connected (with a store, whose watch
    /// invalidates dead and replaced incarnations), or else connected at `addr` (a peer
    /// that came back elsewhere must be loaded again).
    pub(crate) fn peer_current(&self, peer: &str, addr: &str) -> bool {
        if self.store_up().is_some() {
            self.peer_connected(peer)
        } else {
            self.peer_connected_at(peer, addr)
        }
    }

    /// Stop reloading `peer` from the store (the caller invalidated it).
    pub(crate) fn unfollow(&self, peer: &str) {
        #[cfg(feature = "etcd")]
        if let Some(s) = &self.shared.store {
            lock(&s.known).remove(peer);
        }
        #[cfg(not(feature = "etcd"))]
        let _ = peer;
    }

    /// Publish, and start following the namespace (a helper thread applies its changes).
    #[cfg(feature = "etcd")]
    pub(crate) fn start_store(&self) -> Result<(), AgentError> {
        let Some(s) = &self.shared.store else {
            return Ok(());
        };
        let bytes = self
            .shared
            .metadata()
            .encode()
            .map_err(AgentError::Metadata)?;
        s.etcd.publish(&self.shared.name, bytes)?;
        let (tx, rx) = std::sync::mpsc::channel();
        s.etcd.watch(tx)?;
        let weak = self.downgrade();
        crate::threads::spawn(format!("kvrail-store-{}", self.shared.name), move || {
            for ev in rx {
                let Some(a) = weak.upgrade() else { return };
                a.on_store_event(ev);
            }
        })
        .map_err(|e| AgentError::Unsupported(format!("no thread for the store watch: {e}")))?;
        tracing::info!(agent = %self.shared.name, key = %s.etcd.config().key(&self.shared.name),
            "metadata published in the store");
        Ok(())
    }

    /// Load peer `name` by its name from the metadata store: fetch its metadata, check the
    /// handshake, connect (its side channel for the attach and queue pairs). The store's
    /// watch then keeps it current: when its key goes (crash, stop) it is invalidated;
    /// when a new incarnation publishes, it is invalidated and loaded again. Returns `name`.
    ///
    /// # Errors
    /// [`AgentError::Store`]: no store configured (`Unavailable`), etcd not answering
    /// (`Failed`), no such agent (`NotFound`); then as [`Agent::load_remote_metadata`].
    pub fn load_by_name(&self, name: &str) -> Result<String, AgentError> {
        #[cfg(feature = "etcd")]
        {
            let s = self.shared.store.as_ref().ok_or_else(|| {
                StoreError::Unavailable("this agent has no metadata_store configured".into())
            })?;
            let m = s
                .etcd
                .fetch(name)?
                .ok_or_else(|| StoreError::NotFound(name.into()))?;
            self.adopt(s, name, m)
        }
        #[cfg(not(feature = "etcd"))]
        Err(StoreError::Unavailable(format!(
            "cannot load {name:?} by name: this build has no etcd client (cargo feature `etcd`)"
        ))
        .into())
    }

    /// Publish partial metadata (from [`Agent::partial_metadata`]) in the metadata store
    /// under `label` (NIXL's `sendLocalPartialMD` without an address); it leaves with this
    /// agent's own key.
    ///
    /// # Errors
    /// [`AgentError::Store`]: no store, etcd not answering, a label that is empty, over 256
    /// bytes, or holds '/' or a control character.
    pub fn publish_partial(&self, label: &str, partial: &AgentMetadata) -> Result<(), AgentError> {
        check_label(label)?;
        let bytes = partial.encode()?;
        #[cfg(feature = "etcd")]
        {
            let s = self.shared.store.as_ref().ok_or_else(no_store)?;
            s.etcd.publish_label(&self.shared.name, label, bytes)?;
            Ok(())
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = bytes;
            Err(no_store().into())
        }
    }

    /// Load the partial metadata peer `name` published under `label` (NIXL's
    /// `fetchRemoteMD(name, label=…)`): its regions are added to what is known of it, and
    /// it is forgotten when its key leaves the store. Returns `name`.
    ///
    /// # Errors
    /// [`AgentError::Store`] (`NotFound`: nothing under that label); as
    /// [`Agent::load_partial_metadata`].
    pub fn load_label(&self, name: &str, label: &str) -> Result<String, AgentError> {
        check_label(label)?;
        #[cfg(feature = "etcd")]
        {
            let s = self.shared.store.as_ref().ok_or_else(no_store)?;
            let bytes = s
                .etcd
                .fetch_label(name, label)?
                .ok_or_else(|| StoreError::NotFound(format!("{name} (label {label:?})")))?;
            let got = self.load_partial_metadata(&bytes, true)?;
            if got != name {
                return Err(AgentError::Metadata(
                    crate::agent::metadata::MetadataError::Invalid {
                        agent: got,
                        reason: format!("published under the name {name:?}"),
                    },
                ));
            }
            lock(&s.labelled).insert(got.clone());
            Ok(got)
        }
        #[cfg(not(feature = "etcd"))]
        Err(StoreError::Unavailable(format!(
            "cannot load {name:?} by label: this build has no etcd client (cargo feature `etcd`)"
        ))
        .into())
    }

    /// Take this agent's metadata and labels out of the store, keeping its lease (NIXL's
    /// `invalidateLocalMD()`): peers following it forget it. [`Agent::publish_metadata`]
    /// (or the next registration change) puts it back.
    ///
    /// # Errors
    /// [`AgentError::Store`]: no store, or etcd not answering.
    pub fn unpublish_metadata(&self) -> Result<(), AgentError> {
        #[cfg(feature = "etcd")]
        {
            let s = self.shared.store.as_ref().ok_or_else(no_store)?;
            s.etcd.unpublish(&self.shared.name)?;
            Ok(())
        }
        #[cfg(not(feature = "etcd"))]
        Err(no_store().into())
    }

    /// Whether the metadata store answers (None: no store configured). While it is down,
    /// loaded peers keep working; loads by name fail and the agent's lease is not renewed.
    pub fn store_up(&self) -> Option<bool> {
        #[cfg(feature = "etcd")]
        return self.shared.store.as_ref().map(|s| s.etcd.is_up());
        #[cfg(not(feature = "etcd"))]
        None
    }

    /// The etcd lease (incarnation) peer `name` was loaded under from the store, if it was.
    pub fn peer_incarnation(&self, name: &str) -> Option<i64> {
        #[cfg(feature = "etcd")]
        return (self.shared.store.as_ref())
            .and_then(|s| lock(&s.known).get(name).map(|k| k.0))
            .filter(|&l| l != 0 && self.peer_connected(name));
        #[cfg(not(feature = "etcd"))]
        {
            let _ = name;
            None
        }
    }

    /// Load peer `peer`'s metadata again when the store holds a newer revision than the
    /// one loaded from it — a registration or a restart its watch has not delivered yet;
    /// whether it did. For a transfer naming what the loaded metadata lacks: the watch
    /// follows a peer within milliseconds, an engine's next request can come sooner.
    pub(crate) fn refresh_from_store(&self, peer: &str) -> bool {
        #[cfg(feature = "etcd")]
        {
            let Some(s) = &self.shared.store else {
                return false;
            };
            let Some((_, rev)) = lock(&s.known).get(peer).copied() else {
                return false;
            };
            match s.etcd.fetch(peer) {
                Ok(Some(m)) if m.revision > rev => self.adopt(s, peer, m).is_ok(),
                _ => false,
            }
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = peer;
            false
        }
    }

    /// Load `m` as peer `name`: a new incarnation (another lease) replaces the old one's
    /// connection and keys; an older revision than the one loaded is ignored.
    #[cfg(feature = "etcd")]
    fn adopt(
        &self,
        s: &AgentStore,
        name: &str,
        m: crate::store::StoredMetadata,
    ) -> Result<String, AgentError> {
        let gate = lock(&s.adopting)
            .entry(name.to_owned())
            .or_default()
            .clone();
        let _one_at_a_time = lock(&gate);
        let known = lock(&s.known).get(name).copied();
        if let Some((lease, rev)) = known {
            if m.revision < rev && self.peer_connected(name) {
                return Ok(name.to_owned());
            }
            if lease != m.lease {
                self.forget(name, "a new incarnation published its metadata (restarted)");
            }
        }
        let got = self.load(&m.bytes, None)?;
        if got != name {
            return Err(AgentError::Metadata(
                crate::agent::metadata::MetadataError::Invalid {
                    agent: got,
                    reason: format!("published under the name {name:?}"),
                },
            ));
        }
        lock(&s.known).insert(name.to_owned(), (m.lease, m.revision));
        Ok(got)
    }

    /// Apply one change of the namespace to the peers loaded by name.
    #[cfg(feature = "etcd")]
    fn on_store_event(&self, ev: crate::store::Event) {
        use crate::store::Event;
        let Some(s) = &self.shared.store else { return };
        match ev {
            Event::Put(name, m) => {
                let Some((_, rev)) = lock(&s.known).get(&name).copied() else {
                    return;
                };
                if m.revision <= rev {
                    return;
                }
                if let Err(e) = self.adopt(s, &name, m) {
                    tracing::warn!(agent = %self.shared.name, peer = %name, error = %e,
                        "metadata store: a peer's new metadata cannot be loaded");
                }
            }
            Event::Delete(name, rev) => {
                if lock(&s.labelled).remove(&name) {
                    self.forget(
                        &name,
                        "its metadata left the store (invalidated, crashed or stopped)",
                    );
                }
                // still followed (lease 0: none alive): the next incarnation is loaded
                let gone = {
                    let mut k = lock(&s.known);
                    match k.get_mut(&name) {
                        Some(e) if e.1 < rev => {
                            *e = (0, rev);
                            true
                        }
                        _ => false,
                    }
                };
                if gone {
                    self.forget(&name, "its metadata left the store (crashed or stopped)");
                }
            }
            Event::Resync => {
                let names: Vec<String> = lock(&s.known).keys().cloned().collect();
                for name in names {
                    match s.etcd.fetch(&name) {
                        Ok(Some(m)) => {
                            let _ = self.adopt(s, &name, m);
                        }
                        Ok(None) => {
                            if let Some(e) = lock(&s.known).get_mut(&name) {
                                e.0 = 0;
                            }
                            self.forget(&name, "its metadata left the store (crashed or stopped)");
                        }
                        Err(_) => {}
                    }
                }
            }
        }
    }

    /// Invalidate `peer` (if loaded) with a reason its failed transfers carry.
    #[cfg(feature = "etcd")]
    fn forget(&self, peer: &str, why: &str) {
        if self.invalidate_because(peer, why).is_ok() {
            tracing::info!(agent = %self.shared.name, peer, "peer invalidated: {why}");
        }
    }
}

fn no_store() -> StoreError {
    StoreError::Unavailable("this agent has no metadata_store configured".into())
}

/// A label as partial metadata is published under: 1 to 256 bytes, no '/' (it is a key
/// part), no control characters.
fn check_label(label: &str) -> Result<(), StoreError> {
    let ok = !label.is_empty()
        && label.len() <= 256
        && !label.contains('/')
        && !label.chars().any(char::is_control);
    if ok {
        Ok(())
    } else {
        Err(StoreError::Unavailable(format!(
            "label {label:?}: use 1 to 256 bytes, without '/' or control characters"
        )))
    }
}
