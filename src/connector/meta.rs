//! What flows between the proxy, the scheduler side and the worker side: the transfer
//! parameters a request carries, and the metadata `build_connector_meta` hands the workers
//! (serializable, since the two sides may live in different processes).

use serde::{Deserialize, Serialize};

/// Bytes that are not a [`ConnectorMetadata`] (the msgpack decoder's words).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MetaDecodeError(pub String);

/// `kv_transfer_params` that cannot be read (bad input from a proxy or a client).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParamsError {
    /// Not JSON at all (the parser's words).
    #[error("not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object.
    #[error("{0} is not a JSON object")]
    NotAnObject(String),
    /// A key kvrail reads holds a value of the wrong type.
    #[error("{key}: {value} is not {want}")]
    WrongType {
        /// The key.
        key: String,
        /// Its value, as JSON.
        value: String,
        /// What it must be.
        want: &'static str,
    },
}

/// The `kv_transfer_params` of a request (absent fields take their defaults, so the
/// prefill leg needs only `{"do_remote_decode": true}`).
///
/// With `bidirectional_kv_xfer` (seed 003) the same keys, as NixlConnector names them, carry
/// the next turn back: D's finished request returns `do_remote_decode` with D's engine,
/// host, ports, blocks and request id in the `remote_*` keys, plus `remote_num_tokens` and
/// `remote_blocks_expiry_time`; the next turn sent to P with them reads that KV back.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KvTransferParams {
    /// Prefill leg: P keeps the KV for a decode instance.
    pub do_remote_decode: bool,
    /// Decode leg: the KV comes from P.
    pub do_remote_prefill: bool,
    /// P's engine id.
    pub remote_engine_id: String,
    /// P's side-channel host.
    pub remote_host: String,
    /// P's side-channel port.
    pub remote_port: u16,
    /// P's block ids holding the prompt's KV (pull mode).
    pub remote_block_ids: Vec<u64>,
    /// P's request id.
    pub remote_request_id: String,
    /// P's tensor-parallel size.
    pub tp_size: u32,
    /// P's side-channel port of each TP rank (rank `k` at `remote_ports[k]`); empty:
    /// `remote_port + k`.
    pub remote_ports: Vec<u16>,
    /// Read-back: the tokens whose KV the remote's blocks hold (D's computed tokens).
    #[serde(skip_serializing_if = "is_zero")]
    pub remote_num_tokens: u64,
    /// Read-back: when the remote gives its blocks back, in the remote's monotonic clock,
    /// seconds (NixlConnector's `perf_counter` deadline).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_blocks_expiry_time: Option<f64>,
    /// Read-back: the engine already scheduled (or declined) the read; asked again (to
    /// recompute after a failed load) it computes instead. Set by the connector.
    #[serde(
        rename = "_remote_blocks_processed",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub remote_blocks_processed: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl KvTransferParams {
    /// P's TP size (at least 1).
    pub fn p_tp(&self) -> u32 {
        self.tp_size.max(1)
    }

    /// The side-channel port of P's rank `rank`.
    pub fn rank_port(&self, rank: u32) -> u16 {
        self.remote_ports
            .get(rank as usize)
            .copied()
            .unwrap_or_else(|| self.remote_port.saturating_add(rank as u16))
    }

    /// From a request's `kv_transfer_params` JSON. A key of the wrong type is refused with
    /// its name and value (`remote_port: "x" is not a port (0-65535)`); keys kvrail does not
    /// know are left to the engine (vLLM adds its own).
    ///
    /// # Errors
    /// [`ParamsError`]: not JSON, not an object, or a key whose value is of the wrong type.
    pub fn from_json(json: &str) -> Result<Self, ParamsError> {
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| ParamsError::NotJson(e.to_string()))?;
        let serde_json::Value::Object(map) = v else {
            return Err(ParamsError::NotAnObject(v.to_string()));
        };
        let mut p = Self::default();
        for (k, v) in map.iter().filter(|(_, v)| !v.is_null()) {
            let bad = |want: &'static str| ParamsError::WrongType {
                key: k.clone(),
                value: v.to_string(),
                want,
            };
            match k.as_str() {
                "do_remote_decode" => {
                    p.do_remote_decode = v.as_bool().ok_or_else(|| bad("true or false"))?
                }
                "do_remote_prefill" => {
                    p.do_remote_prefill = v.as_bool().ok_or_else(|| bad("true or false"))?
                }
                "remote_engine_id" => {
                    p.remote_engine_id = text(v).ok_or_else(|| bad("a string"))?
                }
                "remote_host" => p.remote_host = text(v).ok_or_else(|| bad("a string"))?,
                "remote_request_id" => {
                    p.remote_request_id = text(v).ok_or_else(|| bad("a string"))?
                }
                "remote_port" => p.remote_port = port(v).ok_or_else(|| bad("a port (0-65535)"))?,
                "tp_size" => {
                    p.tp_size = v
                        .as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| bad("a TP size"))?
                }
                "remote_block_ids" => {
                    p.remote_block_ids = list(v, serde_json::Value::as_u64)
                        .ok_or_else(|| bad("a list of block ids"))?
                }
                "remote_ports" => {
                    p.remote_ports = list(v, port).ok_or_else(|| bad("a list of ports"))?
                }
                "remote_num_tokens" => {
                    p.remote_num_tokens = v.as_u64().ok_or_else(|| bad("a token count"))?
                }
                "remote_blocks_expiry_time" => {
                    p.remote_blocks_expiry_time = Some(
                        v.as_f64()
                            .filter(|t| t.is_finite())
                            .ok_or_else(|| bad("a time in seconds"))?,
                    )
                }
                "_remote_blocks_processed" => {
                    p.remote_blocks_processed = v.as_bool().ok_or_else(|| bad("true or false"))?
                }
                _ => {}
            }
        }
        Ok(p)
    }

    /// Whether these parameters ask P to read a previous turn's KV back from D (seed 003):
    /// a prefill leg (`do_remote_decode`) naming the remote's blocks, engine, request and
    /// (unless found by name in a metadata store) side channel, not yet processed.
    pub fn reads_back(&self, by_name: bool) -> bool {
        self.do_remote_decode
            && !self.remote_blocks_processed
            && !self.remote_block_ids.is_empty()
            && !self.remote_engine_id.is_empty()
            && !self.remote_request_id.is_empty()
            && (by_name
                || (!self.remote_host.is_empty()
                    && (self.remote_port != 0
                        || self.remote_ports.first().is_some_and(|&p| p != 0))))
    }

    /// Why these parameters cannot load a prompt's KV from P (`pull`: D READs P's blocks,
    /// so it needs their ids too; `by_name`: D finds P's ranks in the metadata store by
    /// engine id, so P's host and port are not needed), naming the first key missing and its
    /// value; None when they can, or when they ask for no load (`do_remote_prefill` false).
    pub fn load_problem(&self, pull: bool, by_name: bool) -> Option<String> {
        if !self.do_remote_prefill {
            return None;
        }
        let missing = |key: &str, v: &dyn std::fmt::Debug| {
            Some(format!(
                "kv_transfer_params.{key} is {v:?}: a decode leg (do_remote_prefill) needs P's {key}"
            ))
        };
        if self.remote_engine_id.is_empty() {
            return missing("remote_engine_id", &self.remote_engine_id);
        }
        if !by_name && self.remote_host.is_empty() {
            return missing("remote_host", &self.remote_host);
        }
        if !by_name && self.remote_port == 0 && self.remote_ports.first().is_none_or(|&p| p == 0) {
            return missing("remote_port", &self.remote_port);
        }
        if self.remote_request_id.is_empty() {
            return missing("remote_request_id", &self.remote_request_id);
        }
        if pull && self.remote_block_ids.is_empty() {
            return missing("remote_block_ids", &self.remote_block_ids);
        }
        None
    }
}

