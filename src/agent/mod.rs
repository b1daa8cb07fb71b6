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
mod error;
mod grant;
mod local;
pub mod metadata;
mod metrics_http;
pub(crate) mod notifs;
mod region;
mod register;
mod route;
mod spin;
mod stats;
mod store;
mod table;
mod tcp;
mod tcp_batch;
mod tcp_io;
#[cfg(feature = "verbs")]
mod verbs;
mod wake;

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, MutexGuard};

pub use config::{AgentConfig, BackendChoice, MAX_TCP_CONNS};
pub use control::auth::{ClusterSecret, MIN_SECRET};
pub use error::{AgentError, Fault, XferError};
pub use grant::{Grant, GrantRange, MAX_GRANT_RANGES};
pub use region::{RegionId, RegionMemory, RemoteAccess};
pub use register::{MemRegion, RegisteredMemory};
pub use route::NotifRoute;
#[cfg(feature = "verbs")]
pub(crate) use verbs::config_rails;

use crate::idhash::IdMap;
use crate::proto::handshake::HandshakeInfo;
use metadata::{AgentMetadata, BackendKind, MemKind, RegionMeta};
use region::Region;

/// A descriptor: `len` bytes at `offset` of a region (local, or the peer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// The region.
    pub region: RegionId,
    /// Offset in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl Desc {
    /// `len` bytes at `offset` of `region`.
    pub fn new(region: RegionId, offset: u64, len: u64) -> Self {
        Self {
            region,
            offset,
            len,
        }
    }
}

/// READ (pull the peer's bytes into local memory) or WRITE (push local bytes to the peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    /// Peer → local.
    Read,
    /// Local → peer.
    Write,
}

/// A transfer request's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct XferId(pub u64);

/// Where a transfer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferStatus {
    /// Created or released-for-repost, not posted.
    NotPosted,
    /// Posted; bytes are moving.
    InProgress,
    /// Every byte is in place (and the notification, if any, was delivered after them).
    Done,
    /// Failed, with the cause; nothing reports success for bytes that did not land.
    Error(XferError),
}

struct Peer {
    meta: Arc<AgentMetadata>,
    conn: control::PeerConn,
    addr: SocketAddr,
    /// Which connection (of this agent's, ever): transfers made on an earlier one are not
    /// posted on this one (the peer may be another process now, with other memory).
    epoch: u64,
}

pub(crate) struct Shared {
    name: String,
    config: AgentConfig,
    addr: SocketAddr,
    handshake: HandshakeInfo,
    /// Registered regions by id (ids this agent hands out, so hashed as its own integers).
    regions: Mutex<IdMap<u32, Arc<Region>>>,
    next_region: Mutex<u32>,
    peers: Mutex<HashMap<String, Peer>>,
    xfers: Mutex<table::XferTable<Arc<Region>>>,
    /// Signalled (with `xfers`) whenever a transfer leaves InProgress.
    xfer_done_cv: wake::Wake,
    /// Signalled when a notification is queued.
    notif_cv: wake::Wake,
    /// Serializes loads of one peer (by name).
    loading: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    notifs: Mutex<VecDeque<(String, Vec<u8>)>>,
    /// Numbered notifications per target connection (see [`notifs`]).
    seqs: Mutex<IdMap<u64, notifs::Ordered>>,
    /// Ids of target connections.
    next_conn: std::sync::atomic::AtomicU64,
    shutdown: std::sync::atomic::AtomicBool,
    /// Payload bytes the CPU copied in transfers (see [`Agent::payload_bytes_copied`]).
    copied: std::sync::atomic::AtomicU64,
    /// Transfers ended so far (bumped under the table's lock by `finish`): a polling waiter
    /// takes that lock only when this moved, instead of on every look, which kept the
    /// thread finishing transfers waiting for it.
    ended: std::sync::atomic::AtomicU64,
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
    bounce: std::sync::OnceLock<bounce::Engine>,
    /// Consumers of one kind of notification each (see [`route`]).
    routes: Mutex<Vec<Arc<route::RouteQueue>>>,
    /// Grants made here and grants peers gave (see [`grant`]).
    grants: Mutex<grant::Grants>,
    /// Counters and gauges (see [`crate::metrics`]).
    stats: stats::AgentStats,
    /// The metadata store, when configured (see [`store`]).
    #[cfg(feature = "etcd")]
    store: Option<store::AgentStore>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An agent. Cheap to clone; the listener and connections stop when the last clone drops.
#[derive(Clone)]
pub struct Agent {
    shared: Arc<Shared>,
    _guard: Arc<control::Shutdown>,
}

/// An [`Agent`] that does not keep it alive: what its own helper threads hold.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) struct WeakAgent {
    shared: std::sync::Weak<Shared>,
    guard: std::sync::Weak<control::Shutdown>,
}

