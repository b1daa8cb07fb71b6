//! The cluster's shared secret (`cluster_secret`), part of the agent's configuration: what
//! it is, and the proofs the side channel's authentication (`control::auth`) computes with
//! it. It lives beside the configuration, not the side channel, so that the configuration
//! names no driver.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Shortest secret accepted.
pub const MIN_SECRET: usize = 16;

/// A cluster secret shorter than [`MIN_SECRET`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a cluster secret needs at least {MIN_SECRET} bytes, this one has {len}")]
pub struct SecretTooShort {
    /// The bytes it had.
    pub len: usize,
}

/// A cluster's shared secret (`cluster_secret`): every agent of the cluster carries the
/// same one. Its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// The secret's bytes (at least [`MIN_SECRET`]).
    ///
    /// # Errors
    /// [`SecretTooShort`] for fewer bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretTooShort> {
        let b = bytes.into();
        if b.len() < MIN_SECRET {
            return Err(SecretTooShort { len: b.len() });
        }
        Ok(Self(b))
    }

    fn mac(&self, label: &[u8], client: &[u8], server: &[u8]) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(label);
        m.update(client);
        m.update(server);
        m
    }

    /// The proof `label` gives for nonces (`client`, `server`).
    pub(crate) fn proof(&self, label: &[u8], client: &[u8], server: &[u8]) -> Vec<u8> {
        self.mac(label, client, server)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Whether `proof` is `label`'s for these nonces (compared in constant time).
    pub(crate) fn verify(&self, label: &[u8], client: &[u8], server: &[u8], proof: &[u8]) -> bool {
        self.mac(label, client, server).verify_slice(proof).is_ok()
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterSecret(<{} bytes>)", self.0.len())
    }
}