fn text(v: &serde_json::Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn port(v: &serde_json::Value) -> Option<u16> {
    v.as_u64().and_then(|n| u16::try_from(n).ok())
}

fn list<T>(
    v: &serde_json::Value,
    item: impl Fn(&serde_json::Value) -> Option<T>,
) -> Option<Vec<T>> {
    v.as_array()?.iter().map(item).collect()
}

/// A request as the connector sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    /// The engine's request id.
    pub request_id: String,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Transfer parameters, if the request is part of a P/D pair.
    pub params: Option<KvTransferParams>,
}

/// A receive the worker must do (pull: READ; push: register and wait; a read-back: READ
/// in either mode).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecvReq {
    /// D's request id.
    pub request_id: String,
    /// D's blocks that receive the KV.
    pub local_block_ids: Vec<u64>,
    /// Where the KV is.
    pub params: KvTransferParams,
    /// The prompt's tokens (what `chunk_mode` cuts the last block to); a read-back: the
    /// tokens read back.
    #[serde(default)]
    pub tokens: u64,
    /// A read-back (`bidirectional_kv_xfer`): P READs a previous turn's KV from D's kept
    /// blocks, whatever the connector's direction.
    #[serde(default)]
    pub read_back: bool,
    /// A read-back: the tokens the engine had cached already (whole blocks at the start);
    /// `local_block_ids` begin after them, the remote's list at the request's start.
    #[serde(default)]
    pub computed: u64,
}

