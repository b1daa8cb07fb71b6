//! `kv_transfer_config`: the engine's `--kv-transfer-config` JSON (SPEC §4), parsed and
//! validated. Every rejection names the key (`kv_connector_extra_config.chunk_tokens: …`).

use serde_json::{Map, Value};

use crate::mem::{ConfigError, KvBufferDevice};
use crate::proto::handshake::Direction;

/// `kv_role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRole {
    /// Prefill: produces KV.
    Producer,
    /// Decode: consumes KV.
    Consumer,
    /// Both.
    Both,
}

/// A validated `kv_transfer_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransferConfig {
    /// Pull (`KvrailPullConnector`, alias `KvrailConnector`) or push (`KvrailPushConnector`);
    /// part of the compatibility hash, so pull and push instances refuse to pair.
    pub direction: Direction,
    /// `kv_role`.
    pub role: KvRole,
    /// `kv_buffer_device` (default `rbln`).
    pub buffer_device: KvBufferDevice,
    /// `engine_id`.
    pub engine_id: Option<String>,
    /// `kv_lease_duration`, seconds (default 30).
    pub lease_duration_s: u64,
    /// `decoder_kv_blocks_ttl`, seconds (default 480): with `bidirectional_kv_xfer`, how
    /// long D keeps a finished request's blocks for the next turn to read back (NixlConnector's
    /// meaning); also the default of `push_registration_timeout`, as NixlConnector's.
    pub decoder_kv_blocks_ttl_s: u64,
    /// `bidirectional_kv_xfer` (default false): multi-turn KV reuse (seed 003). D keeps the
    /// blocks of a request it decoded to the end for `decoder_kv_blocks_ttl` and returns
    /// parameters naming them; the next turn sent to P with them reads that KV back from D.
    pub bidirectional_kv_xfer: bool,
    /// `kv_recompute_threshold`, tokens (default 64): a read-back of fewer tokens than this
    /// is not worth a transfer; P computes them.
    pub kv_recompute_threshold: u64,
    /// `push_registration_timeout`, seconds (default `decoder_kv_blocks_ttl`).
    pub push_registration_timeout_s: u64,
    /// `chunk_mode`.
    pub chunk_mode: bool,
    /// `chunk_tokens` (unset: one prefill step, `max_num_batched_tokens`).
    pub chunk_tokens: Option<u64>,
    /// `max_num_batched_tokens`: tokens of one prefill step (the engine's scheduler setting;
    /// the Python connector fills it in from vLLM's; default 8192).
    pub max_num_batched_tokens: u64,
    /// `swa_window_mode`.
    pub swa_window_mode: bool,
    /// `push_stream`.
    pub push_stream: bool,
    /// `stripe_width`: unset (one rail per transfer) or 0 (all shared rails).
    pub stripe_width: Option<i64>,
    /// `link_down_exit_s` (0: never exit).
    pub link_down_exit_s: u64,
    /// `enforce_handshake_compat` (default true).
    pub enforce_handshake_compat: bool,
    /// `fence_blocks` (default true): the KV cache peers reach (P's in pull mode, D's in
    /// push mode) is fenced, reachable only through per-request grants revoked when the
    /// blocks are given back (host memory; NPU caches move through the host bounce, which
    /// checks access itself).
    pub fence_blocks: bool,
    /// `cluster_secret`: the side channel's shared secret (see
    /// [`crate::agent::AgentConfig::cluster_secret`]).
    pub cluster_secret: Option<crate::agent::ClusterSecret>,
    /// `insecure` (default false): with no `cluster_secret`, serve peers beyond loopback
    /// unauthenticated (see [`crate::agent::AgentConfig::insecure`]).
    pub insecure: bool,
    /// `metadata_store`, `metadata_namespace`, `metadata_lease_ttl_s`: agent metadata
    /// through etcd (see [`crate::store`]); D then finds P's ranks by P's engine id alone.
    pub metadata_store: Option<crate::store::StoreConfig>,
}

const TOP: &[&str] = &[
    "kv_connector",
    "kv_role",
    "kv_buffer_device",
    "engine_id",
    "kv_connector_extra_config",
];
/// vLLM's own `kv_transfer_config` keys: accepted (vLLM sets them), not used by kvrail.
const VLLM_KEYS: &[&str] = &[
    "kv_connector_module_path",
    "kv_buffer_size",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_load_failure_policy",
    "enable_permute_local_kv",
];
const EXTRA: &[&str] = &[
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "bidirectional_kv_xfer",
    "kv_recompute_threshold",
    "push_registration_timeout",
    "chunk_mode",
    "chunk_tokens",
    "max_num_batched_tokens",
    "kvrail_agent_config",
    "swa_window_mode",
    "push_stream",
    "stripe_width",
    "link_down_exit_s",
    "enforce_handshake_compat",
    "cluster_secret",
    "insecure",
    "fence_blocks",
    "metadata_store",
    "metadata_namespace",
    "metadata_lease_ttl_s",
];

