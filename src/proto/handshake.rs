//! Handshake checks (SPEC §1 "Compatibility"): a peer is refused when its compatibility hash
//! differs (unless `enforce_handshake_compat = false`), and — always — when its KV layout or
//! block size differs, or when it lacks a layer this side routes by; every refusal names
//! both values. An agent that would advertise a loopback address to a peer on another host
//! is refused too, naming the setting to change.

use std::fmt;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// The direction KV moves in: it is part of the compatibility hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// D reads from P.
    Pull,
    /// P writes into D.
    Push,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pull => "pull",
            Self::Push => "push",
        })
    }
}

/// What the compatibility hash covers (SPEC §1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompatInfo {
    /// Model name or path.
    pub model: String,
    /// KV dtype (`bfloat16`, `float8_e4m3`, …).
    pub dtype: String,
    /// Attention backend.
    pub attn_backend: String,
    /// Connector version.
    pub connector_version: String,
    /// Push or pull.
    pub direction: Direction,
    /// Draft model, if speculative decoding uses one.
    pub draft_model: Option<String>,
}

/// A 64-bit compatibility hash, shown as 16 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CompatHash(pub u64);

impl fmt::Display for CompatHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for CompatHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CompatHash({self})")
    }
}

impl CompatInfo {
    /// FNV-1a (64-bit) over the fields, each length-prefixed so no two different field lists
    /// feed the same bytes. Stable across processes, hosts and kvrail builds.
    pub fn hash(&self) -> CompatHash {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut feed = |bytes: &[u8]| {
            for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        feed(b"kvrail-compat-v1");
        feed(self.model.as_bytes());
        feed(self.dtype.as_bytes());
        feed(self.attn_backend.as_bytes());
        feed(self.connector_version.as_bytes());
        feed(self.direction.to_string().as_bytes());
        match &self.draft_model {
            Some(d) => {
                feed(b"draft");
                feed(d.as_bytes());
            }
            None => feed(b"no-draft"),
        }
        CompatHash(h)
    }
}

/// What one side presents in the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeInfo {
    /// The agent's name.
    pub agent: String,
    /// Its compatibility hash.
    pub compat_hash: CompatHash,
    /// KV cache layout (`NHD`, `HND`, …).
    pub kv_layout: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Layer names its regions hold (empty: it does not route by layer).
    pub layers: Vec<String>,
    /// It routes by layer name (a pipeline-parallel producer): every one of its layers must
    /// be on the peer. A consumer advertises its layers without requiring the producer's.
    #[serde(default)]
    pub requires_layers: bool,
    /// Physical KV blocks per logical block (the engine's scheduler names logical blocks;
    /// a peer expands them: id `l` is physical blocks `l*r .. l*r + r`). 1 when absent.
    #[serde(default = "one_block")]
    pub physical_per_logical: u32,
}

fn one_block() -> u32 {
    1
}

/// A refused handshake.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Different model / dtype / attention backend / connector version / direction / draft.
    #[error("compatibility hash mismatch with {peer}: ours {ours}, theirs {theirs} (model, dtype, attention backend, connector version, push/pull and draft model must match; enforce_handshake_compat = false skips this check)")]
    CompatHashMismatch {
        /// The peer agent.
        peer: String,
        /// Our hash.
        ours: CompatHash,
        /// Theirs.
        theirs: CompatHash,
    },
    /// Different KV layout.
    #[error("KV layout mismatch with {peer}: ours {ours}, theirs {theirs}")]
    LayoutMismatch {
        /// The peer agent.
        peer: String,
        /// Ours.
        ours: String,
        /// Theirs.
        theirs: String,
    },
    /// Different block size.
    #[error("block_size mismatch with {peer}: ours {ours}, theirs {theirs}")]
    BlockSizeMismatch {
        /// The peer agent.
        peer: String,
        /// Ours.
        ours: u32,
        /// Theirs.
        theirs: u32,
    },
    /// A layer this side holds that the peer does not.
    #[error("peer {peer} has no layer {layer:?} (pipeline-parallel routing needs every member layer on both sides)")]
    MissingLayer {
        /// The peer agent.
        peer: String,
        /// The missing layer.
        layer: String,
    },
    /// This side would advertise a loopback address to a peer on another host.
    #[error("this agent advertises {advertised} to peer {peer}, which is not on this host: set side_channel_host to an address the peer can reach")]
    AdvertisedLoopback {
        /// What we would advertise.
        advertised: IpAddr,
        /// Where the peer is.
        peer: IpAddr,
    },
}

/// Check a peer's handshake info against ours.
///
/// # Errors
/// The first refusal: the compatibility hash (only when `enforce_compat`), then layout,
/// block size, and layer membership.
pub fn check(
    ours: &HandshakeInfo,
    theirs: &HandshakeInfo,
    enforce_compat: bool,
) -> Result<(), HandshakeError> {
    let peer = theirs.agent.clone();
    if enforce_compat && ours.compat_hash != theirs.compat_hash {
        return Err(HandshakeError::CompatHashMismatch {
            peer,
            ours: ours.compat_hash,
            theirs: theirs.compat_hash,
        });
    }
    if ours.kv_layout != theirs.kv_layout {
        return Err(HandshakeError::LayoutMismatch {
            peer,
            ours: ours.kv_layout.clone(),
            theirs: theirs.kv_layout.clone(),
        });
    }
    if ours.block_size != theirs.block_size {
        return Err(HandshakeError::BlockSizeMismatch {
            peer,
            ours: ours.block_size,
            theirs: theirs.block_size,
        });
    }
    let missing = ours.layers.iter().find(|l| !theirs.layers.contains(l));
    if let Some(layer) = missing.filter(|_| ours.requires_layers) {
        return Err(HandshakeError::MissingLayer {
            peer,
            layer: layer.clone(),
        });
    }
    Ok(())
}

