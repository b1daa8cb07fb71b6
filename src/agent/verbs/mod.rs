//! The agent's verbs data path: the selected rails (one PD and one CQ with a completion
//! channel per rail), queue pairs per (peer, local rail) exchanged over the TCP attach
//! connection, transfers planned by the stripe planner and posted in chunks that never
//! exceed a queue's depth, and a progress thread that sleeps on the CQ channels (mio) and
//! finishes a transfer only when every slice on every rail completed. A transfer's
//! notification is sent only then, on the peer's notification channel ([`notif`]), in order
//! with the others.

mod completions;
mod dispatch;
mod peers;
mod regions;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use smallvec::SmallVec;

mod notif;
mod pair_key;
mod polling;
mod poster;
mod rebuild;
pub(crate) use notif::chan_connect_options;
pub(crate) use rebuild::QpRequest;

use super::core::Core;
use super::region::Region;
use super::{config::AgentConfig, error::AgentError, xfer::Desc, xfer::XferOp};
use crate::agent::metadata::{AgentMetadata, RailAddr};
use crate::idhash::IdMap;
use crate::rails::{discover, discover_gids_of, select, AddrSource, Ipv4If, SysfsRoot};
use crate::threads::lock;
use crate::transport::stripe::{DescPair, Plan, Planner, Progress, StripeMode, XferState};
use crate::transport::verbs::{
    probe_dmabuf, Access, Completion, Context, Cq, DmabufSupport, Mr, Pd, Qp, QpOptions,
    RemoteRegion,
};
use pair_key::PairKey;

/// What the verbs lanes ask of the agent around them, which implements it: its core (to
/// end transfers and hand notifications in) and its peers' control connections (queue pairs
/// for a rebuilt rail, notifications once a channel failed). The lanes hold nothing else of
/// the agent's.
pub(crate) trait Host: std::ops::Deref<Target = Core> + Send + Sync {
    /// Ask `peer` for queue pairs (a rail's rebuild); the answer comes to
    /// [`Verbs::rebuilt`].
    fn request_qps(&self, peer: &str, req: QpRequest);
    /// Ask `peer` for the receiving end of a rebuilt notification channel on its rail
    /// `rail`, connected to `ep`; the answer comes to [`Verbs::chan_rebuilt`].
    fn request_chan(&self, peer: &str, rail: u32, ep: crate::transport::verbs::Endpoint);
    /// Send a notification over the TCP connection to `peer` (numbered when it follows
    /// numbered ones of a failed channel).
    fn send_tcp_notif(&self, peer: &str, seq: Option<u64>, bytes: Vec<u8>);
    /// True once the agent is shutting down (the progress thread ends).
    fn stopping(&self) -> bool;
}

/// Send-queue depth of a data queue pair.
const DEPTH: u32 = 512;
/// Work requests per posted chunk (the last one signaled).
const CHUNK: usize = 64;
/// How often the progress thread looks at the ports while there is work in flight.
const PORT_CHECK: Duration = Duration::from_millis(200);
const WAKE: Token = Token(usize::MAX);
/// First wait before a dead pair is rebuilt; it doubles up to [`REBUILD_MAX`] while
/// rebuilt pairs keep failing, and resets once one completes work.
const REBUILD_FIRST: Duration = Duration::from_secs(1);
const REBUILD_MAX: Duration = Duration::from_secs(60);

/// One selected rail.
/// The most queue pairs per rail (`AgentConfig::qps_per_rail`).
pub(crate) const MAX_QPS_PER_RAIL: u32 = 16;

pub(crate) struct LocalRail {
    pub(crate) name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u32,
    pub(crate) addr: RailAddr,
    pub(crate) ipv4: Option<Ipv4If>,
    pub(crate) pd: Pd,
    pub(crate) cq: Cq,
    /// Whether the device registers dma-buf memory (probed once, at agent creation).
    pub(crate) dmabuf: DmabufSupport,
    ctx: Context,
    /// Index of this rail's first lane in the agent's rails (its own when it is the first):
    /// the lanes of one port share its device context and protection domain, so a region
    /// is registered once per port and its keys serve every lane (`qps_per_rail`).
    first_lane: usize,
}

impl LocalRail {
    /// The dma-buf probe's result, as the memory-path choice takes it.
    pub(crate) fn dmabuf_report(&self) -> crate::mem::NicDmabuf {
        match &self.dmabuf {
            DmabufSupport::Supported => crate::mem::NicDmabuf {
                device: self.name.clone(),
                supported: true,
                reason: "ibv_reg_dmabuf_mr probe returned EBADF for fd -1".into(),
            },
            DmabufSupport::Unsupported { reason, .. } => crate::mem::NicDmabuf {
                device: self.name.clone(),
                supported: false,
                reason: reason.clone(),
            },
        }
    }
}

