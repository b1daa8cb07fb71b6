//! The agent's connection to the metadata store ([`crate::store`]), and what it loaded from
//! it; `store_api.rs` publishes this agent's metadata (at start and after every
//! registration change), loads peers by name, and follows the namespace watch — a peer whose key is deleted is invalidated (its transfers fail, its
//! connection closes); a peer whose key another incarnation wrote (another lease) is
//! invalidated and loaded again, so the next transfer goes to the new process. A transfer
//! naming a region the loaded metadata lacks asks the store for a newer revision first (the
//! watch lags a registration by milliseconds).

use super::error::AgentError;
#[cfg(not(feature = "etcd"))]
use crate::store::StoreError;

#[cfg(feature = "etcd")]
pub(crate) use with_etcd::AgentStore;

#[cfg(feature = "etcd")]
mod with_etcd {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    /// The store connection and what this agent loaded from it.
    pub(crate) struct AgentStore {
        pub(crate) etcd: crate::store::EtcdStore,
        /// Peers loaded by name: the lease (incarnation) and revision loaded.
        pub(crate) known: Mutex<HashMap<String, (i64, i64)>>,
        /// One gate a peer name: loads of one peer's metadata (the watch's, a load by name,
        /// a transfer's refresh) run one at a time, so an older revision loaded late cannot
        /// overwrite a newer one; loads of different peers do not wait for each other.
        pub(crate) adopting: Mutex<HashMap<String, Arc<Mutex<()>>>>,
        /// Peers loaded from partial metadata under a label: forgotten when their key goes
        /// (not loaded whole when it changes: they gave only some regions).
        pub(crate) labelled: Mutex<std::collections::HashSet<String>>,
    }
}

/// The store of a configuration, connected (None: none configured).
#[cfg(feature = "etcd")]
pub(crate) fn open(config: &super::config::AgentConfig) -> Result<Option<AgentStore>, AgentError> {
    let Some(c) = &config.metadata_store else {
        return Ok(None);
    };
    Ok(Some(AgentStore {
        etcd: crate::store::EtcdStore::connect(c)?,
        known: std::sync::Mutex::default(),
        adopting: std::sync::Mutex::default(),
        labelled: std::sync::Mutex::default(),
    }))
}

/// Without the `etcd` feature a configured store is refused.
#[cfg(not(feature = "etcd"))]
pub(crate) fn refuse_without_etcd(config: &super::config::AgentConfig) -> Result<(), AgentError> {
    match config.metadata_store {
        None => Ok(()),
        Some(_) => Err(StoreError::Unavailable(
            "metadata_store: this build has no etcd client (cargo feature `etcd`)".into(),
        )
        .into()),
    }
}
