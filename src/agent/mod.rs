//! The agent: what an engine embeds instead of libnixl (SPEC §1). It registers memory,
//! exports its metadata, loads peers' metadata over a TCP side channel (checking the
//! handshake), creates / posts / polls / releases READ and WRITE transfers of descriptor
//! lists with optional notifications, and exchanges notifications.
//!
//! Backends: verbs (RC queue pairs per peer and rail on [`crate::transport::verbs`], striping,
//! rail failover and rebuild, notifications on a flow-controlled SEND/RECV channel) and TCP
//! (real sockets, the same semantics). `Auto` takes verbs when a usable rail exists and TCP
//! otherwise, and logs which and why.
//!
//! ```
//! use kvrail::agent::{Agent, AgentConfig, Desc, RemoteAccess, XferOp, XferStatus};
//! let cfg = || AgentConfig { listen: "127.0.0.1:0".parse().unwrap(), ..AgentConfig::default() };
//! let p = Agent::new("prefill-0", cfg())?;
//! let d = Agent::new("decode-0", cfg())?;
//! let src = p.register(1 << 20, RemoteAccess::READ, vec![])?;
//! p.write_region(src, 0, b"kv blocks")?;
//! let dst = d.register(1 << 20, RemoteAccess::NONE, vec![])?;
//! let peer = d.load_remote(p.side_channel_addr())?;
//! let x = d.create_xfer(XferOp::Read, vec![Desc::new(dst, 0, 9)], &peer, vec![Desc::new(src, 0, 9)], Some(b"done".to_vec()))?;
//! d.post(x)?;
//! while d.status(x)? == XferStatus::InProgress { std::thread::yield_now() }
//! assert_eq!(d.status(x)?, XferStatus::Done);
//! let mut got = [0u8; 9];
//! d.read_region(dst, 0, &mut got)?;
//! assert_eq!(&got, b"kv blocks");
//! # Ok::<(), kvrail::agent::AgentError>(())
//! ```

mod backend;
// the host bounce: a driver of device memory on verbs, below the facade
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub mod bounce;
mod config;
mod config_json;
pub(crate) mod control;
mod core;
mod error;
mod gauges;
mod grant;
mod grant_api;
mod local;
pub mod metadata;
mod metrics_http;
pub(crate) mod notifs;
mod region;
mod register;
mod register_api;
mod route;
mod secret;
mod spin;
mod stats;
mod store;
mod store_api;
mod table;
mod tcp;
mod tcp_batch;
mod tcp_io;
#[cfg(feature = "verbs")]
mod verbs;
mod wake;
mod xfer;
// the facade's methods, by theme (each an `impl Agent` of its own)
mod notif_api;
mod peers_api;
mod rails_api;
mod sent_api;
mod shared;
mod start;
mod xfer_api;

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

pub use config::{
    AgentConfig, BackendChoice, DEREGISTER_WAIT, INSECURE_ENV, MAX_TCP_CONNS, SECRET_ENV,
};
pub use error::{AgentError, Fault, XferError};
pub use grant::{Grant, GrantRange, MAX_GRANT_RANGES};
pub use region::{RegionId, RegionMemory, RemoteAccess};
pub use register::{MemRegion, RegisteredMemory};
pub use secret::{ClusterSecret, SecretTooShort, MIN_SECRET};
pub use sent_api::MAX_SENT_METADATA;
#[cfg(feature = "verbs")]
pub(crate) use verbs::config_rails;
pub use xfer::{Desc, XferId, XferOp, XferStatus, MAX_NOTIF_LEN};

use self::core::Core;
use crate::proto::handshake::HandshakeInfo;
use crate::threads::lock;
use metadata::{AgentMetadata, BackendKind, MemKind, RegionMeta};
use region::Region;
use xfer::check_notif_len;

struct Peer {
    meta: Arc<AgentMetadata>,
    conn: control::PeerConn,
    addr: SocketAddr,
    /// Which connection (of this agent's, ever): transfers made on an earlier one are not
    /// posted on this one (the peer may be another process now, with other memory).
    epoch: u64,
}

/// The facade's state: the core (see [`core`]) and what does I/O around it — the
/// configuration, the side channel's address, peers and their connections, the verbs lanes,
/// the host bounce, the metadata store.
pub(crate) struct Shared {
    core: Core,
    config: AgentConfig,
    addr: SocketAddr,
    handshake: HandshakeInfo,
    peers: Mutex<HashMap<String, Peer>>,
    /// Serializes loads of one peer (by name).
    loading: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Ids of target connections.
    next_conn: std::sync::atomic::AtomicU64,
    shutdown: std::sync::atomic::AtomicBool,
    /// Side-channel connections refused by authentication.
    auth_refused: std::sync::atomic::AtomicU64,
    /// Side-channel connections refused by protected mode (no `cluster_secret`, not
    /// `insecure`, a peer beyond loopback), and the addresses already logged.
    open_refused: std::sync::atomic::AtomicU64,
    open_refused_from: Mutex<std::collections::HashSet<std::net::IpAddr>>,
    /// Each peer's first TCP connection, which waiting callers drive (`spin`).
    driven: std::sync::RwLock<Vec<Arc<control::driven::Driven>>>,
    /// The verbs data path, when the agent runs on RDMA.
    #[cfg(feature = "verbs")]
    verbs: Option<Arc<verbs::Verbs>>,
    /// The host-bounce engine (verbs backend): moves device memory through staging slots.
    bounce: std::sync::OnceLock<Box<dyn backend::DevicePath>>,
    /// The agent itself, for what the side channel is asked to do to it (metadata a peer
    /// sent): set once it is built.
    me: std::sync::OnceLock<WeakAgent>,
    /// The metadata store, when configured (see [`store`]).
    #[cfg(feature = "etcd")]
    store: Option<store::AgentStore>,
}