/// One prefill step's tokens when the engine does not say (vLLM's V1 default for serving).
const DEFAULT_BATCHED_TOKENS: u64 = 8192;

fn err(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.to_owned(),
        reason: reason.into(),
    }
}

fn unknown(obj: &Map<String, Value>, known: &[&str], prefix: &str) -> Result<(), ConfigError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(err(
            &format!("{prefix}{k}"),
            format!("unknown key (accepted: {})", known.join(", ")),
        )),
    }
}

fn string<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    name: &str,
) -> Result<Option<&'a str>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(err(name, format!("{v} is not a string"))),
    }
}

fn boolean(
    obj: &Map<String, Value>,
    key: &str,
    name: &str,
    default: bool,
) -> Result<bool, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(err(name, format!("{v} is not true or false"))),
    }
}

/// A non-negative integer; `positive` refuses 0.
fn count(
    obj: &Map<String, Value>,
    key: &str,
    name: &str,
    positive: bool,
) -> Result<Option<u64>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(0) if positive => Err(err(name, "must be greater than 0")),
            Some(n) => Ok(Some(n)),
            None => Err(err(
                name,
                format!(
                    "{v} is not a {} integer",
                    if positive { "positive" } else { "non-negative" }
                ),
            )),
        },
    }
}

impl KvTransferConfig {
    /// Parse and validate the JSON text.
    ///
    /// # Errors
    /// [`ConfigError`] naming the key: unknown keys (at the top and in
    /// `kv_connector_extra_config`), wrong types, values out of range, and combinations the
    /// connector refuses (`link_down_exit_s` without `kv_producer`; `chunk_mode`,
    /// `swa_window_mode`, `push_stream` with host bounce; `push_stream` in pull mode;
    /// `stripe_width` other than 0).
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| err("kv_transfer_config", format!("not JSON: {e}")))?;
        let Value::Object(top) = v else {
            return Err(err("kv_transfer_config", "must be a JSON object"));
        };
        let known: Vec<&str> = TOP.iter().chain(VLLM_KEYS).copied().collect();
        unknown(&top, &known, "")?;
        let direction = match string(&top, "kv_connector", "kv_connector")? {
            Some("KvrailPullConnector" | "KvrailConnector") => Direction::Pull,
            Some("KvrailPushConnector") => Direction::Push,
            Some(o) => {
                return Err(err(
                    "kv_connector",
                    format!(
                        "{o:?} is not KvrailPullConnector, KvrailPushConnector or KvrailConnector"
                    ),
                ))
            }
            None => return Err(err("kv_connector", "required")),
        };
        let role = match string(&top, "kv_role", "kv_role")? {
            Some("kv_producer") => KvRole::Producer,
            Some("kv_consumer") => KvRole::Consumer,
            Some("kv_both") => KvRole::Both,
            Some(o) => {
                return Err(err(
                    "kv_role",
                    format!("{o:?} is not kv_producer, kv_consumer or kv_both"),
                ))
            }
            None => return Err(err("kv_role", "required when a connector is set")),
        };
        let buffer_device = match string(&top, "kv_buffer_device", "kv_buffer_device")? {
            None => KvBufferDevice::Rbln,
            Some(s) => KvBufferDevice::parse(s)?,
        };
        let engine_id = string(&top, "engine_id", "engine_id")?.map(str::to_owned);
        let empty = Map::new();
        let extra = match top.get("kv_connector_extra_config") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(v) => {
                return Err(err(
                    "kv_connector_extra_config",
                    format!("{v} is not a JSON object"),
                ))
            }
        };
        let x = |k: &str| format!("kv_connector_extra_config.{k}");
        unknown(extra, EXTRA, "kv_connector_extra_config.")?;
        let lease = count(extra, "kv_lease_duration", &x("kv_lease_duration"), true)?.unwrap_or(30);
        let ttl = count(
            extra,
            "decoder_kv_blocks_ttl",
            &x("decoder_kv_blocks_ttl"),
            true,
        )?
        .unwrap_or(480);
        let reg_timeout = count(
            extra,
            "push_registration_timeout",
            &x("push_registration_timeout"),
            true,
        )?
        .unwrap_or(ttl);
        let bidirectional = boolean(
            extra,
            "bidirectional_kv_xfer",
            &x("bidirectional_kv_xfer"),
            false,
        )?;
        let recompute_threshold = count(
            extra,
            "kv_recompute_threshold",
            &x("kv_recompute_threshold"),
            false,
        )?
        .unwrap_or(64);
        let chunk_mode = boolean(extra, "chunk_mode", &x("chunk_mode"), false)?;
        let chunk_tokens = count(extra, "chunk_tokens", &x("chunk_tokens"), true)?;
        // the Python connector's agent settings (listen, backend, devices, …): an object,
        // read by the package, which checks its keys
        if let Some(v) = extra.get("kvrail_agent_config") {
            if !v.is_object() {
                return Err(err(
                    &x("kvrail_agent_config"),
                    format!("{v} is not a JSON object of agent keys"),
                ));
            }
        }
        let step = count(
            extra,
            "max_num_batched_tokens",
            &x("max_num_batched_tokens"),
            true,
        )?
        .unwrap_or(DEFAULT_BATCHED_TOKENS);
        let swa = boolean(extra, "swa_window_mode", &x("swa_window_mode"), false)?;
        let push_stream = boolean(extra, "push_stream", &x("push_stream"), false)?;
        let stripe_width = match extra.get("stripe_width") {
            None | Some(Value::Null) => None,
            Some(v) if v.as_i64() == Some(0) => Some(0),
            Some(v) => {
                return Err(err(
                    &x("stripe_width"),
                    format!("{v} is not accepted: leave it unset (one rail per transfer) or 0 (every shared rail)"),
                ))
            }
        };
        let link_down =
            count(extra, "link_down_exit_s", &x("link_down_exit_s"), false)?.unwrap_or(0);
        let compat = boolean(
            extra,
            "enforce_handshake_compat",
            &x("enforce_handshake_compat"),
            true,
        )?;
        let fence_blocks = boolean(extra, "fence_blocks", &x("fence_blocks"), true)?;
        let cluster_secret = match extra.get("cluster_secret") {
            None | Some(Value::Null) => None,
            Some(Value::String(k)) => Some(
                crate::agent::ClusterSecret::new(k.as_bytes())
                    .map_err(|e| err(&x("cluster_secret"), e.to_string()))?,
            ),
            Some(_) => return Err(err(&x("cluster_secret"), "not a string")),
        };
        let insecure = boolean(extra, "insecure", &x("insecure"), false)?;
        let metadata_store = crate::store::StoreConfig::from_keys(
            string(extra, "metadata_store", &x("metadata_store"))?,
            string(extra, "metadata_namespace", &x("metadata_namespace"))?,
            count(
                extra,
                "metadata_lease_ttl_s",
                &x("metadata_lease_ttl_s"),
                true,
            )?,
        )
        .map_err(|(k, why)| err(&x(k), why))?;
        if link_down > 0 && role != KvRole::Producer {
            return Err(err(
                &x("link_down_exit_s"),
                "only with kv_role kv_producer (a decode instance keeps its requests and is \
                 replaced from outside)",
            ));
        }
        // (push_stream moves whole blocks as prefill closes them, from and into the
        // engine's own cache registered in place: host memory as well as an NPU's; the
        // partial modes stay on the device path they were specified for)
        let d2d = buffer_device == KvBufferDevice::Rbln;
        for (on, key) in [(chunk_mode, "chunk_mode"), (swa, "swa_window_mode")] {
            if on && !d2d {
                return Err(err(
                    &x(key),
                    "device to device only (kv_buffer_device \"rbln\")",
                ));
            }
        }
        if push_stream && direction != Direction::Push {
            return Err(err(
                &x("push_stream"),
                "push mode only (kv_connector KvrailPushConnector)",
            ));
        }
        if chunk_tokens.is_some() && !chunk_mode {
            return Err(err(&x("chunk_tokens"), "needs chunk_mode true"));
        }
        Ok(Self {
            direction,
            role,
            buffer_device,
            engine_id,
            lease_duration_s: lease,
            decoder_kv_blocks_ttl_s: ttl,
            bidirectional_kv_xfer: bidirectional,
            kv_recompute_threshold: recompute_threshold,
            push_registration_timeout_s: reg_timeout,
            chunk_mode,
            chunk_tokens,
            max_num_batched_tokens: step,
            swa_window_mode: swa,
            push_stream,
            stripe_width,
            link_down_exit_s: link_down,
            enforce_handshake_compat: compat,
            fence_blocks,
            cluster_secret,
            insecure,
            metadata_store,
        })
    }

    /// Heartbeat interval: `kv_lease_duration // 6` seconds (at least 1).
    pub fn heartbeat_interval_s(&self) -> u64 {
        (self.lease_duration_s / 6).max(1)
    }

    /// Lease extension per heartbeat: `kv_lease_duration * 2 // 3` seconds.
    pub fn lease_extension_s(&self) -> u64 {
        self.lease_duration_s * 2 / 3
    }
}

#[cfg(test)]
mod tests;
