//! An agent's metadata: what a peer needs to reach it and address its memory — name,
//! handshake facts (compatibility hash, layout, block size, layers), backend, per-rail
//! addressing, and registered regions with their keys. Exchanged as msgpack (named fields,
//! so later versions can add fields). Decoding is bounded and validated: garbage from the
//! network is an error, never a panic or a huge allocation.

use serde::{Deserialize, Serialize};

use crate::proto::handshake::HandshakeInfo;

/// The metadata format version this build writes and reads.
pub const VERSION: u32 = 2;
/// Largest encoded metadata accepted.
pub const MAX_BYTES: usize = 64 << 20;
/// Longest agent name, in bytes.
pub const MAX_NAME: usize = 256;
const MAX_RAILS: usize = 64;
const MAX_REGIONS: usize = 1 << 20;
const MAX_LAYERS: usize = 1 << 16;

/// Which data path the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// RC queue pairs over RoCEv2 / InfiniBand.
    Verbs,
    /// Sockets.
    Tcp,
}

/// How a peer reaches one of the agent's rails.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RailAddr {
    /// `device:port`, for logs.
    pub name: String,
    /// The GID its queue pairs use (16 bytes, network order).
    #[serde(with = "serde_bytes16")]
    pub gid: [u8; 16],
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// IPv4 address with prefix (`a.b.c.d/p`), for pairing rails by subnet.
    pub ipv4: Option<String>,
}

/// The kind of memory behind a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// Host DRAM.
    Host,
    /// Device memory exported as a dma-buf.
    DmaBuf,
    /// NPU memory through rbln-sys.
    Npu,
}

/// One registered region as peers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionMeta {
    /// The agent's id for the region (what remote descriptors name).
    pub id: u32,
    /// Memory kind.
    pub kind: MemKind,
    /// Address of the first byte (as the NIC addresses it; on TCP too, where peers name
    /// memory by address the way NIXL descriptors do).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key per rail, in `rails` order (empty on TCP).
    pub rkeys: Vec<u32>,
    /// Peers may READ it.
    pub remote_read: bool,
    /// Peers may WRITE it.
    pub remote_write: bool,
    /// Layer names the region holds (pipeline-parallel / hybrid-cache routing).
    pub layers: Vec<String>,
    /// The device the memory is on (an NPU's index; -1 for host memory).
    pub device: i32,
    /// Where each of `layers` starts in the region (a pooled allocation holding several
    /// layers); empty: every layer starts at 0 and spans the region.
    pub layer_offsets: Vec<u64>,
    /// Bytes of one layer in a pooled region (0: the region's length).
    pub layer_len: u64,
    /// Fenced: peers reach it only through grants (see [`crate::agent::grant::Grant`]); the
    /// region's own rkeys give no remote access, `remote_read`/`remote_write` say what a
    /// grant may give. Written only when set (metadata of unfenced regions is unchanged).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
}

impl RegionMeta {
    /// Where layer `name` lies in the region: (offset, bytes).
    pub fn layer_span(&self, name: &str) -> Option<(u64, u64)> {
        let i = self.layers.iter().position(|l| l == name)?;
        Some(layer_span(&self.layer_offsets, self.layer_len, self.len, i))
    }
}

/// Where the `i`th layer of a region of `region_len` bytes lies: (offset, bytes). No
/// offsets: every layer starts at 0; a `layer_len` of 0: a layer spans the region.
pub(crate) fn layer_span(offsets: &[u64], layer_len: u64, region_len: u64, i: usize) -> (u64, u64) {
    let len = if layer_len == 0 {
        region_len
    } else {
        layer_len
    };
    (offsets.get(i).copied().unwrap_or(0), len)
}

/// Everything a peer loads to connect to an agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// Handshake facts; `handshake.agent` is the agent's name.
    pub handshake: HandshakeInfo,
    /// The data path.
    pub backend: BackendKind,
    /// Side-channel address (`host:port`) peers connect to.
    pub side_channel: String,
    /// Rails (verbs backend).
    pub rails: Vec<RailAddr>,
    /// Data address (`host:port`, TCP backend).
    pub tcp_data: Option<String>,
    /// Registered regions.
    pub regions: Vec<RegionMeta>,
}

/// Metadata that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Not msgpack of the expected shape.
    #[error("undecodable agent metadata: {0}")]
    Decode(String),
    /// Larger than [`MAX_BYTES`].
    #[error("agent metadata of {0} bytes exceeds the {MAX_BYTES}-byte limit")]
    TooLarge(usize),
    /// Another format version.
    #[error("agent metadata version {theirs}, this build reads version {ours}")]
    Version {
        /// Ours.
        ours: u32,
        /// Theirs.
        theirs: u32,
    },
    /// Decodes, but breaks a rule (named).
    #[error("invalid agent metadata from {agent:?}: {reason}")]
    Invalid {
        /// The agent name as given.
        agent: String,
        /// What is wrong.
        reason: String,
    },
}

/// An agent name that breaks the rule of [`check_name`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty, or longer than [`MAX_NAME`] bytes.
    #[error("agent name must be 1..={MAX_NAME} bytes, is {0}")]
    Length(usize),
    /// It holds a control character.
    #[error("agent name {name:?} contains the control character {c:?}")]
    Control {
        /// The name.
        name: String,
        /// The first control character in it.
        c: char,
    },
}