impl std::ops::Deref for Shared {
    type Target = Core;

    fn deref(&self) -> &Core {
        &self.core
    }
}

/// An agent. Cheap to clone; the listener and connections stop when the last clone drops.
#[derive(Clone)]
pub struct Agent {
    shared: Arc<Shared>,
    _guard: Arc<control::Shutdown>,
}

/// An [`Agent`] that does not keep it alive: what its own helper threads hold.
pub(crate) struct WeakAgent {
    shared: std::sync::Weak<Shared>,
    guard: std::sync::Weak<control::Shutdown>,
}

impl WeakAgent {
    /// The agent, while some clone of it lives.
    pub(crate) fn upgrade(&self) -> Option<Agent> {
        Some(Agent {
            shared: self.shared.upgrade()?,
            _guard: self.guard.upgrade()?,
        })
    }
}

/// A consumer's handle on the notifications that start with its prefix (see
/// [`Agent::notif_route`]). Dropping it sends them to the engine's queue again.
pub struct NotifRoute {
    agent: Agent,
    queue: Arc<route::RouteQueue>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.shared.name)
            .field("addr", &self.shared.addr)
            .finish()
    }
}

impl Agent {
    /// A handle that does not keep the agent alive (for its own helper threads).
    pub(crate) fn downgrade(&self) -> WeakAgent {
        WeakAgent {
            shared: Arc::downgrade(&self.shared),
            guard: Arc::downgrade(&self._guard),
        }
    }

    /// The agent's counters and gauges (a connector worker on it adds its own).
    pub fn metrics(&self) -> Arc<crate::metrics::Registry> {
        self.shared.stats.registry.clone()
    }

    /// Where the Prometheus endpoint listens (`AgentConfig::metrics_listen`), if it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self._guard.metrics.get().map(metrics_http::Endpoint::addr)
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The side-channel address peers load this agent's metadata from.
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Register `len` bytes of zeroed host memory owned by the agent, with the least remote
    /// access the role needs, holding `layers` (a convenience: an engine registers its own
    /// memory with [`Agent::register_memory`]).
    ///
    /// # Errors
    /// [`AgentError::Unsupported`] for a zero length.
    pub fn register(
        &self,
        len: usize,
        access: RemoteAccess,
        layers: Vec<String>,
    ) -> Result<RegionId, AgentError> {
        if len == 0 {
            return Err(AgentError::Unsupported("cannot register 0 bytes".into()));
        }
        let buf =
            crate::mem::HostBuffer::new(len).map_err(|e| AgentError::Unsupported(e.to_string()))?;
        self.register_memory(MemRegion::host(buf).access(access).layers(layers))
    }

    /// Deregister a region. When this returns nothing of kvrail's touches the memory any
    /// more: peers' transfers of it that were moving have stopped (and fail, naming the
    /// region), its grants are revoked, and on verbs its keys are deregistered, so the NIC
    /// refuses them. It waits for a chunk in flight, up to [`AgentConfig::deregister_wait`].
    ///
    /// # Errors
    /// [`AgentError::NoRegion`]; [`AgentError::RegionBusy`] while this agent's active
    /// transfers use it; [`AgentError::DeregisterTimeout`] when peers' transfers still
    /// reached it after [`AgentConfig::deregister_wait`] (it stays registered).
    pub fn deregister(&self, id: RegionId) -> Result<(), AgentError> {
        self.shared.deregister_region(id).map(drop)
    }

    /// Copy `data` into a local region (the engine's CPU access to its own memory).
    ///
    /// # Errors
    /// [`AgentError::NoRegion`], [`AgentError::OutOfRange`].
    pub fn write_region(&self, id: RegionId, offset: u64, data: &[u8]) -> Result<(), AgentError> {
        self.shared.region(id.0)?.write(offset, data)
    }

    /// Copy bytes out of a local region.
    ///
    /// # Errors
    /// [`AgentError::NoRegion`], [`AgentError::OutOfRange`].
    pub fn read_region(&self, id: RegionId, offset: u64, out: &mut [u8]) -> Result<(), AgentError> {
        self.shared.region(id.0)?.read(offset, out)
    }

    /// The length of local region `id`.
    ///
    /// # Errors
    /// [`AgentError::NoRegion`].
    pub fn region_len(&self, id: RegionId) -> Result<u64, AgentError> {
        Ok(self.shared.region(id.0)?.len())
    }

    /// Side-channel connections refused because they did not prove the cluster secret
    /// (or brought one to an agent that has none).
    pub fn auth_refusals(&self) -> u64 {
        self.shared
            .auth_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Side-channel connections refused because this agent has no `cluster_secret`, is not
    /// `insecure`, and the peer was not on loopback (protected mode).
    pub fn protected_refusals(&self) -> u64 {
        self.shared
            .open_refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The host memory behind a local region (for layers above the agent that copy device
    /// memory straight into or out of registered staging buffers).
    pub(crate) fn region_buffer(
        &self,
        id: RegionId,
    ) -> Result<Arc<crate::mem::HostBuffer>, AgentError> {
        let r = self.shared.region(id.0)?;
        r.host()
            .cloned()
            .ok_or_else(|| AgentError::Unsupported(format!("region {} is not host memory", id.0)))
    }
}

#[cfg(test)]
mod tests;