/// A finished prefill P holds for D (or, `keep_s` set, a decoded request D keeps for the
/// next turn to read back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendReq {
    /// P's request id.
    pub request_id: String,
    /// Its blocks.
    pub block_ids: Vec<u64>,
    /// The prompt's tokens.
    pub tokens: u64,
    /// D, `bidirectional_kv_xfer`: kept this many seconds (`decoder_kv_blocks_ttl`) for a
    /// read-back, not `kv_lease_duration`; READ in either mode, never pushed.
    #[serde(default)]
    pub keep_s: Option<u64>,
}

/// A running prefill's progress (`push_stream`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamReq {
    /// P's request id.
    pub request_id: String,
    /// Its blocks so far.
    pub block_ids: Vec<u64>,
    /// Prompt tokens whose KV is in the cache.
    pub computed: u64,
    /// The prompt's tokens.
    pub tokens: u64,
}

/// A heartbeat the worker must send.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatOut {
    /// P's engine id.
    pub engine: String,
    /// P's side channel.
    pub host: String,
    /// P's side-channel port (rank 0).
    pub port: u16,
    /// The port of each of P's TP ranks (empty: P runs TP 1 at `port`); each D worker sends
    /// the heartbeat to every P rank it reads from, so together they reach all of them.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// The encoded `HB:` message.
    #[serde(with = "serde_bytes")]
    pub message: Vec<u8>,
}

/// The scheduler's instructions to its workers for one step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// D: receives to start.
    pub reqs_to_recv: Vec<RecvReq>,
    /// P: finished prefills to hold under a lease.
    pub reqs_to_send: Vec<SendReq>,
    /// P, push with `push_stream`: running prefills and how far they got.
    #[serde(default)]
    pub reqs_streaming: Vec<StreamReq>,
    /// D: heartbeats due.
    pub heartbeats: Vec<HeartbeatOut>,
    /// D: registrations the watchdog dropped (stop re-sending them; P is told to drop them).
    pub expired_registrations: Vec<String>,
    /// D, push: requests the engine aborted while their registration was out: P is told to
    /// drop it, and the workers report the request in `sending` once every P rank confirmed
    /// (its blocks may be freed then).
    #[serde(default)]
    pub cancel_registrations: Vec<String>,
}

impl ConnectorMetadata {
    /// msgpack.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// From msgpack.
    ///
    /// # Errors
    /// [`MetaDecodeError`], with the decoder's message.
    pub fn decode(b: &[u8]) -> Result<Self, MetaDecodeError> {
        rmp_serde::from_slice(b).map_err(|e| MetaDecodeError(e.to_string()))
    }

    /// True when there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.reqs_to_recv.is_empty()
            && self.reqs_to_send.is_empty()
            && self.reqs_streaming.is_empty()
            && self.heartbeats.is_empty()
            && self.expired_registrations.is_empty()
            && self.cancel_registrations.is_empty()
    }
}

/// What a worker's `get_finished` reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Finished {
    /// P: requests whose blocks may be freed (completed or lease expired). D (push):
    /// aborted requests whose registration every P rank has dropped.
    pub sending: Vec<String>,
    /// D: requests whose KV arrived, every byte.
    pub recving: Vec<String>,
    /// D: requests whose KV will not arrive (the engine fails or recomputes them).
    pub failed_recving: Vec<String>,
}
