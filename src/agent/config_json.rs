//! An agent's configuration as JSON: what the C ABI and the Python package hand over.

use serde::Deserialize;

use super::config::MAX_TCP_CONNS;
use super::{config::AgentConfig, config::BackendChoice};
use crate::mem::ConfigError;

/// The accepted keys; anything else is refused, named.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ConfigJson {
    listen: Option<String>,
    side_channel_host: Option<String>,
    backend: Option<String>,
    stripe_width: Option<i64>,
    devices: Option<Vec<String>>,
    numa: Option<i32>,
    enforce_handshake_compat: Option<bool>,
    model: Option<String>,
    dtype: Option<String>,
    attn_backend: Option<String>,
    draft_model: Option<String>,
    kv_layout: Option<String>,
    block_size: Option<u32>,
    cluster_secret: Option<String>,
    insecure: Option<bool>,
    metrics_listen: Option<String>,
    gid_index: Option<u32>,
    mtu: Option<u32>,
    qps_per_rail: Option<u32>,
    tcp_conns: Option<u32>,
    progress_spin_us: Option<u32>,
    metadata_store: Option<String>,
    metadata_namespace: Option<String>,
    metadata_lease_ttl_s: Option<u64>,
    deregister_wait_ms: Option<u64>,
    accept_sent_metadata: Option<bool>,
}

fn bad(key: &str, why: impl std::fmt::Display) -> ConfigError {
    ConfigError {
        key: key.into(),
        reason: why.to_string(),
    }
}

