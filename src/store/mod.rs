//! Agent metadata through a metadata store (etcd, v3 API), next to the side channel.
//!
//! With a store configured, an agent publishes its metadata (the same msgpack its side
//! channel serves) under `<namespace>/agents/<name>`, attached to an etcd lease it keeps
//! alive: a crashed agent's key disappears by itself when the lease runs out, a dropped one
//! revokes it at once. Peers load it by name ([`crate::agent::Agent::load_by_name`]) and
//! watch the key: a deleted key (crash, shutdown) invalidates the peer, a key written by a
//! new incarnation (another etcd lease: a restart) invalidates it and loads the new one, so
//! no transfer posts into a dead incarnation's connection or keys. The side channel stays
//! for what the store cannot carry: the attach handshake and the queue-pair exchange.
//!
//! The etcd client (`etcd-client`, on a small Tokio runtime of its own) is behind the
//! `etcd` cargo feature; without it a configured store is refused at agent start.

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
pub(crate) use etcd::Event;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdStore, StoredMetadata};

use std::time::Duration;

/// Where agent metadata is kept: an etcd cluster, a key namespace, and the lease TTL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// etcd client endpoints (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix (default `kvrail`): agents live under `<namespace>/agents/`.
    pub namespace: String,
    /// How long a crashed agent's key outlives it (the etcd lease TTL; the agent renews it
    /// every third of that). Default 10 s.
    pub lease_ttl: Duration,
}

/// The default namespace.
pub const DEFAULT_NAMESPACE: &str = "kvrail";
/// The default lease TTL.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// A metadata-store URL that is not `etcd://HOST:PORT[,HOST:PORT…]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreUrlError {
    /// Neither `etcd://` nor `http://`.
    #[error("{0:?}: use etcd://HOST:PORT[,HOST:PORT...]")]
    Scheme(String),
    /// One of its endpoints is not `HOST:PORT` (a port of 1-65535).
    #[error("{url:?}: {part:?} is not HOST:PORT")]
    NotHostPort {
        /// The URL.
        url: String,
        /// The endpoint at fault.
        part: String,
    },
}

impl StoreConfig {
    /// A store from its URL: `etcd://HOST:PORT[,HOST:PORT…]` (or `http://HOST:PORT`), with
    /// the default namespace and lease TTL.
    ///
    /// # Errors
    /// [`StoreUrlError`] when the URL is not of that form.
    pub fn from_url(url: &str) -> Result<Self, StoreUrlError> {
        let rest = url
            .strip_prefix("etcd://")
            .or_else(|| url.strip_prefix("http://"))
            .ok_or_else(|| StoreUrlError::Scheme(url.to_owned()))?;
        let mut endpoints = Vec::new();
        for hp in rest.trim_end_matches('/').split(',') {
            let not_host_port = || StoreUrlError::NotHostPort {
                url: url.to_owned(),
                part: hp.to_owned(),
            };
            let (host, port) = hp.rsplit_once(':').ok_or_else(not_host_port)?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(not_host_port());
            }
            endpoints.push(format!("http://{hp}"));
        }
        Ok(Self {
            endpoints,
            namespace: DEFAULT_NAMESPACE.into(),
            lease_ttl: DEFAULT_LEASE_TTL,
        })
    }

    /// A store from configuration keys: `metadata_store` (the URL; None: no store),
    /// `metadata_namespace`, `metadata_lease_ttl_s`. The namespace and TTL without a URL
    /// are refused (they would silently do nothing).
    ///
    /// # Errors
    /// The key at fault and why.
    pub fn from_keys(
        url: Option<&str>,
        namespace: Option<&str>,
        lease_ttl_s: Option<u64>,
    ) -> Result<Option<Self>, (&'static str, String)> {
        let Some(url) = url else {
            return match (namespace, lease_ttl_s) {
                (Some(_), _) => Err(("metadata_namespace", "needs metadata_store".into())),
                (_, Some(_)) => Err(("metadata_lease_ttl_s", "needs metadata_store".into())),
                _ => Ok(None),
            };
        };
        let mut c = Self::from_url(url).map_err(|e| ("metadata_store", e.to_string()))?;
        if let Some(ns) = namespace {
            ns.clone_into(&mut c.namespace);
        }
        if let Some(t) = lease_ttl_s {
            c.lease_ttl = Duration::from_secs(t);
        }
        c.check()?;
        Ok(Some(c))
    }

    /// Checks the namespace and TTL (what a configuration key may have set).
    ///
    /// # Errors
    /// The key at fault and why.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let ns = &self.namespace;
        if ns.is_empty()
            || ns.len() > 128
            || !ns
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
        {
            return Err((
                "metadata_namespace",
                format!("{ns:?}: 1 to 128 of [A-Za-z0-9-_./]"),
            ));
        }
        let ttl = self.lease_ttl.as_secs();
        if !(2..=3600).contains(&ttl) {
            return Err(("metadata_lease_ttl_s", format!("{ttl}: use 2 to 3600")));
        }
        Ok(())
    }

    /// The key prefix every agent of the namespace is under.
    pub fn prefix(&self) -> String {
        format!("{}/agents/", self.namespace)
    }

    /// The key agent `name` publishes under.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix())
    }

    /// The key of the partial metadata agent `name` publishes under `label` (outside the
    /// agents' prefix, which the namespace watch follows); with an empty label, the prefix
    /// of all of its labels.
    pub fn label_key(&self, name: &str, label: &str) -> String {
        format!("{}/labels/{name}/{label}", self.namespace)
    }
}

