//! Agent configuration.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::proto::handshake::{CompatInfo, Direction};

/// The most TCP connections per peer ([`AgentConfig::tcp_conns`]).
pub const MAX_TCP_CONNS: u32 = 16;

/// Which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// Verbs when a usable RDMA rail exists, else TCP (the agent logs which and why).
    Auto,
    /// RDMA verbs only.
    Verbs,
    /// TCP only.
    Tcp,
}

/// How an agent is set up.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Address the side channel (and the TCP data path) listens on.
    pub listen: SocketAddr,
    /// Address advertised to peers in the metadata (`side_channel_host`); the default,
    /// 127.0.0.1, only works when every peer is on this host — loading a peer on another
    /// host with it is refused, naming this setting.
    pub side_channel_host: IpAddr,
    /// Backend choice.
    pub backend: BackendChoice,
    /// `stripe_width`: unset (one rail per transfer) or 0 (stripe across all rails).
    pub stripe_width: Option<i64>,
    /// `enforce_handshake_compat`: false skips the compatibility-hash check only.
    pub enforce_handshake_compat: bool,
    /// What the compatibility hash covers.
    pub compat: CompatInfo,
    /// KV layout (`HND`, `NHD`, …).
    pub kv_layout: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Layer names this agent's regions hold (empty: no layer routing).
    pub layers: Vec<String>,
    /// Refuse a peer that lacks one of `layers` (a pipeline-parallel producer routing by
    /// layer name); false only advertises them (a consumer holding every layer).
    pub require_layers: bool,
    /// Physical KV blocks per logical block, told to peers in the handshake (1: the same).
    pub physical_per_logical: u32,
    /// The accelerator's NUMA node for rail selection (-1: any).
    pub numa: i32,
    /// Use only these RDMA devices as rails (empty: every usable one): `DEV` (every port
    /// of it), `DEV/PORT` or `DEV:PORT`.
    pub devices: Vec<String>,
    /// Use this GID table index on every rail instead of kvrail's choice (perftest's `-x`);
    /// a rail without that entry fails the start, naming what its table holds.
    pub gid_index: Option<u32>,
    /// At most this path MTU in bytes (256, 512, 1024, 2048, 4096; perftest's `-m`).
    pub mtu: Option<u32>,
    /// Adaptive progress: a caller waiting in [`Agent::wait`](super::Agent::wait) or
    /// [`Agent::wait_notifs`](super::Agent::wait_notifs) polls the completion queues itself
    /// (notifications' too) for up to this many microseconds before sleeping, each
    /// completion it finds restarting the budget; what it finds it dispatches in place, and
    /// one-rail transfers posted meanwhile are posted by the posting thread itself (as
    /// perftest's one thread posts and polls). [`Agent::status`](super::Agent::status) polls
    /// once. 0 (the default): nobody polls; the progress thread sleeps on the completion
    /// channels and wakes waiters. An idle agent never spins either way. On TCP, for answers
    /// of at most 16 KiB, the waiting caller drives each peer's first connection itself: it
    /// sends what is queued (in one `sendmsg`) and reads the answers, while the connection's
    /// writer and reader threads sleep until one budget (at most 16 ms) after its last pass,
    /// or until it goes to sleep: work posted after a caller's last wait or status, with
    /// nobody driving, goes out that much later at most. On verbs, a
    /// consumer that does not poll (a notification route, a thread sleeping in `wait` beside
    /// polling ones) may see a completion up to one budget or 16 ms, whichever is longer,
    /// late after the polling callers stop.
    pub progress_spin_us: u32,
    /// Queue pairs per rail to each peer (perftest's `-q`; 1..=16, default 1). Each is a
    /// lane of its own (named `DEV:PORT/qpK`, with its own completion queue and poster
    /// thread) that the planner spreads transfers over like rails; a port's lanes share its
    /// protection domain, so memory is registered once per port whatever the count. Where
    /// the device's packet work is CPU work in the posting thread (Soft-RoCE), two lanes
    /// keep two cores at it: one rail's deep queue of 64 KiB and 1 MiB WRITEs and 64 KiB
    /// READs moved 1.1–2.1× what `ib_write_bw` / `ib_read_bw` did in the same rounds
    /// (README, "Two queue pairs on one rail"). With more than one lane a caller that polls (`progress_spin_us`) leaves the
    /// posting to the lanes' posters too (with one it posts its own, as perftest does).
    pub qps_per_rail: u32,
    /// TCP connections to each peer on the TCP backend (1..=16, default 1). With more, each
    /// is a lane with its own writer and reader threads: a transfer of at least 1 MiB that
    /// carries no notification goes whole on the next lane in turn, so large transfers in
    /// flight spread over several cores (one connection's sender runs on one core: its copy
    /// into the socket and, on loopback, the receiver's TCP work). Small work,
    /// notifications and transfers carrying one stay on the first connection, in order.
    /// Worth it where cores are idle while one connection's sender is busy; on a 2-core
    /// host running both ends the cores are already busy and it gained nothing (README). On
    /// verbs the data goes over queue pairs and one connection is opened.
    pub tcp_conns: u32,
    /// Where rail discovery reads sysfs and `/proc/net/route` (None: the running system;
    /// a fixture tree in tests, see `tests/fixtures/make_sysfs.py`).
    pub sysfs_root: Option<std::path::PathBuf>,
    /// How device memory is staged on verbs (host bounce).
    pub bounce: BounceConfig,
    /// `cluster_secret`: when set, every side-channel connection must prove it (both ways)
    /// before it gets metadata or queue pairs. Unset, only peers on loopback are served
    /// (their connection comes from 127.0.0.0/8 or ::1), unless [`Self::insecure`].
    pub cluster_secret: Option<super::secret::ClusterSecret>,
    /// `insecure`: with no `cluster_secret`, serve peers from any address without
    /// authentication (anyone who reaches the side channel can then load this agent's
    /// metadata and READ or WRITE its registered memory; the agent warns at start). Also
    /// set by `KVRAIL_INSECURE=1` ([`INSECURE_ENV`]). Default false: protected mode.
    pub insecure: bool,
    /// `metrics_listen`: serve the agent's counters and gauges (a connector worker's too)
    /// in the Prometheus text format at `http://<addr>/metrics` (None: no endpoint; read
    /// them with [`super::Agent::metrics`]). Port 0 picks one ([`super::Agent::metrics_addr`]).
    pub metrics_listen: Option<SocketAddr>,
    /// `metadata_store` (with `metadata_namespace`, `metadata_lease_ttl_s`): publish this
    /// agent's metadata in etcd and load peers by name ([`super::Agent::load_by_name`]);
    /// see [`crate::store`]. Needs the `etcd` cargo feature. None: side channel only.
    pub metadata_store: Option<crate::store::StoreConfig>,
    /// `deregister_wait_ms`: how long [`super::Agent::deregister`] waits for what still
    /// reaches a region (a chunk of a peer's transfer on TCP, work requests on verbs)
    /// before it gives up and the region stays registered (default
    /// [`DEREGISTER_WAIT`], 10 s).
    pub deregister_wait: std::time::Duration,
    /// `accept_sent_metadata`: load metadata a peer sends to the side channel (NIXL's
    /// `sendLocalMD(ip, port)`) and connect back to it, and forget a peer when it says so
    /// from its own address (`invalidateLocalMD(ip, port)`). Default false: peers' metadata
    /// is only fetched (or loaded by name from the store) by this agent's own caller.
    pub accept_sent_metadata: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            side_channel_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            backend: BackendChoice::Auto,
            stripe_width: None,
            enforce_handshake_compat: true,
            compat: CompatInfo {
                model: String::new(),
                dtype: String::new(),
                attn_backend: String::new(),
                connector_version: env!("CARGO_PKG_VERSION").into(),
                direction: Direction::Pull,
                draft_model: None,
            },
            kv_layout: "HND".into(),
            block_size: 16,
            layers: Vec::new(),
            require_layers: true,
            physical_per_logical: 1,
            numa: -1,
            devices: Vec::new(),
            gid_index: None,
            mtu: None,
            qps_per_rail: 1,
            tcp_conns: 1,
            progress_spin_us: 0,
            sysfs_root: None,
            bounce: BounceConfig::default(),
            cluster_secret: None,
            insecure: false,
            metrics_listen: None,
            metadata_store: None,
            deregister_wait: DEREGISTER_WAIT,
            accept_sent_metadata: false,
        }
    }
}