pub(crate) struct Verbs {
    pub(crate) rails: Vec<LocalRail>,
    mode: StripeMode,
    engine: Mutex<Engine>,
    /// Peers with queue pairs. A leaf lock: `has_peer` is called with the agent's maps
    /// locked and must not take the engine (the progress thread takes the engine first).
    peers: Mutex<std::collections::HashSet<String>>,
    waker: Waker,
    poll: Mutex<Option<Poll>>,
    posters: poster::Posters,
    /// Per-rail series (see [`Verbs::count_into`]).
    stats: std::sync::OnceLock<RailStats>,
    /// `AgentConfig::mtu`: the largest path MTU of this agent's queue pairs.
    max_mtu: Option<crate::transport::verbs::Mtu>,
    /// `AgentConfig::progress_spin_us`: how long a waiting caller polls (see `agent::spin`).
    spin: Duration,
    /// `AgentConfig::qps_per_rail`: lanes (queue pairs) per port.
    lanes: u32,
    /// Who polls the completion queues now (see [`polling`]).
    polling: polling::PollState,
}

/// Per-rail counters: bytes by operation, failovers, queue-pair rebuilds.
struct RailStats {
    /// Completions dispatched: by the progress thread, by callers (see [`polling`]).
    completions: [crate::metrics::Counter; 2],
    bytes: Vec<[crate::metrics::Counter; 2]>,
    failovers: Vec<crate::metrics::Counter>,
    rebuilds: Vec<crate::metrics::Counter>,
}

/// A transfer to post: `local[i]` pairs with `remote[i]` (regions of the peer, as its
/// metadata advertises them).
pub(crate) struct PostReq<'a> {
    pub(crate) id: u64,
    pub(crate) op: XferOp,
    /// The peer's name, shared (the transfer's: no copy made per post).
    pub(crate) peer: &'a Arc<str>,
    pub(crate) local: &'a [(Arc<Region>, Desc)],
    pub(crate) remote: &'a [Desc],
    pub(crate) meta: &'a Arc<AgentMetadata>,
    /// The grant each remote descriptor goes through, if any.
    pub(crate) grants: &'a [Option<Arc<crate::agent::grant::Grant>>],
}

/// One queued slice: bytes between a local region and a peer's region on one rail.
struct Pending {
    xfer: u64,
    op: XferOp,
    region: Arc<Region>,
    local_off: u64,
    remote: RemoteRegion,
    remote_off: u64,
    len: u64,
}

struct PairQ {
    qp: Qp,
    /// The peer's rail this queue pair is connected to.
    peer_rail: usize,
    queue: VecDeque<Pending>,
    in_flight: usize,
    dead: Option<String>,
}

struct Run {
    progress: Progress,
    /// The peer (its pairs' key's name: shared, not copied per transfer).
    peer: Arc<str>,
    op: XferOp,
    /// The local region of each descriptor (on the stack for a transfer of a few).
    local: SmallVec<[Arc<Region>; 4]>,
    /// The peer's metadata as of the post (regions, rkeys per peer rail).
    meta: Arc<AgentMetadata>,
    /// The grant each descriptor's remote side goes through (fenced memory), if any;
    /// empty when none does (no list per transfer for the usual unfenced one).
    grants: Vec<Option<Arc<crate::agent::grant::Grant>>>,
}

/// A queue pair being rebuilt: (local rail, peer rail, the new queue pair).
type NewPair = (usize, usize, Qp);

#[derive(Default)]
struct Engine {
    planner: Option<Planner>,
    /// (peer, local rail) → its queue pair and queue.
    pairs: IdMap<PairKey, PairQ>,
    /// (rail, qpn) → pair (QP numbers are per device, so the rail is part of the key).
    qpn: IdMap<(usize, u32), PairKey>,
    runs: IdMap<u64, Run>,
    /// Bytes completed on each rail since start.
    done_bytes: Vec<u64>,
    /// Rebuilds of dead pairs: new queue pairs sent to each peer, answered in order.
    rebuilding: HashMap<String, VecDeque<Vec<NewPair>>>,
    /// Dead pairs: when the next rebuild may start, and the backoff after that.
    retry: IdMap<PairKey, (Instant, Duration)>,
    /// Notification channels we send on, by id: a completion finds its channel by the id
    /// in its `ChanKey`, without hashing the peer's name (`out_ids` on a send).
    outs: IdMap<u64, notif::OutChan>,
    /// Peer → the id of its channel in `outs` (kept across rebuilds of the channel).
    out_ids: HashMap<String, u64>,
    /// The next channel id.
    next_out: u64,
    /// The channel of the last notification sent (a hint: see `Engine::out_mut`).
    last_out: u64,
    /// Notification channels we receive on, per target connection.
    ins: IdMap<u64, notif::InChan>,
    /// (rail, qpn) → the channel a queue pair carries.
    chan_qpn: IdMap<(usize, u32), notif::ChanKey>,
    /// Channels being rebuilt: the new sending end, waiting for the peer's endpoint.
    chan_rebuilding: HashMap<String, notif::NewChan>,
    /// Dead channels: when the next rebuild may start, and the backoff after that.
    chan_retry: HashMap<String, (Instant, Duration)>,
}