/// What went wrong with the metadata store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No etcd answered at start (the endpoints as configured).
    #[error("metadata store: etcd at {endpoints} is unreachable: {message}")]
    Unreachable {
        /// The endpoints tried.
        endpoints: String,
        /// The client's words.
        message: String,
    },
    /// The store failed while running (lost, or refused an operation).
    #[error("metadata store: {op} failed: {message}")]
    Failed {
        /// What was being done.
        op: &'static str,
        /// The client's words.
        message: String,
    },
    /// No agent of that name is published.
    #[error("metadata store: no agent {0:?} is published (not started, crashed and expired, or another namespace)")]
    NotFound(String),
    /// This agent has no store configured, or this build has no etcd client.
    #[error("metadata store: {0}")]
    Unavailable(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_namespaces_and_ttls() {
        let c = StoreConfig::from_url("etcd://127.0.0.1:2379,etcd-b:2380").unwrap();
        assert_eq!(c.endpoints, ["http://127.0.0.1:2379", "http://etcd-b:2380"]);
        assert_eq!(c.key("p-0"), "kvrail/agents/p-0");
        assert!(c.check().is_ok());
        for bad in [
            "",
            "127.0.0.1:2379",
            "etcd://",
            "etcd://h",
            "etcd://h:0",
            "etcd://:1",
        ] {
            assert!(StoreConfig::from_url(bad).is_err(), "{bad}");
        }
        let mut c2 = c.clone();
        c2.namespace = "a b".into();
        assert_eq!(c2.check().unwrap_err().0, "metadata_namespace");
        let mut c3 = c;
        c3.lease_ttl = Duration::from_secs(1);
        assert_eq!(c3.check().unwrap_err().0, "metadata_lease_ttl_s");
        let k = StoreConfig::from_keys(Some("etcd://h:1"), Some("ns-1"), Some(3))
            .unwrap()
            .unwrap();
        assert_eq!(
            (k.key("a"), k.lease_ttl.as_secs()),
            ("ns-1/agents/a".into(), 3)
        );
        assert_eq!(StoreConfig::from_keys(None, None, None), Ok(None));
        for (u, n, t, key) in [
            (None, Some("x"), None, "metadata_namespace"),
            (None, None, Some(5), "metadata_lease_ttl_s"),
            (Some("tcp://h:1"), None, None, "metadata_store"),
            (Some("etcd://h:1"), Some(""), None, "metadata_namespace"),
            (Some("etcd://h:1"), None, Some(0), "metadata_lease_ttl_s"),
        ] {
            assert_eq!(StoreConfig::from_keys(u, n, t).unwrap_err().0, key);
        }
    }
}