impl AgentConfig {
    /// The configuration from a JSON object (empty text: the defaults). Keys: `listen`
    /// ("ip:port" of the side channel), `side_channel_host` (the address advertised to
    /// peers), `backend` ("auto", "verbs", "tcp"), `stripe_width` (null or 0), `devices`
    /// (RDMA devices to use), `numa` (the accelerator's NUMA node, -1 any),
    /// `enforce_handshake_compat`, and what the compatibility hash covers: `model`, `dtype`,
    /// `attn_backend`, `draft_model`, `kv_layout`, `block_size`; `cluster_secret` (at least
    /// 16 bytes; see [`AgentConfig::cluster_secret`]); `insecure` (see
    /// [`AgentConfig::insecure`]); `metrics_listen` ("ip:port" of the
    /// Prometheus endpoint, see [`AgentConfig::metrics_listen`]); `gid_index`, `mtu` (see
    /// [`AgentConfig::gid_index`], [`AgentConfig::mtu`]); `qps_per_rail` (1 to 16);
    /// `tcp_conns` (1 to 16, see [`AgentConfig::tcp_conns`]); `progress_spin_us` (see
    /// [`AgentConfig::progress_spin_us`]); `metadata_store` ("etcd://HOST:PORT[,…]"),
    /// `metadata_namespace`, `metadata_lease_ttl_s` (see [`AgentConfig::metadata_store`]);
    /// `deregister_wait_ms` (see [`AgentConfig::deregister_wait`]); `accept_sent_metadata`
    /// (see [`AgentConfig::accept_sent_metadata`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the key: an unknown key, a value of the wrong type, a bad
    /// address or backend name.
    pub fn from_json(json: &str) -> Result<Self, ConfigError> {
        let j: ConfigJson = if json.trim().is_empty() {
            ConfigJson::default()
        } else {
            serde_json::from_str(json).map_err(|e| {
                // serde names an unknown field in its message; say which key either way
                let m = e.to_string();
                let key = m
                    .strip_prefix("unknown field `")
                    .and_then(|r| r.split('`').next())
                    .unwrap_or("config");
                bad(key, m.clone())
            })?
        };
        let mut c = Self::default();
        if let Some(l) = j.listen {
            c.listen = l
                .parse()
                .map_err(|e| bad("listen", format!("{l:?}: {e}")))?;
        }
        if let Some(h) = j.side_channel_host {
            c.side_channel_host = h
                .parse()
                .map_err(|e| bad("side_channel_host", format!("{h:?}: {e}")))?;
        }
        if let Some(b) = j.backend {
            c.backend = match b.as_str() {
                "auto" => BackendChoice::Auto,
                "verbs" => BackendChoice::Verbs,
                "tcp" => BackendChoice::Tcp,
                o => return Err(bad("backend", format!("{o:?}: use auto, verbs or tcp"))),
            };
        }
        c.stripe_width = j.stripe_width;
        if let Some(d) = j.devices {
            c.devices = d;
        }
        if let Some(n) = j.numa {
            c.numa = n;
        }
        if let Some(e) = j.enforce_handshake_compat {
            c.enforce_handshake_compat = e;
        }
        let text = [
            (j.model, &mut c.compat.model),
            (j.dtype, &mut c.compat.dtype),
            (j.attn_backend, &mut c.compat.attn_backend),
            (j.kv_layout, &mut c.kv_layout),
        ];
        for (v, slot) in text {
            if let Some(v) = v {
                *slot = v;
            }
        }
        if j.draft_model.is_some() {
            c.compat.draft_model = j.draft_model;
        }
        if let Some(b) = j.block_size {
            if b == 0 {
                return Err(bad("block_size", "must be at least 1"));
            }
            c.block_size = b;
        }
        c.gid_index = j.gid_index;
        if let Some(s) = j.progress_spin_us {
            if s > 1_000_000 {
                return Err(bad(
                    "progress_spin_us",
                    format!("{s}: at most 1000000 (1 s)"),
                ));
            }
            c.progress_spin_us = s;
        }
        if let Some(q) = j.qps_per_rail {
            if !(1..=16).contains(&q) {
                return Err(bad("qps_per_rail", format!("{q}: use 1 to 16")));
            }
            c.qps_per_rail = q;
        }
        if let Some(ms) = j.deregister_wait_ms {
            c.deregister_wait = std::time::Duration::from_millis(ms);
        }
        if let Some(n) = j.tcp_conns {
            if !(1..=MAX_TCP_CONNS).contains(&n) {
                return Err(bad("tcp_conns", format!("{n}: use 1 to {MAX_TCP_CONNS}")));
            }
            c.tcp_conns = n;
        }
        if let Some(m) = j.mtu {
            if ![256, 512, 1024, 2048, 4096].contains(&m) {
                return Err(bad("mtu", format!("{m}: use 256, 512, 1024, 2048 or 4096")));
            }
            c.mtu = Some(m);
        }
        if let Some(m) = j.metrics_listen {
            c.metrics_listen = Some(
                m.parse()
                    .map_err(|e| bad("metrics_listen", format!("{m:?}: {e}")))?,
            );
        }
        c.metadata_store = crate::store::StoreConfig::from_keys(
            j.metadata_store.as_deref(),
            j.metadata_namespace.as_deref(),
            j.metadata_lease_ttl_s,
        )
        .map_err(|(k, why)| bad(k, why))?;
        if let Some(b) = j.insecure {
            c.insecure = b;
        }
        if let Some(b) = j.accept_sent_metadata {
            c.accept_sent_metadata = b;
        }
        if let Some(k) = j.cluster_secret {
            c.cluster_secret =
                Some(super::secret::ClusterSecret::new(k).map_err(|e| bad("cluster_secret", e))?);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_errors_name_the_key() {
        let c = AgentConfig::from_json(
            r#"{"backend":"tcp","listen":"127.0.0.1:0","model":"m","dtype":"bf16",
                "attn_backend":"a","draft_model":"d","block_size":32,"tcp_conns":4}"#,
        )
        .unwrap();
        assert_eq!(c.tcp_conns, 4);
        assert_eq!(c.backend, BackendChoice::Tcp);
        assert_eq!(
            (
                c.compat.model.as_str(),
                c.compat.dtype.as_str(),
                c.block_size
            ),
            ("m", "bf16", 32)
        );
        assert_eq!(c.compat.draft_model.as_deref(), Some("d"));
        assert!(AgentConfig::from_json("").is_ok());
        for (json, key) in [
            (r#"{"bogus":1}"#, "bogus"),
            (r#"{"backend":"ucx"}"#, "backend"),
            (r#"{"listen":"nope"}"#, "listen"),
            (r#"{"block_size":0}"#, "block_size"),
            (r#"{"tcp_conns":0}"#, "tcp_conns"),
            (r#"{"tcp_conns":17}"#, "tcp_conns"),
            (r#"{"cluster_secret":"short"}"#, "cluster_secret"),
            (r#"{"metadata_store":"redis://h:1"}"#, "metadata_store"),
            (r#"{"metadata_namespace":"n"}"#, "metadata_namespace"),
            ("[1]", "config"),
        ] {
            assert_eq!(AgentConfig::from_json(json).unwrap_err().key, key, "{json}");
        }
    }
}