#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
impl WeakAgent {
    /// The agent, while some clone of it lives.
    pub(crate) fn upgrade(&self) -> Option<Agent> {
        Some(Agent {
            shared: self.shared.upgrade()?,
            _guard: self.guard.upgrade()?,
        })
    }
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
    /// Create an agent called `name`, listening for its side channel on `config.listen`.
    ///
    /// # Errors
    /// [`AgentError::Unsupported`] for an invalid `stripe_width` or agent name, for
    /// `BackendChoice::Verbs` where no usable rail exists (the error says why), or for
    /// `devices` none of which is a usable rail (auto too: named devices are meant); a build
    /// without the `verbs` feature treats `Auto` as TCP. [`AgentError::Connection`] when it
    /// cannot listen.
    pub fn new(name: &str, mut config: AgentConfig) -> Result<Self, AgentError> {
        if config.cluster_secret.is_none() {
            if let Some(k) = std::env::var_os(SECRET_ENV) {
                let k = ClusterSecret::new(k.into_encoded_bytes())
                    .map_err(|e| AgentError::Unsupported(format!("{SECRET_ENV}: {e}")))?;
                config.cluster_secret = Some(k);
            }
        }
        if let Some(v) = std::env::var_os(INSECURE_ENV) {
            match v.to_str().map(str::to_ascii_lowercase).as_deref() {
                Some("1" | "true" | "yes" | "on") => config.insecure = true,
                Some("0" | "false" | "no" | "off" | "") => {}
                _ => {
                    return Err(AgentError::Unsupported(format!(
                        "{INSECURE_ENV}: {v:?} (1 or 0)"
                    )))
                }
            }
        }
        crate::transport::stripe::StripeMode::from_stripe_width(config.stripe_width)
            .map_err(|e| AgentError::Unsupported(format!("stripe_width: {e}")))?;
        metadata::check_name(name).map_err(AgentError::Unsupported)?;
        if !(1..=config::MAX_TCP_CONNS).contains(&config.tcp_conns) {
            return Err(AgentError::Unsupported(format!(
                "tcp_conns {}: use 1 to {}",
                config.tcp_conns,
                config::MAX_TCP_CONNS
            )));
        }
        #[cfg(feature = "verbs")]
        let verbs = match config.backend {
            BackendChoice::Tcp => {
                tracing::info!(agent = name, "kvrail backend: tcp (configured)");
                None
            }
            choice => match verbs::Verbs::open(&config) {
                Ok(v) => {
                    let names: Vec<&str> = v.rails.iter().map(|r| r.name.as_str()).collect();
                    tracing::info!(agent = name, rails = ?names, "kvrail backend: verbs");
                    Some(Arc::new(v))
                }
                // devices named by the operator are meant: none of them usable is an
                // error even in auto (it fell back to TCP without a word)
                Err(why) if !config.devices.is_empty() => {
                    let why = why.to_string().lines().next().unwrap_or("").to_owned();
                    return Err(AgentError::Unsupported(format!(
                        "devices {:?}: {why} (remove `devices` to let auto use TCP)",
                        config.devices
                    )));
                }
                Err(verbs::OpenError::NoRdma(why)) if choice == BackendChoice::Auto => {
                    tracing::info!(agent = name, "kvrail backend: tcp (no RDMA here: {why})");
                    None
                }
                Err(why) if choice == BackendChoice::Auto => {
                    let why = why.to_string().lines().next().unwrap_or("").to_owned();
                    tracing::warn!(
                        agent = name,
                        "kvrail backend: tcp, falling back from verbs: {why}"
                    );
                    None
                }
                Err(why) => return Err(AgentError::Unsupported(format!("backend verbs: {why}"))),
            },
        };
        #[cfg(not(feature = "verbs"))]
        match config.backend {
            BackendChoice::Verbs => {
                return Err(AgentError::Unsupported(
                    "backend verbs: this build has no verbs support (feature `verbs`)".into(),
                ))
            }
            _ => tracing::info!(agent = name, "kvrail backend: tcp (built without verbs)"),
        }
        // an unreachable store is an error at start, before anything listens
        #[cfg(feature = "etcd")]
        let store = store::open(&config)?;
        #[cfg(not(feature = "etcd"))]
        store::refuse_without_etcd(&config)?;
        let listener = TcpListener::bind(config.listen).map_err(|e| AgentError::Connection {
            what: "cannot listen on",
            addr: config.listen.to_string(),
            message: e.to_string(),
        })?;
        let local = listener.local_addr().map_err(|e| AgentError::Connection {
            what: "cannot listen on",
            addr: config.listen.to_string(),
            message: e.to_string(),
        })?;
        let addr = SocketAddr::new(config.side_channel_host, local.port());
        let handshake = HandshakeInfo {
            agent: name.to_owned(),
            compat_hash: config.compat.hash(),
            kv_layout: config.kv_layout.clone(),
            block_size: config.block_size,
            layers: config.layers.clone(),
            requires_layers: config.require_layers && !config.layers.is_empty(),
            physical_per_logical: config.physical_per_logical.max(1),
        };
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            config,
            addr,
            handshake,
            regions: Mutex::new(IdMap::default()),
            next_region: Mutex::new(1),
            peers: Mutex::new(HashMap::new()),
            xfers: Mutex::new(table::XferTable::default()),
            xfer_done_cv: wake::Wake::default(),
            notif_cv: wake::Wake::default(),
            loading: Mutex::new(HashMap::new()),
            notifs: Mutex::new(VecDeque::new()),
            seqs: Mutex::new(IdMap::default()),
            next_conn: std::sync::atomic::AtomicU64::new(1),
            shutdown: std::sync::atomic::AtomicBool::new(false),
            copied: std::sync::atomic::AtomicU64::new(0),
            ended: std::sync::atomic::AtomicU64::new(0),
            auth_refused: std::sync::atomic::AtomicU64::new(0),
            open_refused: std::sync::atomic::AtomicU64::new(0),
            open_refused_from: Mutex::default(),
            driven: std::sync::RwLock::default(),
            #[cfg(feature = "verbs")]
            verbs,
            bounce: std::sync::OnceLock::new(),
            routes: Mutex::new(Vec::new()),
            grants: Mutex::new(grant::Grants::default()),
            stats: stats::AgentStats::new(name),
            #[cfg(feature = "etcd")]
            store,
        });
        shared.stats.watch(&shared);
        #[cfg(feature = "verbs")]
        if let Some(v) = &shared.verbs {
            v.count_into(&shared.stats.registry, name);
        }
        #[cfg(feature = "verbs")]
        if let Some(v) = &shared.verbs {
            v.run(shared.clone())?;
        }
        let guard = Arc::new(control::serve(shared.clone(), listener, local)?);
        if let Some(at) = shared.config.metrics_listen {
            let ep =
                metrics_http::serve(at, Arc::downgrade(&shared.stats.registry)).map_err(|e| {
                    AgentError::Connection {
                        what: "cannot serve metrics on",
                        addr: at.to_string(),
                        message: e.to_string(),
                    }
                })?;
            tracing::info!(agent = name, metrics = %ep.addr(), "Prometheus metrics served");
            let _ = guard.metrics.set(ep);
        }
        tracing::info!(agent = name, side_channel = %addr, "kvrail agent up");
        if shared.config.cluster_secret.is_none() && !local.ip().is_loopback() {
            if shared.config.insecure {
                tracing::warn!(agent = name, side_channel = %local,
                    "no cluster_secret and insecure: anyone who reaches the side channel can \
                     load this agent's metadata and READ or WRITE its registered memory");
            } else {
                tracing::info!(agent = name, side_channel = %local,
                    "no cluster_secret: only peers on loopback are served ({})",
                    control::auth::PROTECTED_ADVICE);
            }
        }
        let agent = Self {
            shared,
            _guard: guard,
        };
        #[cfg(feature = "verbs")]
        if agent.shared.verbs.is_some() {
            let engine =
                bounce::Engine::start(agent.downgrade(), agent.shared.config.bounce.clone())?;
            let _ = agent.shared.bounce.set(engine);
        }
        #[cfg(feature = "etcd")]
        agent.start_store()?;
        Ok(agent)
    }

    /// A handle that does not keep the agent alive (for its own helper threads).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
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

    /// This agent's metadata.
    pub fn metadata(&self) -> AgentMetadata {
        self.shared.metadata()
    }

    /// Fetch a peer's metadata from its side channel, check the handshake, and connect.
    /// Returns the peer's name. Load again after the peer registered more memory: the
    /// metadata is replaced and the connection kept.
    ///
    /// # Errors
    /// [`AgentError::Connection`] naming the address tried; [`AgentError::Handshake`]
    /// (including a loopback address advertised to a peer on another host);
    /// [`AgentError::Metadata`].
    pub fn load_remote(&self, addr: SocketAddr) -> Result<String, AgentError> {
        let r = crate::proto::handshake::check_advertised(self.shared.addr.ip(), addr.ip())
            .map_err(AgentError::from)
            .and_then(|()| {
                control::fetch_metadata(addr, self.shared.config.cluster_secret.as_ref())
            })
            .and_then(|bytes| self.load(&bytes, Some(addr)));
        if r.is_err() {
            self.shared.stats.handshake_failures.inc();
        }
        r
    }

    /// Load a peer's metadata given as bytes (exchanged some other way) and connect to the
    /// data address it advertises (or `via`, when given).
    ///
    /// # Errors
    /// As [`Agent::load_remote`].
    pub fn load_remote_metadata(
        &self,
        bytes: &[u8],
        via: Option<SocketAddr>,
    ) -> Result<String, AgentError> {
        let r = self.load(bytes, via);
        if r.is_err() {
            self.shared.stats.handshake_failures.inc();
        }
        r
    }

    fn load(&self, bytes: &[u8], via: Option<SocketAddr>) -> Result<String, AgentError> {
        let meta = AgentMetadata::decode(bytes)?;
        crate::proto::handshake::check(
            &self.shared.handshake,
            &meta.handshake,
            self.shared.config.enforce_handshake_compat,
        )?;
        let addr: SocketAddr = match (via, meta.tcp_data.as_deref()) {
            (Some(a), _) => a,
            (None, Some(s)) => s.parse().map_err(|_| AgentError::Connection {
                what: "bad data address",
                addr: s.to_owned(),
                message: "not host:port".into(),
            })?,
            (None, None) => {
                return Err(AgentError::Unsupported(format!(
                    "peer {} has no TCP data address",
                    meta.name()
                )))
            }
        };
        crate::proto::handshake::check_advertised(self.shared.addr.ip(), addr.ip())?;
        let name = meta.name().to_owned();
        // One load of a peer at a time: two concurrent first loads would each connect, and the
        // second would close the first's connection with messages still on it.
        let serial = lock(&self.shared.loading)
            .entry(name.clone())
            .or_default()
            .clone();
        let _serial = lock(&serial);
        // Reloading a connected peer (after it registered more memory) keeps its connection.
        {
            let mut peers = lock(&self.shared.peers);
            if let Some(p) = peers.get_mut(&name) {
                if p.addr == addr && p.conn.is_open() {
                    p.meta = Arc::new(meta);
                    tracing::debug!(agent = %self.shared.name, peer = %name, "peer metadata reloaded");
                    return Ok(name);
                }
            }
        }
        let conn = control::PeerConn::connect(self.shared.clone(), addr, &name, &meta)?;
        tracing::info!(agent = %self.shared.name, peer = %name, %addr, "handshake done; peer connected");
        lock(&self.shared.grants).given.remove(&name);
        if let Some(old) = lock(&self.shared.peers).insert(
            name.clone(),
            Peer {
                meta: Arc::new(meta),
                conn,
                addr,
                epoch: self
                    .shared
                    .next_conn
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            },
        ) {
            old.conn.close();
        }
        Ok(name)
    }

    /// Forget a peer: its connection closes and its in-progress transfers fail. A peer loaded
    /// by name is no longer followed in the metadata store (a restart is not loaded again).
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`].
    pub fn invalidate(&self, peer: &str) -> Result<(), AgentError> {
        self.unfollow(peer);
        self.invalidate_because(peer, "peer metadata invalidated")
    }

    /// [`Agent::invalidate`], with the reason its failed transfers carry.
    pub(crate) fn invalidate_because(&self, peer: &str, why: &str) -> Result<(), AgentError> {
        let p = lock(&self.shared.peers)
            .remove(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.into()))?;
        // Fail its transfers first: closing the connection wakes its reader, which would
        // otherwise fail them with "closed by the peer" (a race the cause must not depend on).
        self.shared.fail_peer(peer, why);
        lock(&self.shared.grants).given.remove(peer);
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.remove_peer(&self.shared, peer);
        }
        if let Some(b) = self.shared.bounce.get() {
            b.forget(peer);
        }
        p.conn.close();
        Ok(())
    }

    /// Create a transfer: `op` between `local` descriptors and the peer's `remote` ones
    /// (equal counts, pairwise equal sizes), with an optional notification the peer gets
    /// after all bytes landed. Validated here; nothing moves until [`Agent::post`]. A remote
    /// descriptor the loaded metadata does not cover, of a peer loaded from the metadata
    /// store, is checked once more after loading the store's newer revision, when it has
    /// one (a region the peer registered a moment ago, before the store's watch delivered it).
    ///
    /// # Errors
    /// [`AgentError::LengthMismatch`], [`AgentError::InvalidDesc`] naming the index,
    /// [`AgentError::UnknownPeer`], [`AgentError::NotifTooLarge`].
    pub fn create_xfer(
        &self,
        op: XferOp,
        local: Vec<Desc>,
        peer: &str,
        remote: Vec<Desc>,
        notif: Option<Vec<u8>>,
    ) -> Result<XferId, AgentError> {
        check_notif_len(notif.as_deref())?;
        let epoch = match self.checked_epoch(op, &local, peer, &remote) {
            // the peer may have registered it a moment ago: ask the store once
            Err(AgentError::InvalidDesc { side: "remote", .. })
                if self.refresh_from_store(peer) =>
            {
                self.checked_epoch(op, &local, peer, &remote)?
            }
            r => r?,
        };
        Ok(lock(&self.shared.xfers).create(op, (peer, epoch), local, remote, notif))
    }

    /// [`Agent::create_xfer`]'s checks against `peer`'s loaded metadata; its epoch.
    fn checked_epoch(
        &self,
        op: XferOp,
        local: &[Desc],
        peer: &str,
        remote: &[Desc],
    ) -> Result<u64, AgentError> {
        let peers = lock(&self.shared.peers);
        let p = peers
            .get(peer)
            .ok_or_else(|| AgentError::UnknownPeer(peer.into()))?;
        let regions = lock(&self.shared.regions);
        table::validate(op, local, remote, &p.meta, |r| {
            regions.get(&r.0).map(|r| r.len())
        })?;
        drop(regions);
        self.shared
            .grants_for(peer, &p.meta, remote, op == XferOp::Write)?;
        Ok(p.epoch)
    }

    /// Post a transfer (again, once it is no longer active).
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`], [`AgentError::UnknownPeer`],
    /// [`AgentError::InvalidDesc`] when a local region was deregistered since.
    pub fn post(&self, id: XferId) -> Result<(), AgentError> {
        let peers = lock(&self.shared.peers);
        let mut xfers = lock(&self.shared.xfers);
        let x = xfers.postable(id)?;
        let p = peers
            .get(&*x.peer)
            .ok_or_else(|| AgentError::UnknownPeer(x.peer.to_string()))?;
        if !p.conn.is_open() {
            // the peer is gone (its queue pairs too): nothing posted would ever complete
            return Err(AgentError::Connection {
                what: "connection to",
                addr: p.addr.to_string(),
                message: format!("{} closed; load the peer again", x.peer),
            });
        }
        if p.epoch != x.peer_epoch {
            // loaded again since (reconnected, or a restarted process under the same name):
            // its descriptors named the old connection's memory
            return Err(AgentError::Connection {
                what: "connection to",
                addr: p.addr.to_string(),
                message: format!(
                    "{} was loaded again after this transfer was created (reconnected or \
                     restarted); create the transfer again",
                    x.peer
                ),
            });
        }
        let mut held: Vec<Arc<Region>> = Vec::with_capacity(x.local.len());
        {
            // held busy under the regions' lock: a deregistration sees them busy, or they
            // see it gone
            let regions = lock(&self.shared.regions);
            for (i, d) in x.local.iter().enumerate() {
                let r = regions
                    .get(&d.region.0)
                    .ok_or_else(|| AgentError::InvalidDesc {
                        side: "local",
                        index: i,
                        reason: format!("region {} is no longer registered", d.region.0),
                    })?;
                if !held.iter().any(|h| Arc::ptr_eq(h, r)) {
                    held.push(r.clone());
                }
            }
            for r in &held {
                r.acquire();
            }
        }
        // fenced memory of the peer is named through the grants it gave (checked again: one
        // may have been forgotten since the transfer was created)
        let grants =
            match self
                .shared
                .grants_for(&x.peer, &p.meta, &x.remote, x.op == XferOp::Write)
            {
                Ok(g) => g,
                Err(e) => {
                    for r in &held {
                        r.release();
                    }
                    return Err(e);
                }
            };
        let x = xfers.begin(id, held)?;
        let _span = tracing::debug_span!("xfer", agent = %self.shared.name, id = id.0, op = ?x.op, peer = %x.peer)
            .entered();
        let posted = backend::Posted {
            id: id.0,
            op: x.op,
            peer: x.peer.clone(),
            local: x
                .local
                .iter()
                .filter_map(|d| {
                    let r = x.held.iter().find(|h| h.id == d.region)?;
                    Some((r.clone(), *d))
                })
                .collect(),
            remote: x.remote.clone(),
            notif: x.notif.clone(),
            meta: p.meta.clone(),
            grants,
        };
        // device memory on either side goes through the host bounce (on verbs); the rest
        // on the peer's queue pairs, else its TCP connection. Only an agent with a bounce
        // engine looks, and it scans the descriptors only when the peer has device memory.
        let device = self.shared.bounce.get().is_some() && {
            let peer_dev: Vec<u32> = (p.meta.regions.iter())
                .filter(|m| m.kind != MemKind::Host)
                .map(|m| m.id)
                .collect();
            x.held.iter().any(|r| r.kind != MemKind::Host)
                || (!peer_dev.is_empty() && x.remote.iter().any(|d| peer_dev.contains(&d.region.0)))
        };
        #[cfg(feature = "verbs")]
        let verbs: Option<&dyn backend::Backend> = self
            .shared
            .verbs
            .as_deref()
            .filter(|v| v.has_peer(&posted.peer))
            .map(|v| v as &dyn backend::Backend);
        #[cfg(not(feature = "verbs"))]
        let verbs: Option<&dyn backend::Backend> = None;
        let tcp;
        let chosen: &dyn backend::Backend = match (verbs, self.shared.bounce.get()) {
            (Some(_), Some(engine)) if device => engine,
            (Some(v), _) => v,
            (None, _) => {
                // the peer's TCP connection (one of its lanes, for a large transfer)
                let bytes = posted.local.iter().map(|(_, d)| d.len).sum();
                let (tx, open) = p.conn.sender_for(bytes, posted.notif.is_some());
                tcp = backend::TcpPath { tx, open };
                &tcp
            }
        };
        // Nothing is handed over with the agent's maps locked: a backend that fails the
        // transfer takes them again (and the verbs engine is never taken under them).
        drop(xfers);
        drop(peers);
        if let Err(e) = chosen.start(self, posted) {
            self.shared
                .finish(id.0, Err(XferError::Post(e.to_string())));
            return Err(e);
        }
        Ok(())
    }

    /// Replace the notification a transfer sends when it next completes (None: none), for a
    /// transfer posted again with another message (NIXL's `transfer(handle, notif_msg)`).
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`], [`AgentError::NotifTooLarge`].
    pub fn set_notif(&self, id: XferId, notif: Option<Vec<u8>>) -> Result<(), AgentError> {
        check_notif_len(notif.as_deref())?;
        lock(&self.shared.xfers).set_notif(id, notif)
    }

    /// Where a transfer stands.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub fn status(&self, id: XferId) -> Result<XferStatus, AgentError> {
        self.shared.poll_for_status(id); // adaptive progress: the caller's poll
        lock(&self.shared.xfers).status(id).cloned()
    }

    /// Block until transfer `id` is no longer in progress, or `timeout` passed; returns its
    /// status then (still [`XferStatus::InProgress`] on a timeout). Sleeps; an engine
    /// thread that would otherwise spin on [`Agent::status`] can wait here instead. With
    /// [`AgentConfig::progress_spin_us`] it polls the completion queues itself first (on
    /// TCP it looks for the answer of a transfer of at most 16 KiB before sleeping).
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub fn wait(&self, id: XferId, timeout: std::time::Duration) -> Result<XferStatus, AgentError> {
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        let budget = self
            .shared
            .spin_budget(|| lock(&self.shared.xfers).bytes(id));
        let ended = &self.shared.ended;
        let mut seen = None; // the count of ended transfers at the last look
        let polled = self.shared.spin_until(budget, start, deadline, || {
            let now = ended.load(std::sync::atomic::Ordering::Acquire);
            if seen == Some(now) {
                return Ok(None); // nothing ended since: no need to look
            }
            seen = Some(now);
            let st = lock(&self.shared.xfers).status(id)?.clone();
            Ok((st != XferStatus::InProgress).then_some(st))
        })?;
        if let Some(st) = polled {
            self.shared.stats.waits[0].inc();
            return Ok(st);
        }
        self.shared.stats.waits[1].inc();
        let mut xfers = lock(&self.shared.xfers);
        loop {
            let st = xfers.status(id)?;
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if *st != XferStatus::InProgress || left.is_zero() {
                return Ok(st.clone());
            }
            xfers = self.shared.xfer_done_cv.wait_timeout(xfers, left);
        }
    }

    /// Release a transfer that is not in progress.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`].
    pub fn release(&self, id: XferId) -> Result<(), AgentError> {
        lock(&self.shared.xfers).release(id)?;
        if let Some(b) = self.shared.bounce.get() {
            b.forget_xfer(id.0);
        }
        Ok(())
    }

    /// Send a notification to a peer; peers receive them in the order they were sent.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvrail::agent::{Agent, AgentConfig};
    /// let cfg = || AgentConfig { listen: "127.0.0.1:0".parse().unwrap(), ..AgentConfig::default() };
    /// let (p, d) = (Agent::new("prefill-0", cfg())?, Agent::new("decode-0", cfg())?);
    /// let peer = d.load_remote(p.side_channel_addr())?;
    /// d.send_notif(&peer, b"req-7:1".to_vec())?;
    /// d.send_notif(&peer, b"req-8:1".to_vec())?;
    /// let mut got = Vec::new();
    /// while got.len() < 2 && p.wait_for_notifs(Duration::from_secs(10)) {
    ///     got.extend(p.get_new_notifs());
    /// }
    /// assert_eq!(got, [("decode-0".to_string(), b"req-7:1".to_vec()), ("decode-0".to_string(), b"req-8:1".to_vec())]);
    /// # Ok::<(), kvrail::agent::AgentError>(())
    /// ```
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], [`AgentError::NotifTooLarge`].
    pub fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), AgentError> {
        check_notif_len(Some(&bytes))?;
        // A peer with a verbs channel is known: sent there without a look in the peer table.
        #[cfg(feature = "verbs")]
        let bytes = match &self.shared.verbs {
            Some(v) => match v.notify_on_chan(&self.shared, peer, bytes) {
                Ok(()) => {
                    self.shared.stats.notifs_sent.inc();
                    return Ok(());
                }
                Err(bytes) => bytes,
            },
            None => bytes,
        };
        if !lock(&self.shared.peers).contains_key(peer) {
            return Err(AgentError::UnknownPeer(peer.into()));
        }
        self.shared.stats.notifs_sent.inc();
        // Lock order: the verbs engine is taken without `peers` held.
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            v.notify(&self.shared, peer, bytes);
            return Ok(());
        }
        self.shared.send_tcp_notif(peer, None, bytes);
        Ok(())
    }

    /// Notifications received since the last call, in arrival order (per peer: send order).
    /// With [`AgentConfig::progress_spin_us`] it polls the completion queues once first, as
    /// [`Agent::status`] does: a NIXL-style loop that only reads notifications drives their
    /// arrival itself instead of waiting for the progress thread.
    pub fn get_new_notifs(&self) -> Vec<(String, Vec<u8>)> {
        self.shared.poll_once(control::driven::Pass::Look);
        lock(&self.shared.notifs).drain(..).collect()
    }

    /// Like [`Agent::get_new_notifs`], but sleeps until at least one notification is there
    /// or `timeout` passed (then the list is empty). With
    /// [`AgentConfig::progress_spin_us`] it polls the completion queues itself first (on
    /// TCP it looks for the notifications before sleeping).
    pub fn wait_notifs(&self, timeout: std::time::Duration) -> Vec<(String, Vec<u8>)> {
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        let budget = self.shared.spin_budget(|| None);
        let polled = self.shared.spin_until(budget, start, deadline, || {
            let mut q = lock(&self.shared.notifs);
            Ok((!q.is_empty()).then(|| q.drain(..).collect()))
        });
        if let Ok(Some(got)) = polled {
            self.shared.stats.waits[0].inc();
            return got;
        }
        self.shared.stats.waits[1].inc();
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        route::drain_waiting(&self.shared.notifs, &self.shared.notif_cv, left)
    }

    /// Sleep until a notification is queued for [`Agent::get_new_notifs`] (true) or
    /// `timeout` passed (false); takes none. For a thread that serves notifications under a
    /// lock of its own: it takes that lock, then the notifications, so that they are handled
    /// in arrival order whoever takes them.
    pub fn wait_for_notifs(&self, timeout: std::time::Duration) -> bool {
        route::wait_nonempty(&self.shared.notifs, &self.shared.notif_cv, timeout)
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

    /// The rail that carries notifications to `peer` (verbs backend, on a SEND/RECV channel
    /// of its own); `None` when they go over the TCP connection (TCP backend, or after that
    /// channel failed).
    pub fn notif_rail(&self, peer: &str) -> Option<String> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.notif_rail(peer);
        }
        let _ = peer;
        None
    }

    /// Fault injection, for tests (not part of the API): `frame` as it is on the verbs
    /// notification channel to `peer`, as a broken or foreign peer would send it.
    ///
    /// # Errors
    /// [`AgentError::Unsupported`]: no live channel to `peer`, or it has no room now.
    #[doc(hidden)]
    pub fn inject_notif_frame(&self, peer: &str, frame: &[u8]) -> Result<(), AgentError> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.inject_frame(peer, frame).map_err(AgentError::Unsupported);
        }
        let _ = (peer, frame);
        Err(AgentError::Unsupported("no verbs backend".into()))
    }

    /// Whether each rail's device can register dma-buf memory, probed once when the agent
    /// started (verbs backend; empty on TCP, which never registers device memory).
    pub fn dmabuf_support(&self) -> Vec<crate::mem::NicDmabuf> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.rails.iter().map(|r| r.dmabuf_report()).collect();
        }
        Vec::new()
    }

    /// The local links the agent's rails run on, as (RDMA device, port) (verbs backend;
    /// empty on TCP).
    pub fn local_links(&self) -> Vec<(String, u8)> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            // a rail's name is `device:port`
            return v
                .rails
                .iter()
                .map(|r| {
                    let dev = r.name.rsplit_once(':').map_or(&*r.name, |(d, _)| d);
                    (dev.to_owned(), r.port)
                })
                // a rail's lanes (qps_per_rail) are one link
                .fold(Vec::new(), |mut v, l| {
                    if !v.contains(&l) {
                        v.push(l);
                    }
                    v
                });
        }
        Vec::new()
    }

    /// Bytes moved over each rail since the agent started (verbs backend; empty on TCP).
    pub fn rail_bytes(&self) -> Vec<(String, u64)> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.rail_bytes();
        }
        Vec::new()
    }

    /// The local rails with a working queue pair to `peer` (empty when it is reached over
    /// TCP).
    pub fn peer_rails(&self, peer: &str) -> Vec<String> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.peer_rails(peer);
        }
        let _ = peer;
        Vec::new()
    }

    /// The metadata last loaded from `peer` (its regions, with the layers each holds).
    pub fn remote_metadata(&self, peer: &str) -> Option<Arc<AgentMetadata>> {
        lock(&self.shared.peers).get(peer).map(|p| p.meta.clone())
    }

    /// True while `peer` is loaded and its connection is up (false once the peer closed
    /// it, died, or was invalidated): a waiting caller can stop waiting for its answer.
    pub fn peer_connected(&self, peer: &str) -> bool {
        lock(&self.shared.peers)
            .get(peer)
            .is_some_and(|p| p.conn.is_open())
    }

    /// True while `peer` is connected and was loaded from `addr` (`host:port`): a peer that
    /// died, or came back at another address (restarted), must be loaded again.
    pub(crate) fn peer_connected_at(&self, peer: &str, addr: &str) -> bool {
        let Ok(addr) = addr.parse::<SocketAddr>() else {
            return false;
        };
        lock(&self.shared.peers)
            .get(peer)
            .is_some_and(|p| p.addr == addr && p.conn.is_open())
    }

    /// Names of the loaded peers.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = lock(&self.shared.peers).keys().cloned().collect();
        v.sort();
        v
    }
}

