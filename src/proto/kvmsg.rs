//! The P/D notifications (SPEC §3) and request-id rules:
//! - completion `<request_id>:<tp_size>` (D → P in pull mode after its READs; P → D in push
//!   mode after the WRITEs, with D's own request id);
//! - heartbeat `HB:<msgpack array of request ids>`, one per P engine per interval;
//! - push registration `PUSH_REG:<msgpack map>`;
//! - its withdrawal `PUSH_CANCEL:<msgpack map>` (D → P, D aborted the request) and P's answer
//!   `PUSH_CANCELLED:<msgpack map>` (no WRITE of it is in flight, none will start);
//! - pull fencing: `GRANT_REQ:`, `GRANT:` and `GRANT_NONE:` (see [`GrantReq`]).
//!
//! Decoding never panics: malformed input is a [`KvMsgError`] naming what is wrong.

use serde::{Deserialize, Serialize};

mod grants;
pub use grants::{
    GrantMsg, GrantNone, GrantReq, GRANT_NONE_PREFIX, GRANT_PREFIX, GRANT_REQ_PREFIX,
};

/// Prefix of a heartbeat.
pub const HB_PREFIX: &[u8] = b"HB:";
/// Prefix of a push registration.
pub const PUSH_REG_PREFIX: &[u8] = b"PUSH_REG:";
/// Prefix of a registration's withdrawal.
pub const PUSH_CANCEL_PREFIX: &[u8] = b"PUSH_CANCEL:";
/// Prefix of P's answer to a withdrawal.
pub const PUSH_CANCELLED_PREFIX: &[u8] = b"PUSH_CANCELLED:";
/// What every push-protocol message starts with (they travel to the push writer, in order).
pub const PUSH_PREFIX: &[u8] = b"PUSH_";

/// A malformed P/D notification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {kind} notification: {reason}")]
pub struct KvMsgError {
    /// Which message.
    pub kind: &'static str,
    /// What is wrong.
    pub reason: String,
}

fn bad(kind: &'static str, reason: impl Into<String>) -> KvMsgError {
    KvMsgError {
        kind,
        reason: reason.into(),
    }
}

/// The request id with the engine's random suffix removed: vLLM appends `-` and 8 hex digits
/// per engine (`cmpl-<uuid>-<index>-1a2b3c4d`), so P and D see the same proxy id with
/// different suffixes. The completion index stays, so multi-prompt sub-requests stay apart.
/// Ids without such a suffix are returned whole.
pub fn base_request_id(id: &str) -> &str {
    match id.rsplit_once('-') {
        Some((base, suffix))
            if !base.is_empty()
                && suffix.len() == 8
                && suffix.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            base
        }
        _ => id,
    }
}

/// A completion notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The request id (the receiver's own).
    pub request_id: String,
    /// The sender's tensor-parallel size.
    pub tp_size: u32,
}

impl Completion {
    /// `<request_id>:<tp_size>`.
    pub fn encode(&self) -> Vec<u8> {
        format!("{}:{}", self.request_id, self.tp_size).into_bytes()
    }

    /// Parse `<request_id>:<tp_size>` (the id may itself contain `:`).
    ///
    /// # Errors
    /// [`KvMsgError`] for non-UTF-8, a missing `:`, an empty id, or a bad size.
    pub fn decode(b: &[u8]) -> Result<Self, KvMsgError> {
        let s = std::str::from_utf8(b).map_err(|_| bad("completion", "not UTF-8"))?;
        let (id, tp) = s
            .rsplit_once(':')
            .ok_or_else(|| bad("completion", "no ':' between request id and tp size"))?;
        let tp_size: u32 = tp
            .parse()
            .map_err(|_| bad("completion", format!("tp size {tp:?} is not a number")))?;
        if id.is_empty() || tp_size == 0 {
            return Err(bad("completion", "empty request id or tp size 0"));
        }
        Ok(Self {
            request_id: id.to_owned(),
            tp_size,
        })
    }
}

/// `HB:` + msgpack array of the request ids it renews.
pub fn encode_heartbeat(ids: &[String]) -> Vec<u8> {
    let mut v = HB_PREFIX.to_vec();
    v.extend(rmp_serde::to_vec(ids).unwrap_or_default());
    v
}

/// The request ids of a heartbeat (`b` includes the prefix).
///
/// # Errors
/// [`KvMsgError`] when the prefix is missing or the body is not an array of strings.
pub fn decode_heartbeat(b: &[u8]) -> Result<Vec<String>, KvMsgError> {
    let body = b
        .strip_prefix(HB_PREFIX)
        .ok_or_else(|| bad("heartbeat", "no HB: prefix"))?;
    rmp_serde::from_slice(body).map_err(|e| bad("heartbeat", e.to_string()))
}

/// A push registration: where P must WRITE one request's KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushReg {
    /// D's request id (the completion notification carries it back).
    pub request_id: String,
    /// D's engine id.
    pub engine_id: String,
    /// D's side-channel host.
    pub host: String,
    /// D's side-channel port.
    pub port: u16,
    /// D's tensor-parallel rank.
    pub tp_rank: u32,
    /// D's tensor-parallel size.
    pub tp_size: u32,
    /// D's logical block ids that receive the KV.
    pub block_ids: Vec<u64>,
    /// P's engine id (the request's prefill engine).
    pub remote_engine_id: String,
    /// P's request id as the proxy handed it to D (matched exactly, then by base id).
    pub remote_request_id: String,
    /// D's grant over `block_ids` (its KV cache is fenced): P WRITEs through it, and D
    /// revokes it when it takes the blocks back. Absent: D's cache is not fenced.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
    pub grant: Option<Vec<u8>>,
}

