//! Metadata that travels to a peer instead of being fetched from it, as NIXL's listener
//! takes it (`sendLocalMD(ip, port)`, `invalidateLocalMD(ip, port)`), and partial metadata
//! (only some regions, `getLocalPartialMD`), which a peer adds to what it knew.
//!
//! Sending: one request on a fresh side-channel connection (authenticated where a cluster
//! secret is set), answered `Taken` or `Refused`. Taking: only with
//! [`AgentConfig::accept_sent_metadata`]; the metadata must name a data address on the host
//! it came from, and must not take over the name of a peer loaded from elsewhere; a
//! `Forget` is obeyed only from the host the named peer was loaded from.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpStream};

use super::control::msg::{self, Msg};
use super::metadata::RegionMeta;
use super::*;

/// Largest metadata sent (the listener reads a first message of at most 64 KiB); a larger
/// one is fetched by the peer instead, or sent as partial metadata.
pub const MAX_SENT_METADATA: usize = 60 << 10;

impl Agent {
    /// Send this agent's metadata (or `partial`, from [`Agent::partial_metadata`]) to the
    /// agent listening at `addr`, which loads it and connects back (it needs
    /// `accept_sent_metadata`). Returns the name it answered with.
    ///
    /// # Errors
    /// [`AgentError::Connection`] naming `addr` (unreachable, refused, no answer in
    /// 20 s: the peer connects back first);
    /// [`AgentError::Unsupported`] for metadata over [`MAX_SENT_METADATA`].
    pub fn send_metadata(
        &self,
        addr: SocketAddr,
        partial: Option<AgentMetadata>,
    ) -> Result<String, AgentError> {
        let is_partial = partial.is_some();
        let metadata = partial.unwrap_or_else(|| self.shared.metadata()).encode()?;
        if metadata.len() > MAX_SENT_METADATA {
            return Err(AgentError::Unsupported(format!(
                "metadata of {} bytes is too large to send (at most {MAX_SENT_METADATA}): \
                 let the peer fetch it, or send partial metadata",
                metadata.len()
            )));
        }
        crate::proto::handshake::check_advertised(self.shared.addr.ip(), addr.ip())?;
        let m = Msg::PutMetadata {
            metadata,
            partial: is_partial,
        };
        self.ask(addr, &m)
    }

    /// Tell the agent listening at `addr` to forget this one (it needs
    /// `accept_sent_metadata`, and obeys only a request from the host it loaded this agent
    /// from).
    ///
    /// # Errors
    /// As [`Agent::send_metadata`]; a peer that does not know this agent refuses.
    pub fn send_forget(&self, addr: SocketAddr) -> Result<(), AgentError> {
        let m = Msg::Forget {
            name: self.shared.name.clone(),
        };
        self.ask(addr, &m).map(|_| ())
    }

    fn ask(&self, addr: SocketAddr, m: &Msg) -> Result<String, AgentError> {
        let secret = self.shared.config.cluster_secret.as_ref();
        // the peer answers after loading, which connects back to this agent
        let wait = control::HANDSHAKE_TIMEOUT * 2;
        match control::request(addr, secret, m, wait)? {
            Msg::Taken { name } => Ok(name),
            Msg::Refused { message } => {
                Err(control::conn_err("side channel: refused by", addr, message))
            }
            other => Err(control::conn_err(
                "side channel: unexpected reply from",
                addr,
                format!("{other:?}"),
            )),
        }
    }

    /// This agent's metadata naming only the registered regions that hold the
    /// `(addr, len)` ranges (none: the connection details alone).
    ///
    /// # Errors
    /// [`AgentError::InvalidDesc`] naming the first range that no region holds.
    pub fn partial_metadata(&self, ranges: &[(u64, u64)]) -> Result<AgentMetadata, AgentError> {
        let mut meta = self.shared.metadata();
        let mut keep = Vec::<RegionMeta>::new();
        for (i, &(a, n)) in ranges.iter().enumerate() {
            let r = meta
                .regions
                .iter()
                .find(|r| holds(r, a, n))
                .ok_or_else(|| AgentError::InvalidDesc {
                    side: "local",
                    index: i,
                    reason: format!("[{a:#x}, +{n}) is not inside memory this agent registered"),
                })?;
            if !keep.iter().any(|k| k.id == r.id) {
                keep.push(r.clone());
            }
        }
        meta.regions = keep;
        Ok(meta)
    }