impl Engine {
    /// Whether the progress thread should look at the ports every `PORT_CHECK`: transfers
    /// in flight, a dead pair to rebuild, or a notification channel busy or dead.
    fn needs_watching(&self) -> bool {
        !self.runs.is_empty()
            || self.pairs.values().any(|q| q.dead.is_some())
            || self.outs.values().any(|o| o.busy() || o.dead())
    }

    /// Make `qp` the pair to `peer` on `rail` (replacing a dead one).
    fn install(&mut self, peer: &str, rail: usize, peer_rail: usize, qp: Qp) {
        let key = PairKey::new(peer, rail);
        if let Some(old) = self.pairs.get(&key) {
            self.qpn.remove(&(rail, old.qp.qpn()));
        }
        self.qpn.insert((rail, qp.qpn()), key.clone());
        self.pairs.insert(
            key,
            PairQ {
                qp,
                peer_rail,
                queue: VecDeque::new(),
                in_flight: 0,
                dead: None,
            },
        );
    }

    /// The local rails with a live queue pair to the peer of `key` (its rail is scratch: the
    /// caller's one key serves every lookup of a post), in order.
    fn live_rails(&self, key: &mut PairKey, rails: usize) -> SmallVec<[usize; 8]> {
        (0..rails)
            .filter(|r| {
                key.1 = *r;
                self.pairs.get(key).is_some_and(|q| q.dead.is_none())
            })
            .collect()
    }

    /// Mark a pair dead (once) and schedule its rebuild. False when it already was.
    fn mark_dead(&mut self, key: &PairKey, why: &str) -> bool {
        let Some(q) = self.pairs.get_mut(key) else {
            return false;
        };
        if q.dead.is_some() {
            return false;
        }
        q.dead = Some(why.to_owned());
        let backoff = self
            .retry
            .get(key)
            .map_or(REBUILD_FIRST, |(_, b)| (*b * 2).min(REBUILD_MAX));
        self.retry
            .insert(key.clone(), (Instant::now() + backoff, backoff));
        true
    }
}

fn verr(e: impl ToString) -> AgentError {
    AgentError::Unsupported(format!("verbs: {}", e.to_string()))
}

/// Why the verbs backend did not open, by fault: a host without RDMA is no error for
/// `auto` (it takes TCP quietly); RDMA present but unusable, or a failure opening it, is
/// worth a warning.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No RDMA device on this host (or no way to discover one).
    NoRdma(String),
    /// RDMA devices exist, none usable here (NUMA node, link, address: the verdicts say).
    NoUsableRail(String),
    /// Opening a usable rail failed.
    Failed(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoRdma(s) | Self::NoUsableRail(s) | Self::Failed(s) => f.write_str(s),
        }
    }
}

/// The rails `config` selects on this host (or under `config.sysfs_root`): the usable ones
/// for the accelerator's NUMA node, narrowed to `config.devices`.
pub(crate) fn config_rails(config: &AgentConfig) -> Result<Vec<crate::rails::Rail>, OpenError> {
    let root = config
        .sysfs_root
        .as_ref()
        .map_or_else(SysfsRoot::system, |p| SysfsRoot::new(p.clone()));
    let addrs = AddrSource::for_root(&root);
    let failed = |e: std::io::Error| OpenError::NoRdma(format!("RDMA discovery failed: {e}"));
    if !config.devices.is_empty() {
        // only the named devices' GID tables (one file per entry); when that selects
        // nothing, the full discovery below explains why, every port with its reasons
        let named = |dev: &str, port: u8| {
            (config.devices.iter()).any(|d| super::config::device_matches(d, dev, port))
        };
        let host = discover_gids_of(&root, &addrs, named).map_err(failed)?;
        if let Ok(mut rails) = select(&host, config.numa) {
            rails.retain(|r| named(&r.port.device, r.port.port));
            if !rails.is_empty() {
                return Ok(rails);
            }
        }
    }
    let host = discover(&root, &addrs).map_err(failed)?;
    if host.ports.is_empty() {
        return Err(OpenError::NoRdma(format!(
            "no RDMA device under {}",
            root.join("sys/class/infiniband").display()
        )));
    }
    let mut rails =
        select(&host, config.numa).map_err(|e| OpenError::NoUsableRail(e.to_string()))?;
    if !config.devices.is_empty() {
        rails.retain(|r| {
            (config.devices.iter())
                .any(|d| super::config::device_matches(d, &r.port.device, r.port.port))
        });
        if rails.is_empty() {
            return Err(OpenError::NoUsableRail(format!(
                "none of the configured devices {:?} is a usable rail",
                config.devices
            )));
        }
    }
    Ok(rails)
}