/// Refuse to advertise a loopback address to a peer that is not on this host.
///
/// # Errors
/// [`HandshakeError::AdvertisedLoopback`] naming the setting to change.
pub fn check_advertised(advertised: IpAddr, peer: IpAddr) -> Result<(), HandshakeError> {
    if advertised.is_loopback() && !peer.is_loopback() {
        return Err(HandshakeError::AdvertisedLoopback { advertised, peer });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compat() -> CompatInfo {
        CompatInfo {
            model: "meta-llama/Llama-3.1-8B".into(),
            dtype: "bfloat16".into(),
            attn_backend: "FLASH_ATTN".into(),
            connector_version: "1".into(),
            direction: Direction::Pull,
            draft_model: None,
        }
    }

    fn info(c: &CompatInfo) -> HandshakeInfo {
        HandshakeInfo {
            requires_layers: true,
            physical_per_logical: 1,
            agent: "prefill-0".into(),
            compat_hash: c.hash(),
            kv_layout: "HND".into(),
            block_size: 16,
            layers: vec!["model.layers.0".into(), "model.layers.1".into()],
        }
    }

    #[test]
    fn hash_is_stable_and_covers_every_field() {
        let c = compat();
        assert_eq!(c.hash(), compat().hash());
        let variants = [
            CompatInfo {
                model: "other".into(),
                ..compat()
            },
            CompatInfo {
                dtype: "float16".into(),
                ..compat()
            },
            CompatInfo {
                attn_backend: "TRITON".into(),
                ..compat()
            },
            CompatInfo {
                connector_version: "2".into(),
                ..compat()
            },
            CompatInfo {
                direction: Direction::Push,
                ..compat()
            },
            CompatInfo {
                draft_model: Some("eagle".into()),
                ..compat()
            },
            CompatInfo {
                draft_model: Some(String::new()),
                ..compat()
            },
        ];
        let mut seen = vec![c.hash()];
        for v in &variants {
            assert!(!seen.contains(&v.hash()), "{v:?} collides");
            seen.push(v.hash());
        }
        // field boundaries matter: moving bytes between fields changes the hash
        let a = CompatInfo {
            model: "ab".into(),
            dtype: "c".into(),
            ..compat()
        };
        let b = CompatInfo {
            model: "a".into(),
            dtype: "bc".into(),
            ..compat()
        };
        assert_ne!(a.hash(), b.hash());
    }

    /// The hash must not change between builds, or mixed-version deployments refuse each
    /// other; the golden value was computed independently (Python, same definition).
    #[test]
    fn golden_hash_value() {
        assert_eq!(compat().hash().to_string(), GOLDEN);
    }

    const GOLDEN: &str = include_str!("golden_compat_hash.txt");

    #[test]
    fn mismatches_name_both_values() {
        let mut ours = info(&compat());
        let mut theirs = info(&CompatInfo {
            direction: Direction::Push,
            ..compat()
        });
        theirs.agent = "decode-3".into();
        let e = check(&ours, &theirs, true).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "compatibility hash mismatch with decode-3: ours {}, theirs {} (model, dtype, attention backend, connector version, push/pull and draft model must match; enforce_handshake_compat = false skips this check)",
                ours.compat_hash, theirs.compat_hash
            )
        );
        // enforce_handshake_compat = false skips only the hash
        assert_eq!(check(&ours, &theirs, false), Ok(()));
        theirs.kv_layout = "NHD".into();
        assert_eq!(
            check(&ours, &theirs, false).unwrap_err().to_string(),
            "KV layout mismatch with decode-3: ours HND, theirs NHD"
        );
        theirs.kv_layout = "HND".into();
        theirs.block_size = 32;
        assert_eq!(
            check(&ours, &theirs, false).unwrap_err().to_string(),
            "block_size mismatch with decode-3: ours 16, theirs 32"
        );
        theirs.block_size = 16;
        theirs.layers.pop();
        assert_eq!(
            check(&ours, &theirs, false).unwrap_err(),
            HandshakeError::MissingLayer {
                peer: "decode-3".into(),
                layer: "model.layers.1".into()
            }
        );
        // a consumer advertises its layers without requiring the producer's
        ours.requires_layers = false;
        assert_eq!(check(&ours, &theirs, false), Ok(()));
        ours.requires_layers = true;
        theirs.layers.push("model.layers.1".into());
        theirs.layers.push("model.layers.2".into()); // a superset is fine
        assert_eq!(
            check(&ours, &theirs, true).map_err(|_| ()),
            Err(()),
            "hash still differs"
        );
        assert_eq!(check(&ours, &theirs, false), Ok(()));
    }

    #[test]
    fn loopback_advertised_to_a_remote_peer() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let remote: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(check_advertised(lo, lo), Ok(()));
        assert_eq!(check_advertised(remote, remote), Ok(()));
        assert_eq!(
            check_advertised(lo, remote).unwrap_err().to_string(),
            "this agent advertises 127.0.0.1 to peer 10.1.2.3, which is not on this host: set side_channel_host to an address the peer can reach"
        );
        let lo6: IpAddr = "::1".parse().unwrap();
        assert!(check_advertised(lo6, remote).is_err());
    }
}