impl PushReg {
    /// `PUSH_REG:` + msgpack map with named fields.
    pub fn encode(&self) -> Vec<u8> {
        encode_named(PUSH_REG_PREFIX, self)
    }

    /// Parse a registration (`b` includes the prefix).
    ///
    /// # Errors
    /// [`KvMsgError`] for a missing prefix, bad msgpack, missing fields, or no blocks.
    pub fn decode(b: &[u8]) -> Result<Self, KvMsgError> {
        let r: Self = decode_named(b, PUSH_REG_PREFIX, "PUSH_REG")?;
        if r.tp_size == 0 || r.tp_rank >= r.tp_size {
            return Err(bad(
                "PUSH_REG",
                format!("tp rank {} of size {}", r.tp_rank, r.tp_size),
            ));
        }
        if r.block_ids.is_empty() {
            return Err(bad(
                "PUSH_REG",
                format!("request {}: no blocks to write into", r.request_id),
            ));
        }
        Ok(r)
    }
}

/// D withdraws its registration of `request_id` (D's id) from engine `engine_id` (D's): P
/// drops it, pending or matched, and answers with [`PushCancelled`] once no WRITE of it is
/// in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCancel {
    /// D's request id.
    pub request_id: String,
    /// D's engine id.
    pub engine_id: String,
    /// D's side-channel host (P answers there, connecting first if it never wrote to D).
    pub host: String,
    /// D's side-channel port.
    pub port: u16,
}

/// P's answer to a [`PushCancel`]: nothing of `request_id` (D's id) will be written any more.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushCancelled {
    /// D's request id.
    pub request_id: String,
    /// P's TP size (D waits for every P rank that writes to it).
    pub tp_size: u32,
}

fn encode_named<T: Serialize>(prefix: &[u8], v: &T) -> Vec<u8> {
    let mut out = prefix.to_vec();
    out.extend(rmp_serde::to_vec_named(v).unwrap_or_default());
    out
}

fn decode_named<T: serde::de::DeserializeOwned>(
    b: &[u8],
    prefix: &[u8],
    kind: &'static str,
) -> Result<T, KvMsgError> {
    let body = b
        .strip_prefix(prefix)
        .ok_or_else(|| bad(kind, format!("no {kind}: prefix")))?;
    rmp_serde::from_slice(body).map_err(|e| bad(kind, e.to_string()))
}

impl PushCancel {
    /// `PUSH_CANCEL:` + msgpack map.
    pub fn encode(&self) -> Vec<u8> {
        encode_named(PUSH_CANCEL_PREFIX, self)
    }

    /// Parse one (`b` includes the prefix).
    ///
    /// # Errors
    /// [`KvMsgError`] for a missing prefix, bad msgpack or missing fields.
    pub fn decode(b: &[u8]) -> Result<Self, KvMsgError> {
        decode_named(b, PUSH_CANCEL_PREFIX, "PUSH_CANCEL")
    }
}

impl PushCancelled {
    /// `PUSH_CANCELLED:` + msgpack map.
    pub fn encode(&self) -> Vec<u8> {
        encode_named(PUSH_CANCELLED_PREFIX, self)
    }

    /// Parse one (`b` includes the prefix).
    ///
    /// # Errors
    /// [`KvMsgError`] for a missing prefix, bad msgpack or missing fields.
    pub fn decode(b: &[u8]) -> Result<Self, KvMsgError> {
        decode_named(b, PUSH_CANCELLED_PREFIX, "PUSH_CANCELLED")
    }
}

/// What a notification received by a connector is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvMsg {
    /// `HB:`.
    Heartbeat(Vec<String>),
    /// `PUSH_REG:`.
    PushReg(PushReg),
    /// `PUSH_CANCEL:`.
    PushCancel(PushCancel),
    /// `PUSH_CANCELLED:`.
    PushCancelled(PushCancelled),
    /// `GRANT_REQ:`.
    GrantReq(GrantReq),
    /// `GRANT:`.
    Grant(GrantMsg),
    /// `GRANT_NONE:`.
    GrantNone(GrantNone),
    /// `<request_id>:<tp_size>`.
    Completion(Completion),
}

impl KvMsg {
    /// Classify and parse a notification.
    ///
    /// # Errors
    /// [`KvMsgError`] for malformed input.
    pub fn decode(b: &[u8]) -> Result<Self, KvMsgError> {
        if b.starts_with(HB_PREFIX) {
            decode_heartbeat(b).map(Self::Heartbeat)
        } else if b.starts_with(PUSH_REG_PREFIX) {
            PushReg::decode(b).map(Self::PushReg)
        } else if b.starts_with(PUSH_CANCELLED_PREFIX) {
            PushCancelled::decode(b).map(Self::PushCancelled)
        } else if b.starts_with(PUSH_CANCEL_PREFIX) {
            PushCancel::decode(b).map(Self::PushCancel)
        } else if b.starts_with(GRANT_REQ_PREFIX) {
            GrantReq::decode(b).map(Self::GrantReq)
        } else if b.starts_with(GRANT_NONE_PREFIX) {
            GrantNone::decode(b).map(Self::GrantNone)
        } else if b.starts_with(GRANT_PREFIX) {
            GrantMsg::decode(b).map(Self::Grant)
        } else {
            Completion::decode(b).map(Self::Completion)
        }
    }
}