/// The environment variable an agent takes its cluster secret from when its configuration
/// sets none (keeps the secret off command lines).
pub const SECRET_ENV: &str = "KVRAIL_CLUSTER_SECRET";

/// The environment variable that sets [`AgentConfig::insecure`] ("1") for programs that
/// cannot pass a configuration (a NIXL program on `kvrail.nixl`).
pub const INSECURE_ENV: &str = "KVRAIL_INSECURE";

/// The largest notification, in bytes: one fits a control frame with room for its header
/// (larger ones are refused when handed in, before anything is queued).
pub const MAX_NOTIF_LEN: usize = control::msg::CHUNK;

fn check_notif_len(n: Option<&[u8]>) -> Result<(), AgentError> {
    match n {
        Some(b) if b.len() > MAX_NOTIF_LEN => Err(AgentError::NotifTooLarge {
            len: b.len(),
            max: MAX_NOTIF_LEN,
        }),
        _ => Ok(()),
    }
}

/// How long deregistration waits by default for what still reaches a region — chunks of
/// peers' transfers moving on TCP, a finished transfer's last references, work requests on
/// verbs — before it gives up (the region stays registered; see
/// [`AgentError::DeregisterTimeout`] and [`AgentConfig::deregister_wait`]).
pub const DEREGISTER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Shared {
    /// Deregister region `id` and hand its memory back. Refused while this agent's own
    /// transfers use it. Otherwise, before this returns: no lookup finds it any more (a
    /// peer's new READ or WRITE of it is refused, naming it), its grants are revoked, the
    /// chunks of peers' transfers inside its gate have moved and no more enter (what is
    /// left of those transfers fails with the reason), and on verbs its keys are
    /// deregistered once no work request holds them — so nothing reads or writes the
    /// memory from then on. What does not let go within `deregister_wait` puts it back.
    fn deregister_region(&self, id: RegionId) -> Result<RegionMemory, AgentError> {
        let r = {
            let mut regions = lock(&self.regions);
            let r = regions.get(&id.0).ok_or(AgentError::NoRegion(id.0))?;
            let transfers = r.in_use();
            if transfers > 0 {
                return Err(AgentError::RegionBusy {
                    region: id.0,
                    transfers,
                });
            }
            regions.remove(&id.0).ok_or(AgentError::NoRegion(id.0))?
        };
        self.revoke_region_grants(id.0);
        let (start, wait) = (std::time::Instant::now(), self.config.deregister_wait);
        let put_back = |r: Arc<Region>, holders: String| {
            r.gate.reopen();
            lock(&self.regions).insert(id.0, r);
            tracing::warn!(agent = %self.name, region = id.0, %holders,
                "deregistration timed out; the region stays registered");
            Err(AgentError::DeregisterTimeout {
                region: id.0,
                holders,
                waited_ms: start.elapsed().as_millis() as u64,
            })
        };
        if let Err(n) = r.gate.close(wait) {
            return put_back(r, format!("{n} chunk(s) of transfers in progress"));
        }
        // the last reference: a finished transfer's may still be on its way out
        let mut r = r;
        let region = loop {
            match Arc::try_unwrap(r) {
                Ok(region) => break region,
                Err(again) if start.elapsed() < wait => {
                    r = again;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(held) => {
                    let n = Arc::strong_count(&held) - 1;
                    return put_back(held, format!("{n} reference(s) of ended transfers"));
                }
            }
        };
        // verbs: the keys go now (a work request still holding one defers `ibv_dereg_mr`
        // until its completion, so wait for those)
        #[cfg(feature = "verbs")]
        while crate::transport::verbs::work_in_flight(&region.mrs) > 0 {
            if start.elapsed() >= wait {
                let n = crate::transport::verbs::work_in_flight(&region.mrs);
                return put_back(Arc::new(region), format!("{n} work request(s)"));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mem = region.into_memory();
        self.republish();
        tracing::debug!(agent = %self.name, region = id.0, "memory deregistered");
        Ok(mem)
    }

    fn region(&self, id: u32) -> Result<Arc<Region>, AgentError> {
        lock(&self.regions)
            .get(&id)
            .cloned()
            .ok_or(AgentError::NoRegion(id))
    }

    fn metadata(&self) -> AgentMetadata {
        #[cfg(feature = "verbs")]
        let verbs = self.verbs.as_ref();
        #[cfg(not(feature = "verbs"))]
        let verbs: Option<&()> = None;
        let regions = lock(&self.regions);
        let mut rs: Vec<RegionMeta> = regions
            .values()
            .map(|r| RegionMeta {
                id: r.id.0,
                kind: r.kind,
                addr: r.addr(),
                len: r.len(),
                #[cfg(feature = "verbs")]
                rkeys: r.mrs.iter().map(|m| m.rkey()).collect(),
                #[cfg(not(feature = "verbs"))]
                rkeys: Vec::new(),
                remote_read: r.access.read,
                remote_write: r.access.write,
                layers: r.layers.names.clone(),
                device: r.device,
                layer_offsets: r.layers.offsets.clone(),
                layer_len: r.layers.len,
                fenced: r.fenced,
            })
            .collect();
        rs.sort_by_key(|r| r.id);
        #[cfg(feature = "verbs")]
        let rails: Vec<metadata::RailAddr> = verbs
            .map(|v| v.rails.iter().map(|r| r.addr.clone()).collect())
            .unwrap_or_default();
        #[cfg(not(feature = "verbs"))]
        let rails = Vec::new();
        AgentMetadata {
            version: metadata::VERSION,
            handshake: self.handshake.clone(),
            backend: if verbs.is_some() {
                BackendKind::Verbs
            } else {
                BackendKind::Tcp
            },
            side_channel: self.addr.to_string(),
            rails,
            tcp_data: Some(self.addr.to_string()),
            regions: rs,
        }
    }

    /// The notification (and its peer) of in-progress transfer `id`, looked up *before* the
    /// transfer is finished: once the engine sees it done it may release it at once, and a
    /// lookup after that would lose the notification.
    fn xfer_notif(&self, id: u64) -> Option<(Arc<str>, Vec<u8>)> {
        lock(&self.xfers).completion_notif(id)
    }

    /// Verbs: ask `peer` for queue pairs (a rail's rebuild); the answer comes back through
    /// the connection's reader.
    #[cfg(feature = "verbs")]
    fn request_qps(&self, peer: &str, req: verbs::QpRequest) {
        // Lock order: the verbs engine (taken by `rebuilt`) is never taken under `peers`.
        let sent = lock(&self.peers)
            .get(peer)
            .is_some_and(|p| p.conn.try_submit(control::Work::QpOpen(req)));
        if !sent {
            if let Some(v) = &self.verbs {
                v.rebuilt(peer, Err("no open connection to the peer".into()));
            }
        }
    }

    /// Ask `peer` for the receiving end of a rebuilt notification channel on its rail
    /// `rail`, connected to `ep`.
    #[cfg(feature = "verbs")]
    fn request_chan(&self, peer: &str, rail: u32, ep: crate::transport::verbs::Endpoint) {
        // Lock order: the verbs engine (taken by `chan_rebuilt`) is never taken under `peers`.
        let sent = lock(&self.peers)
            .get(peer)
            .is_some_and(|p| p.conn.try_submit(control::Work::ChanOpen(rail, ep)));
        if !sent {
            if let Some(v) = &self.verbs {
                v.chan_rebuilt(peer, Err("no open connection to the peer".into()));
            }
        }
    }

    /// A verbs transfer failed.
    #[cfg(feature = "verbs")]
    fn xfer_failed(&self, id: u64, why: String) {
        self.finish(id, Err(XferError::Rdma(why)));
    }

    /// A transfer ended: set its status and release its regions.
    fn finish(&self, id: u64, res: Result<(), XferError>) {
        let mut xfers = lock(&self.xfers);
        let op = xfers.op_of(id);
        let outcome = res.clone();
        if let Some(held) = xfers.finish(id, res) {
            if let Some(op) = op {
                self.stats.ended(&self.name, op, &outcome);
            }
            for r in held {
                r.release();
            }
            self.ended
                .fetch_add(1, std::sync::atomic::Ordering::Release);
            self.xfer_done_cv.notify_all();
        }
    }

    /// `n` bytes of READ `id` came for its descriptor `idx` at `at` (see
    /// [`table::XferTable::arrived`]).
    fn read_arrival(&self, id: u64, at: (u32, u64), n: u64) -> table::Arrival {
        lock(&self.xfers).arrived(id, at, n)
    }

    /// True while transfer `id` is in progress.
    fn xfer_in_progress(&self, id: u64) -> bool {
        lock(&self.xfers).in_progress(id)
    }

    /// WRITE `id`'s end is about to be sent (its Ack may complete it from now on).
    fn xfer_end_sent(&self, id: u64) {
        lock(&self.xfers).end_sent(id);
    }

    fn fail_peer(&self, peer: &str, why: &str) {
        let ids = lock(&self.xfers).active_with(peer);
        for id in ids {
            let why = why.to_owned();
            self.finish(
                id,
                Err(XferError::ConnectionLost {
                    peer: peer.to_owned(),
                    why,
                }),
            );
        }
    }

    /// The CPU copied `n` payload bytes of a transfer.
    fn count_copy(&self, n: u64) {
        self.copied
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// A notification arrived from `from`: the host-bounce engine's go to it, the rest to
    /// their consumer.
    fn deliver_notif(&self, from: &str, bytes: Vec<u8>) {
        if let Some(b) = self
            .bounce
            .get()
            .filter(|_| bytes.starts_with(bounce::wire::MAGIC))
        {
            b.incoming(from, bytes);
            return;
        }
        self.deliver_user_notif(from, bytes);
    }

    /// Queue a notification for its consumer: the route of its kind, else the engine's
    /// queue.
    fn deliver_user_notif(&self, from: &str, bytes: Vec<u8>) {
        self.stats.notifs_received.inc();
        if let Err(bytes) = self.route_notif(from, bytes) {
            lock(&self.notifs).push_back((from.to_owned(), bytes));
            self.notif_cv.notify_all();
        }
    }

    /// The local descriptor `idx` of READ transfer `id`, to copy arriving bytes into.
    fn read_target(&self, id: u64, idx: u32) -> Option<(Arc<Region>, u64, u64)> {
        lock(&self.xfers).read_target(id, idx)
    }
}

#[cfg(test)]
mod tests;