impl Verbs {
    /// Open the usable rails (all of them, or `config.devices`), or say why none is usable.
    pub(crate) fn open(config: &AgentConfig) -> Result<Self, OpenError> {
        Self::open_rails(config, config_rails(config)?).map_err(OpenError::Failed)
    }

    fn open_rails(config: &AgentConfig, rails: Vec<crate::rails::Rail>) -> Result<Self, String> {
        let mode = StripeMode::from_stripe_width(config.stripe_width).map_err(|e| e.to_string())?;
        let max_mtu = match config.mtu {
            None => None,
            Some(b) => Some(
                crate::transport::verbs::Mtu::from_bytes(b)
                    .ok_or_else(|| format!("mtu {b}: use 256, 512, 1024, 2048 or 4096"))?,
            ),
        };
        let lanes = config.qps_per_rail;
        if !(1..=MAX_QPS_PER_RAIL).contains(&lanes) {
            return Err(format!("qps_per_rail {lanes}: use 1 to {MAX_QPS_PER_RAIL}"));
        }
        let mut out: Vec<LocalRail> = Vec::new();
        let poll = Poll::new().map_err(|e| e.to_string())?;
        // perftest's -q: each queue pair of a rail is a lane of its own
        let each = rails.iter().flat_map(|r| (0..lanes).map(move |k| (r, k)));
        for (i, (r, k)) in each.enumerate() {
            let name = if lanes > 1 {
                format!("{}/qp{k}", r.port.name())
            } else {
                r.port.name()
            };
            // a port's later lanes share its first lane's context and protection domain
            let first_lane = i - k as usize;
            let (ctx, pd) = match out.get(first_lane) {
                Some(f) if k > 0 => (f.ctx.clone(), f.pd.clone()),
                _ => {
                    let ctx = Context::open(&r.port.device).map_err(|e| e.to_string())?;
                    let pd = Pd::new(&ctx).map_err(|e| e.to_string())?;
                    (ctx, pd)
                }
            };
            let attr = ctx.query_port(r.port.port).map_err(|e| e.to_string())?;
            let cq = Cq::with_channel(&ctx, 4 * DEPTH).map_err(|e| e.to_string())?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&cq);
            poll.registry()
                .register(&mut SourceFd(&fd), Token(i), Interest::READABLE)
                .map_err(|e| e.to_string())?;
            let ipv4 = r.port.ipv4.first().copied();
            // perftest's -x: the entry asked for, where the table has it
            let (gid_index, gid) = match config.gid_index {
                None => (r.gid.index, r.gid.gid.0),
                Some(i) => match r.port.gids.iter().find(|g| g.index == i) {
                    Some(g) => (i, g.gid.0),
                    None => {
                        let have: Vec<String> = (r.port.gids.iter())
                            .map(|g| format!("[{}] {}", g.index, g.gid))
                            .collect();
                        return Err(format!(
                            "gid_index {i}: {} has no such GID entry (it has {})",
                            r.port.name(),
                            if have.is_empty() {
                                "none".into()
                            } else {
                                have.join(", ")
                            }
                        ));
                    }
                },
            };
            let active = attr.active_mtu.map_or(1024, |m| m.bytes());
            out.push(LocalRail {
                name: name.clone(),
                port: r.port.port,
                gid_index,
                addr: RailAddr {
                    name,
                    gid,
                    lid: attr.lid,
                    mtu: config.mtu.map_or(active, |m| m.min(active)),
                    ipv4: ipv4.map(|a| a.to_string()),
                },
                ipv4,
                dmabuf: match out.get(first_lane) {
                    Some(f) if k > 0 => f.dmabuf.clone(),
                    _ => probe_dmabuf(&pd),
                },
                pd,
                cq,
                ctx,
                first_lane,
            });
        }
        let waker = Waker::new(poll.registry(), WAKE).map_err(|e| e.to_string())?;
        let posters = poster::Posters::new(out.len());
        let engine = Engine {
            planner: Some(Planner::new(out.len())),
            ..Engine::default()
        };
        Ok(Self {
            mode,
            engine: Mutex::new(engine),
            peers: Mutex::new(std::collections::HashSet::new()),
            waker,
            poll: Mutex::new(Some(poll)),
            posters,
            stats: std::sync::OnceLock::new(),
            max_mtu,
            spin: Duration::from_micros(config.progress_spin_us.into()),
            lanes,
            polling: polling::PollState::new(out.len()),
            rails: out,
        })
    }
}