    /// Load partial metadata (from a peer's [`Agent::partial_metadata`]): its regions are
    /// added to what is known of a loaded peer (the same incarnation: the same side
    /// channel); a peer not loaded is connected only when `connect_unknown`.
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`] for an unknown peer without `connect_unknown`; as
    /// [`Agent::load_remote_metadata`].
    pub fn load_partial_metadata(
        &self,
        bytes: &[u8],
        connect_unknown: bool,
    ) -> Result<String, AgentError> {
        let meta = AgentMetadata::decode(bytes)?;
        self.load_partial(meta, connect_unknown).inspect_err(|_| {
            self.shared.stats.handshake_failures.inc();
        })
    }

    fn load_partial(
        &self,
        mut meta: AgentMetadata,
        connect_unknown: bool,
    ) -> Result<String, AgentError> {
        match self.remote_metadata(meta.name()) {
            Some(old) if old.side_channel == meta.side_channel => {
                let new: Vec<u32> = meta.regions.iter().map(|r| r.id).collect();
                let kept = old.regions.iter().filter(|r| !new.contains(&r.id)).cloned();
                meta.regions.extend(kept);
                meta.regions.sort_by_key(|r| r.id);
            }
            _ if !connect_unknown => {
                // partial metadata without connection details is for a peer known already
                return Err(AgentError::UnknownPeer(meta.name().to_owned()));
            }
            _ => {}
        }
        self.load_decoded(meta, None)
    }

    /// Whether `peer`'s loaded metadata holds every `(addr, len)` range.
    pub fn remote_covers(&self, peer: &str, ranges: &[(u64, u64)]) -> bool {
        let Some(meta) = self.remote_metadata(peer) else {
            return false;
        };
        ranges
            .iter()
            .all(|&(a, n)| meta.regions.iter().any(|r| holds(r, a, n)))
    }

    /// Write this agent's metadata to the metadata store now (NIXL's `sendLocalMD()`; it
    /// is also written at start and after every registration change).
    pub fn publish_metadata(&self) {
        self.shared.republish();
    }

    /// Serve a `PutMetadata` or `Forget` a peer sent on `s` (see the module's docs).
    pub(crate) fn take_sent(&self, mut s: TcpStream, m: Msg) {
        let from = s.peer_addr().map(|a| a.ip()).map_err(|e| e.to_string());
        let answer = match from.clone() {
            Err(e) => Err(format!("no peer address: {e}")),
            Ok(_) if !self.shared.config.accept_sent_metadata => Err(
                "this agent does not load metadata sent to it (accept_sent_metadata is off): \
                 it fetches its peers' metadata"
                    .to_owned(),
            ),
            Ok(ip) => self.take(ip, m),
        };
        let reply = match answer {
            Ok(name) => Msg::Taken { name },
            Err(message) => {
                tracing::warn!(agent = %self.shared.name, peer = ?from, error = %message,
                    "side channel: sent metadata refused");
                Msg::Refused { message }
            }
        };
        let mut out = Vec::new();
        if msg::encode_into(&mut out, &reply).is_ok() {
            let _ = s.write_all(&out);
        }
    }

    fn take(&self, from: IpAddr, m: Msg) -> Result<String, String> {
        match m {
            Msg::PutMetadata { metadata, partial } => {
                let meta = AgentMetadata::decode(&metadata).map_err(|e| e.to_string())?;
                let name = meta.name().to_owned();
                let data = meta
                    .tcp_data
                    .as_deref()
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                    .ok_or_else(|| format!("agent {name:?}: no data address in its metadata"))?;
                if !same_host(data.ip(), from) {
                    return Err(format!(
                        "agent {name:?} sent from {from} names a data address on another host ({data})"
                    ));
                }
                if let Some(old) = self.remote_metadata(&name) {
                    if old.side_channel != meta.side_channel && self.peer_connected(&name) {
                        return Err(format!(
                            "agent {name:?} is loaded here from {} and still connected: it is \
                             invalidated first",
                            old.side_channel
                        ));
                    }
                }
                let r = if partial {
                    self.load_partial(meta, true)
                } else {
                    self.load_decoded(meta, None)
                };
                r.map_err(|e| e.to_string())?;
                tracing::info!(agent = %self.shared.name, peer = %name, partial,
                    "loaded the metadata a peer sent");
                Ok(name)
            }
            Msg::Forget { name } => {
                let at = lock(&self.shared.peers).get(&name).map(|p| p.addr);
                let Some(at) = at else {
                    return Err(format!("no agent {name:?} is loaded here"));
                };
                if !same_host(at.ip(), from) {
                    return Err(format!(
                        "agent {name:?} was loaded from {at}: a request from {from} cannot invalidate it"
                    ));
                }
                self.invalidate(&name).map_err(|e| e.to_string())?;
                tracing::info!(agent = %self.shared.name, peer = %name,
                    "forgot a peer at its request");
                Ok(name)
            }
            other => Err(format!("not a request for metadata: {other:?}")),
        }
    }
}

/// Whether region `r` holds `[a, a + n)`.
fn holds(r: &RegionMeta, a: u64, n: u64) -> bool {
    a >= r.addr && a.checked_add(n).is_some_and(|e| e <= r.addr + r.len)
}

/// Whether `a` (an address a peer named) is on host `from` (where its connection came
/// from): the same address, or both on loopback.
fn same_host(a: IpAddr, from: IpAddr) -> bool {
    a == from || ((a.is_loopback() || a.is_unspecified()) && from.is_loopback())
}
