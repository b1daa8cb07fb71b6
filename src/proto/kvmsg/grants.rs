//! The fencing messages of pull mode (P's KV cache fenced, see `crate::agent::grant`):
//! D asks each P rank it reads from for the grant over the request's blocks
//! (`GRANT_REQ:`), and the rank answers with the grant token (`GRANT:`) or says why it has
//! none (`GRANT_NONE:`: the lease ran out, or it never held the request). P revokes the
//! grant when it frees the blocks, so a READ that comes later fails instead of reading
//! blocks that hold another request's KV.

use serde::{Deserialize, Serialize};

use super::{decode_named, encode_named, KvMsgError};

/// Prefix of D's request for a grant.
pub const GRANT_REQ_PREFIX: &[u8] = b"GRANT_REQ:";
/// Prefix of P's grant.
pub const GRANT_PREFIX: &[u8] = b"GRANT:";
/// Prefix of P's refusal.
pub const GRANT_NONE_PREFIX: &[u8] = b"GRANT_NONE:";

/// D asks for the grant over P's blocks of `request_id` (P's id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantReq {
    /// P's request id (as in D's `kv_transfer_params`).
    pub request_id: String,
    /// D's side-channel host (P answers there, connecting first if it must).
    pub host: String,
    /// D's side-channel port.
    pub port: u16,
}

/// P's grant over its blocks of `request_id` (P's id): an agent grant token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantMsg {
    /// P's request id.
    pub request_id: String,
    /// `crate::agent::Grant::encode`'s bytes.
    #[serde(with = "serde_bytes")]
    pub token: Vec<u8>,
    /// The granting worker's monotonic clock when it answered, microseconds (absent from
    /// older peers): the asker measures its offset to the keeper of read-back blocks from
    /// the round trip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_us: Option<i64>,
}

/// P holds no blocks of `request_id` to grant (pull), or no prefill for a registration
/// (push), and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantNone {
    /// The request as the asker named it: P's id for a grant question (pull), D's id for a
    /// push registration.
    pub request_id: String,
    /// Why (lease over, never held).
    pub reason: String,
    /// The answering worker's monotonic clock, microseconds (see [`GrantMsg::clock_us`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_us: Option<i64>,
}

macro_rules! named {
    ($t:ty, $prefix:expr, $kind:literal) => {
        impl $t {
            #[doc = concat!("`", $kind, ":` + msgpack map.")]
            pub fn encode(&self) -> Vec<u8> {
                encode_named($prefix, self)
            }

            /// Parse one (`b` includes the prefix).
            ///
            /// # Errors
            /// [`KvMsgError`] for a missing prefix, bad msgpack or missing fields.
            pub fn decode(b: &[u8]) -> Result<Self, KvMsgError> {
                decode_named(b, $prefix, $kind)
            }
        }
    };
}

named!(GrantReq, GRANT_REQ_PREFIX, "GRANT_REQ");
named!(GrantMsg, GRANT_PREFIX, "GRANT");
named!(GrantNone, GRANT_NONE_PREFIX, "GRANT_NONE");