/// Whether device filter entry `want` (`DEV`, `DEV/PORT` or `DEV:PORT`) names port `port`
/// of `device`.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) fn device_matches(want: &str, device: &str, port: u8) -> bool {
    match want.split_once(['/', ':']) {
        Some((d, p)) => d == device && p.parse::<u8>().is_ok_and(|p| p == port),
        None => want == device,
    }
}

/// The environment variable an agent takes its cluster secret from when its configuration
/// sets none (keeps the secret off command lines).
pub const SECRET_ENV: &str = "KVRAIL_CLUSTER_SECRET";

/// The environment variable that sets [`AgentConfig::insecure`] ("1") for programs that
/// cannot pass a configuration (a NIXL program on `kvrail.nixl`).
pub const INSECURE_ENV: &str = "KVRAIL_INSECURE";

/// How long deregistration waits by default for what still reaches a region — chunks of
/// peers' transfers moving on TCP, a finished transfer's last references, work requests on
/// verbs — before it gives up (the region stays registered; see
/// [`AgentError::DeregisterTimeout`](super::error::AgentError::DeregisterTimeout) and [`AgentConfig::deregister_wait`]).
pub const DEREGISTER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How the agent stages device memory on verbs (`AgentConfig::bounce`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BounceConfig {
    /// Staging slots per peer and direction (chunks in flight); at least 1.
    pub slots: u32,
    /// Bytes per slot (largest chunk).
    pub slot_size: u64,
    /// A transfer that sees no progress from its peer for this long fails.
    pub ack_timeout: std::time::Duration,
}

impl Default for BounceConfig {
    fn default() -> Self {
        Self {
            slots: 4,
            slot_size: 1 << 20,
            ack_timeout: std::time::Duration::from_secs(30),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::device_matches;

    #[test]
    fn device_filters_name_a_device_or_one_port_of_it() {
        assert!(device_matches("mlx5_0", "mlx5_0", 1));
        assert!(device_matches("mlx5_0", "mlx5_0", 2));
        assert!(device_matches("mlx5_0/2", "mlx5_0", 2));
        assert!(device_matches("mlx5_0:2", "mlx5_0", 2));
        assert!(!device_matches("mlx5_0/1", "mlx5_0", 2));
        assert!(!device_matches("mlx5_0/x", "mlx5_0", 1));
        assert!(!device_matches("mlx5_1", "mlx5_10", 1));
    }
}