/// The rule for agent names: 1..=[`MAX_NAME`] bytes, no control characters (a name
/// becomes a thread name, a log field and a C string; a NUL inside would cut or break it).
///
/// # Errors
/// [`NameError`]: what is wrong.
pub fn check_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(NameError::Length(name.len()));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(NameError::Control {
            name: name.to_owned(),
            c,
        });
    }
    Ok(())
}

impl AgentMetadata {
    /// msgpack with named fields.
    ///
    /// # Errors
    /// Serialization failure (not expected for valid values).
    pub fn encode(&self) -> Result<Vec<u8>, MetadataError> {
        rmp_serde::to_vec_named(self).map_err(|e| MetadataError::Decode(e.to_string()))
    }

    /// Decode and validate.
    ///
    /// # Errors
    /// [`MetadataError`] naming what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        if bytes.len() > MAX_BYTES {
            return Err(MetadataError::TooLarge(bytes.len()));
        }
        let m: Self =
            rmp_serde::from_slice(bytes).map_err(|e| MetadataError::Decode(e.to_string()))?;
        m.validate()?;
        Ok(m)
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.handshake.agent
    }

    /// Check the rules a peer relies on.
    ///
    /// # Errors
    /// [`MetadataError::Version`] or [`MetadataError::Invalid`].
    pub fn validate(&self) -> Result<(), MetadataError> {
        if self.version != VERSION {
            return Err(MetadataError::Version {
                ours: VERSION,
                theirs: self.version,
            });
        }
        let bad = |reason: String| {
            Err(MetadataError::Invalid {
                agent: self.name().chars().take(MAX_NAME).collect(),
                reason,
            })
        };
        if let Err(reason) = check_name(self.name()) {
            return bad(reason.to_string());
        }
        if self.handshake.block_size == 0 {
            return bad("block_size is 0".into());
        }
        if self.handshake.layers.len() > MAX_LAYERS {
            return bad(format!(
                "{} layers (limit {MAX_LAYERS})",
                self.handshake.layers.len()
            ));
        }
        match self.backend {
            BackendKind::Verbs if self.rails.is_empty() => {
                return bad("verbs backend without rails".into())
            }
            BackendKind::Tcp if self.tcp_data.is_none() => {
                return bad("tcp backend without a data address".into())
            }
            _ => {}
        }
        if self.rails.len() > MAX_RAILS {
            return bad(format!("{} rails (limit {MAX_RAILS})", self.rails.len()));
        }
        if self.regions.len() > MAX_REGIONS {
            return bad(format!(
                "{} regions (limit {MAX_REGIONS})",
                self.regions.len()
            ));
        }
        let mut ids = std::collections::HashSet::with_capacity(self.regions.len());
        for (i, r) in self.regions.iter().enumerate() {
            if !ids.insert(r.id) {
                return bad(format!("region #{i}: duplicate id {}", r.id));
            }
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return bad(format!(
                    "region #{i} (id {}): addr {:#x} + len {} is empty or overflows",
                    r.id, r.addr, r.len
                ));
            }
            if !r.layer_offsets.is_empty() && r.layer_offsets.len() != r.layers.len() {
                return bad(format!(
                    "region #{i} (id {}): {} layer offsets for {} layers",
                    r.id,
                    r.layer_offsets.len(),
                    r.layers.len()
                ));
            }
            if let Some(l) = r.layers.iter().find(|l| {
                r.layer_span(l)
                    .is_none_or(|(o, n)| o.checked_add(n).is_none_or(|e| e > r.len))
            }) {
                return bad(format!(
                    "region #{i} (id {}): layer {l:?} lies outside the region's {} bytes",
                    r.id, r.len
                ));
            }
            // device memory is staged (host bounce), never addressed by rkey
            let want = if self.backend == BackendKind::Verbs && r.kind == MemKind::Host {
                self.rails.len()
            } else {
                0
            };
            if r.rkeys.len() != want {
                return bad(format!(
                    "region #{i} (id {}): {} rkeys for {want} rails",
                    r.id,
                    r.rkeys.len()
                ));
            }
        }
        Ok(())
    }
}

/// A GID as msgpack binary (16 bytes), not an array of 16 integers.
mod serde_bytes16 {
    use std::fmt;

    use serde::de::{self, Deserializer, SeqAccess, Visitor};
    use serde::Serializer;

    pub(super) fn serialize<S: Serializer>(v: &[u8; 16], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 16], D::Error> {
        d.deserialize_bytes(Gid16)
    }

    struct Gid16;

    impl<'de> Visitor<'de> for Gid16 {
        type Value = [u8; 16];

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a 16-byte GID")
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<[u8; 16], E> {
            v.try_into().map_err(|_| E::invalid_length(v.len(), &self))
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<[u8; 16], A::Error> {
            let mut out = [0u8; 16];
            for (i, b) in out.iter_mut().enumerate() {
                *b = a
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(i, &self))?;
            }
            if a.next_element::<u8>()?.is_some() {
                return Err(de::Error::invalid_length(17, &self));
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests;
