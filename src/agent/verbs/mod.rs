//! The agent's verbs data path: the selected rails (one PD and one CQ with a completion
//! channel per rail), queue pairs per (peer, local rail) exchanged over the TCP attach
//! connection, transfers planned by the stripe planner and posted in chunks that never
//! exceed a queue's depth, and a progress thread that sleeps on the CQ channels (mio) and
//! finishes a transfer only when every slice on every rail completed. A transfer's
//! notification is sent only then, on the peer's notification channel ([`notif`]), in order
//! with the others.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use smallvec::SmallVec;

pub(crate) mod exchange;
mod notif;
mod pair_key;
mod polling;
mod poster;
mod rebuild;
pub(crate) use notif::chan_connect_options;
pub(crate) use rebuild::QpRequest;

use super::region::Region;
use super::{AgentConfig, AgentError, Desc, Shared, XferOp};
use crate::agent::metadata::{AgentMetadata, RailAddr};
use crate::idhash::IdMap;
use crate::rails::{discover, discover_gids_of, select, AddrSource, Ipv4If, SysfsRoot};
use crate::transport::stripe::{DescPair, Plan, Planner, Progress, StripeMode, XferState};
use crate::transport::verbs::{
    probe_dmabuf, Access, Completion, Context, Cq, DmabufSupport, Mr, Pd, Qp, QpOptions,
    RemoteRegion,
};
use pair_key::PairKey;

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
    pub(crate) grants: &'a [Option<Arc<crate::agent::Grant>>],
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
    grants: Vec<Option<Arc<crate::agent::Grant>>>,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        let mode = StripeMode::from_stripe_width(config.stripe_width)?;
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

    /// Register a region's buffer on every rail: once per port, the keys shared by its lanes
    /// (a second registration of the same pages per lane doubled the pinning work and the
    /// device's translation entries for nothing).
    pub(crate) fn register(&self, region: &Region) -> Result<Vec<Mr>, AgentError> {
        let mut access = Access::LOCAL_WRITE;
        // a fenced region gives no remote access through its own keys: only grants do
        if region.access.read && !region.fenced {
            access = access | Access::REMOTE_READ;
        }
        if region.access.write && !region.fenced {
            access = access | Access::REMOTE_WRITE;
        }
        let Some(buf) = region.host() else {
            // device memory: the NIC cannot reach it without dma-buf, which this agent does
            // not register; the host bounce stages it (see Agent::register_memory)
            return Ok(Vec::new());
        };
        let mut mrs: Vec<Mr> = Vec::with_capacity(self.rails.len());
        for (i, r) in self.rails.iter().enumerate() {
            let mr = match mrs.get(r.first_lane) {
                Some(first) if r.first_lane < i => first.share(),
                _ => Mr::register(&r.pd, buf, access).map_err(verr)?,
            };
            mrs.push(mr);
        }
        Ok(mrs)
    }

    /// Make this backend's per-rail series in `r` (once, at start).
    pub(crate) fn count_into(&self, r: &crate::metrics::Registry, agent: &str) {
        let names: Vec<&str> = self.rails.iter().map(|x| x.name.as_str()).collect();
        let s = RailStats {
            completions: ["progress", "caller"].map(|by| {
                r.counter(
                    "kvrail_completions_total",
                    "Work completions dispatched, by who polled them: the progress thread \
                     (woken by the completion channel) or a waiting caller (progress_spin_us).",
                    &[("agent", agent), ("by", by)],
                )
            }),
            bytes: (names.iter())
                .map(|n| {
                    ["read", "write"].map(|op| {
                        r.counter(
                            "kvrail_rail_bytes_total",
                            "Bytes moved by completed RDMA work requests, by rail and operation.",
                            &[("agent", agent), ("rail", n), ("op", op)],
                        )
                    })
                })
                .collect(),
            failovers: (names.iter())
                .map(|n| {
                    r.counter(
                        "kvrail_rail_failovers_total",
                        "Queue pairs that failed on the path, their work moved to other rails.",
                        &[("agent", agent), ("rail", n)],
                    )
                })
                .collect(),
            rebuilds: (names.iter())
                .map(|n| {
                    r.counter(
                        "kvrail_qp_rebuilds_total",
                        "Dead queue pairs replaced by new ones.",
                        &[("agent", agent), ("rail", n)],
                    )
                })
                .collect(),
        };
        let _ = self.stats.set(s);
    }

    /// A grant's keys over `[offset, offset + len)` of `buf`, one per rail in rail order.
    pub(crate) fn range_keys(
        &self,
        buf: &Arc<crate::mem::HostBuffer>,
        offset: u64,
        len: u64,
        access: crate::agent::RemoteAccess,
    ) -> Result<Vec<crate::transport::verbs::RangeKey>, AgentError> {
        let mut a = Access::NONE;
        if access.read {
            a = a | Access::REMOTE_READ;
        }
        if access.write {
            a = a | Access::REMOTE_WRITE;
        }
        self.rails
            .iter()
            .map(|r| {
                crate::transport::verbs::RangeKey::register(
                    &r.pd,
                    buf,
                    offset as usize,
                    len as usize,
                    a,
                )
                .map_err(|e| AgentError::InvalidMemory(format!("grant key on {}: {e}", r.name)))
            })
            .collect()
    }

    /// Pair local rails with the peer's: same IPv4 subnet, else by index.
    pub(crate) fn pairs_with(&self, peer: &AgentMetadata) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        for (i, l) in self.rails.iter().enumerate() {
            let by_subnet = peer.rails.iter().position(|p| {
                let pa = p.ipv4.as_deref().and_then(|s| s.parse::<Ipv4If>().ok());
                matches!((l.ipv4, pa), (Some(a), Some(b)) if a.same_subnet(b.addr))
            });
            if let Some(j) = by_subnet.or((i < peer.rails.len()).then_some(i)) {
                v.push((i, j));
            }
        }
        v
    }

    /// A queue pair on local rail `rail` (initiator side: no remote access).
    pub(crate) fn new_qp(&self, rail: usize, remote_access: Access) -> Result<Qp, AgentError> {
        let r = &self.rails[rail];
        let mut o = QpOptions::new(r.port, r.gid_index);
        o.max_mtu = self.max_mtu;
        o.max_send_wr = DEPTH;
        o.max_recv_wr = 1;
        o.remote_access = remote_access;
        Qp::new(&r.pd, &r.cq, &r.cq, &o).map_err(verr)
    }

    /// Remember the connected queue pairs to `peer`: (local rail, peer rail, queue pair).
    pub(crate) fn add_peer(&self, peer: &str, qps: Vec<(usize, usize, Qp)>) {
        lock(&self.peers).insert(peer.to_owned());
        let mut e = lock(&self.engine);
        e.pairs.retain(|k, _| !k.is(peer));
        e.qpn.retain(|_, k| !k.is(peer));
        e.retry.retain(|k, _| !k.is(peer));
        e.rebuilding.remove(peer);
        for (rail, peer_rail, qp) in qps {
            e.install(peer, rail, peer_rail, qp);
        }
    }

    /// (rail name, bytes completed on it) for every rail.
    pub(crate) fn rail_bytes(&self) -> Vec<(String, u64)> {
        let e = lock(&self.engine);
        self.rails
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), e.done_bytes.get(i).copied().unwrap_or(0)))
            .collect()
    }

    /// The local rails with a connected queue pair to `peer`.
    pub(crate) fn peer_rails(&self, peer: &str) -> Vec<String> {
        let e = lock(&self.engine);
        let mut v: Vec<usize> = e
            .pairs
            .iter()
            .filter(|(k, q)| k.is(peer) && q.dead.is_none())
            .map(|(k, _)| k.1)
            .collect();
        v.sort_unstable();
        v.into_iter().map(|r| self.rails[r].name.clone()).collect()
    }

    /// Forget `peer`: its transfers fail, its queue pairs are destroyed.
    pub(crate) fn remove_peer(&self, shared: &Shared, peer: &str) {
        lock(&self.peers).remove(peer);
        let mut e = lock(&self.engine);
        let keys: Vec<PairKey> = e.pairs.keys().filter(|k| k.is(peer)).cloned().collect();
        for k in &keys {
            self.kill_pair(shared, &mut e, k, "peer metadata invalidated");
        }
        e.pairs.retain(|k, _| !k.is(peer));
        e.qpn.retain(|_, k| !k.is(peer));
        e.retry.retain(|k, _| !k.is(peer));
        e.rebuilding.remove(peer);
        if let Some(id) = e.out_ids.remove(peer) {
            e.outs.remove(&id);
            e.chan_qpn.retain(|_, k| *k != notif::ChanKey::Out(id));
        }
    }

    pub(crate) fn has_peer(&self, peer: &str) -> bool {
        lock(&self.peers).contains(peer)
    }

    /// Plan and post a transfer.
    pub(crate) fn post(&self, shared: &Shared, req: PostReq<'_>) -> Result<(), AgentError> {
        let PostReq {
            id,
            op,
            peer,
            local,
            remote,
            meta,
            grants,
        } = req;
        let mut e = lock(&self.engine);
        let mut key = PairKey::shared(peer.clone(), 0);
        let rails = e.live_rails(&mut key, self.rails.len());
        if rails.is_empty() {
            return Err(AgentError::Unsupported(format!(
                "no working queue pair to {peer}"
            )));
        }
        let descs: SmallVec<[DescPair; 4]> = local
            .iter()
            .zip(remote)
            .map(|((_, l), r)| DescPair {
                local_region: l.region.0,
                local_off: l.offset,
                remote_region: r.region.0,
                remote_off: r.offset,
                len: l.len,
            })
            .collect();
        let planner = e
            .planner
            .get_or_insert_with(|| Planner::new(self.rails.len()));
        for r in 0..self.rails.len() {
            planner.set_up(r, rails.contains(&r));
        }
        let plan = planner
            .plan(&descs, self.mode)
            .map_err(|x| AgentError::Unsupported(x.to_string()))?;
        let fenced = grants.iter().any(Option::is_some);
        let mut run = Run {
            progress: Progress::from(Plan::default()),
            peer: key.0.clone(),
            op,
            local: local.iter().map(|(r, _)| r.clone()).collect(),
            meta: meta.clone(),
            grants: if fenced { grants.to_vec() } else { Vec::new() },
        };
        self.enqueue(&mut e, id, &run, &plan, &mut key);
        let (slices, rails_used) = (plan.slices(), plan.rails_used_count());
        // the run keeps the plan's lists (enqueued above: no copy of them)
        run.progress = Progress::from(plan);
        e.runs.insert(id, run);
        if slices == 0 {
            e.runs.remove(&id);
            self.completed(shared, &mut e, id);
            return Ok(());
        }
        // The only transfer in flight, on one rail: post in place (one thread hand-off less,
        // which is what a lone transfer waits on). So too on one rail when callers poll
        // (agent::spin) and a rail has one lane: the thread that polls posts, as perftest's
        // does. Otherwise the posters move the rails (and a rail's lanes) in parallel: on
        // rxe, where a post does its queue pair's packet work, two lanes of one rail posted
        // by one caller moved as one (64 KiB WRITE x 32: 43-68 MB/s in place, 92-96 from
        // the posters, 108-117 with the caller asleep; `ib_write_bw` 68-70). Either way
        // nothing holds the engine lock through a post: rxe does the packet work inside `ibv_post_send`, and the progress
        // thread slept on the lock for the whole of it (a futex wait and a switch a transfer).
        let in_place =
            rails_used == 1 && (e.runs.len() == 1 || (!self.spin.is_zero() && self.lanes == 1));
        let mut mine: SmallVec<[poster::InPlace; 1]> = SmallVec::new();
        for r in 0..self.rails.len() {
            key.1 = r;
            self.pump_with(&mut e, &key, in_place.then_some(&mut mine));
        }
        drop(e);
        // A caller that polls (a budget set) comes back to poll after its post: while the
        // doorbell runs — rxe's packet work, a millisecond at 64 KiB in the lab — completion
        // events stay the callers' to take, not the progress thread's to drain (it took a
        // third of them, each a wake-up of it and of the caller sleeping next).
        let _polling = (!mine.is_empty() && !self.spin.is_zero())
            .then(|| crate::agent::spin::Polling::start(shared));
        for c in mine {
            if let Err(msg) = self.post_slices(c.rail, &c.qp, c.xfer, &c.slices) {
                key.1 = c.rail;
                self.post_failed(shared, &mut lock(&self.engine), &key, &c.qp, &msg);
            }
        }
        Ok(())
    }

    /// Queue a plan's slices on the pairs to the run's peer (`key`: that peer, any rail).
    fn enqueue(&self, e: &mut Engine, id: u64, run: &Run, plan: &Plan, key: &mut PairKey) {
        for (r, slices) in plan.per_rail.iter().enumerate() {
            if slices.is_empty() {
                continue;
            }
            key.1 = r;
            let Some(q) = e.pairs.get_mut(key) else {
                continue;
            };
            // the peer's rail this queue pair is connected to (paired when it was set up)
            let peer_rail = q.peer_rail;
            for sl in slices {
                let Some(m) = run.meta.regions.iter().find(|m| m.id == sl.remote_region) else {
                    continue;
                };
                // fenced memory: the key of the grant range that holds the slice
                let granted = run.grants.get(sl.desc).and_then(Option::as_ref).map(|g| {
                    g.covering(sl.remote_region, sl.remote_off, sl.len)
                        .and_then(|r| r.rkeys.get(peer_rail).copied())
                        .unwrap_or_default()
                });
                q.queue.push_back(Pending {
                    xfer: id,
                    op: run.op,
                    region: run.local[sl.desc].clone(),
                    local_off: sl.local_off,
                    remote: RemoteRegion {
                        addr: m.addr,
                        len: m.len,
                        rkey: granted
                            .unwrap_or_else(|| m.rkeys.get(peer_rail).copied().unwrap_or_default()),
                    },
                    remote_off: sl.remote_off,
                    len: sl.len,
                });
            }
        }
    }

    /// A rail's queue pair to a peer failed on the path (retries exhausted, flushed): its
    /// outstanding slices move to the rails still working to that peer; with none left the
    /// transfers fail. The queue pair stays dead; later transfers use the survivors.
    fn fail_over(&self, shared: &Shared, e: &mut Engine, key: &PairKey, why: &str) {
        let (peer, rail) = (key.0.clone(), key.1);
        if let Some(s) = self.stats.get() {
            s.failovers[rail].inc();
        }
        e.mark_dead(key, why);
        if let Some(q) = e.pairs.get_mut(key) {
            // Stop the device working on it before its work is redone elsewhere.
            if let Err(err) = q.qp.set_error() {
                tracing::error!(
                    "cannot retire the queue pair on {}: {err}",
                    self.rails[rail].name
                );
            }
            q.queue.clear(); // every queued slice is also pending in its run: re-planned below
        }
        let mut pk = key.clone();
        let survivors = e.live_rails(&mut pk, self.rails.len());
        let ids: Vec<u64> = e
            .runs
            .iter()
            .filter(|(_, r)| *r.peer == *peer && !r.progress.pending(rail).is_empty())
            .map(|(id, _)| *id)
            .collect();
        tracing::warn!(
            rail = %self.rails[rail].name, %peer, transfers = ids.len(),
            "rail failed ({why}); moving its outstanding slices to {} surviving rail(s)", survivors.len()
        );
        for id in ids {
            let Some(mut run) = e.runs.remove(&id) else {
                continue;
            };
            let slices = run.progress.fail_rail(rail);
            let planner = e
                .planner
                .get_or_insert_with(|| Planner::new(self.rails.len()));
            planner.release(rail, slices.iter().map(|s| s.len).sum());
            for r in 0..self.rails.len() {
                planner.set_up(r, survivors.contains(&r));
            }
            match planner.replan(&slices) {
                Ok(plan) => {
                    run.progress.add(&plan);
                    self.enqueue(e, id, &run, &plan, &mut pk);
                    e.runs.insert(id, run);
                }
                Err(no_rail) => shared.xfer_failed(id, format!("{why}; {no_rail}")),
            }
        }
        let keys: Vec<PairKey> = e.pairs.keys().filter(|k| k.is(&peer)).cloned().collect();
        for k in keys {
            self.pump(e, &k);
        }
    }

    /// Hand queued slices of one pair to its rail's poster while its send queue has room, in
    /// chunks of one transfer each (the last request of a chunk signaled).
    fn pump(&self, e: &mut Engine, key: &PairKey) {
        self.pump_with(e, key, None);
    }

    /// [`Verbs::pump`]; with `in_place`, a chunk the rail's poster has nothing queued before
    /// goes there instead, for this thread to post once it let go of the engine lock (see
    /// [`poster`]).
    fn pump_with(
        &self,
        e: &mut Engine,
        key: &PairKey,
        mut in_place: Option<&mut SmallVec<[poster::InPlace; 1]>>,
    ) {
        let rail = key.1;
        let Some(q) = e.pairs.get_mut(key) else {
            return;
        };
        loop {
            if q.dead.is_some() || q.queue.is_empty() {
                return;
            }
            let room = (DEPTH as usize).saturating_sub(q.in_flight);
            if room == 0 {
                return;
            }
            let xfer = q.queue[0].xfer;
            let n = q
                .queue
                .iter()
                .take(CHUNK.min(room))
                .take_while(|p| p.xfer == xfer)
                .count();
            q.in_flight += n;
            if let Some(mine) = in_place.as_deref_mut() {
                if self.posters.queued[rail].load(Ordering::Acquire) == 0 {
                    // posted by the caller: no chunk (and no copy of the pair's key) to build
                    mine.push(poster::InPlace {
                        rail,
                        qp: q.qp.clone(),
                        xfer,
                        slices: q.queue.drain(..n).collect(),
                    });
                    continue;
                }
            }
            let c = poster::Chunk {
                key: key.clone(),
                qp: q.qp.clone(),
                xfer,
                slices: q.queue.drain(..n).collect(),
            };
            self.posters.queued[rail].fetch_add(1, Ordering::AcqRel);
            if self.posters.tx[rail].send(poster::Job::Post(c)).is_err() {
                return; // the poster stopped: the agent is shutting down
            }
        }
    }

    /// A pair's queue pair failed: every transfer with slices on it fails.
    fn kill_pair(&self, shared: &Shared, e: &mut Engine, key: &PairKey, why: &str) {
        self.kill_pair_as(shared, e, key, why, false);
    }

    /// [`Verbs::kill_pair`]; `refused` (the peer's NIC refused a key): the transfers that
    /// went through grants fail as [`XferError::GrantRevoked`](crate::agent::XferError).
    fn kill_pair_as(
        &self,
        shared: &Shared,
        e: &mut Engine,
        key: &PairKey,
        why: &str,
        refused: bool,
    ) {
        let mut victims: Vec<u64> = Vec::new();
        e.mark_dead(key, why);
        if let Some(q) = e.pairs.get_mut(key) {
            victims.extend(q.queue.drain(..).map(|p| p.xfer));
        }
        victims.extend(
            e.runs
                .iter()
                .filter(|(_, r)| !r.progress.pending(key.1).is_empty())
                .map(|(id, _)| *id),
        );
        victims.sort_unstable();
        victims.dedup();
        // nothing more of a failed transfer goes out on the other rails either
        for q in e.pairs.values_mut() {
            q.queue.retain(|p| victims.binary_search(&p.xfer).is_err());
        }
        for id in victims {
            let Some(run) = e.runs.remove(&id) else {
                continue;
            };
            if refused && run.grants.iter().any(Option::is_some) {
                let err = crate::agent::XferError::GrantRevoked {
                    peer: run.peer.to_string(),
                    why: why.to_owned(),
                };
                shared.finish(id, Err(err));
            } else {
                shared.xfer_failed(id, why.to_owned());
            }
        }
    }

    fn on_completion(&self, shared: &Shared, e: &mut Engine, rail: usize, c: &Completion) {
        if let Some(k) = e.chan_qpn.get(&(rail, c.qpn)).cloned() {
            self.on_chan_completion(shared, e, &k, c);
            return;
        }
        let Some(key) = e.qpn.get(&(rail, c.qpn)).cloned() else {
            return;
        };
        if e.pairs.get(&key).is_some_and(|q| q.dead.is_some()) {
            return; // flushes of a queue pair that already failed
        }
        if let Err(err) = &c.status {
            let why = format!("{} on {}", err, self.rails[rail].name);
            // A request fault would fail on any rail: the transfers fail. A path fault moves
            // the work to other rails (see WcError::is_request_fault).
            if err.is_request_fault() {
                let why = if err.is_remote_access() {
                    format!(
                        "{why}: the peer's NIC refused the key (it deregistered the region, \
                         revoked the grant, or does not allow this access)"
                    )
                } else {
                    why
                };
                self.kill_pair_as(shared, e, &key, &why, err.is_remote_access());
            } else {
                self.fail_over(shared, e, &key, &why);
            }
            return;
        }
        if !e.retry.is_empty() {
            e.retry.remove(&key); // this pair works: a later failure starts a fresh backoff
        }
        let (xfer, n) = (c.wr_id >> 16, (c.wr_id & 0xffff) as usize);
        if let Some(q) = e.pairs.get_mut(&key) {
            q.in_flight = q.in_flight.saturating_sub(n);
        }
        let mut done = false;
        if let Some(run) = e.runs.get_mut(&xfer) {
            let b = run.progress.complete(rail, n);
            if let Some(p) = e.planner.as_mut() {
                p.release(rail, b);
            }
            if e.done_bytes.len() <= rail {
                e.done_bytes.resize(rail + 1, 0);
            }
            e.done_bytes[rail] += b;
            if let Some(s) = self.stats.get() {
                s.bytes[rail][crate::agent::stats::op_index(run.op)].add(b);
            }
            done = run.progress.state() == XferState::Done;
        }
        if done {
            e.runs.remove(&xfer);
            self.completed(shared, e, xfer);
        }
        self.pump(e, &key);
    }

    /// Transfer `id` is complete (every slice in place; its run removed): done, then its
    /// notification. The notification is taken before the transfer is marked done (an
    /// engine that releases a done transfer at once must not lose it), and the transfer is
    /// marked done before the notification goes out: a peer that exits on it closes its
    /// connection, whose end fails the peer's transfers still in progress — this one too,
    /// bytes all landed, when that came first (the lab's two-process test, once in a CI run).
    /// What needs the notification queued — a later post or notification to the peer, a
    /// dropping agent's flush — takes the engine lock, held here, first.
    fn completed(&self, shared: &Shared, e: &mut Engine, id: u64) {
        let notif = shared.xfer_notif(id);
        shared.finish(id, Ok(()));
        if let Some((peer, n)) = notif {
            self.notify_locked(shared, e, &peer, n);
        }
    }

    /// The progress thread: sleep on the rails' completion channels; dispatch completions.
    pub(crate) fn run(self: &Arc<Self>, shared: Arc<Shared>) -> Result<(), AgentError> {
        let mut poll = lock(&self.poll)
            .take()
            .ok_or_else(|| verr("progress thread already started"))?;
        self.spawn_posters(&shared)?;
        let me = self.clone();
        crate::threads::spawn(format!("kvrail-progress-{}", shared.name), move || {
            let _span = tracing::info_span!("agent", name = %shared.name).entered();
            let mut events = Events::with_capacity(16);
            let mut checked = std::time::Instant::now();
            loop {
                // While transfers are in flight, look at the ports every 200 ms (not at
                // every wake-up: that was two port queries per completion event): a
                // port that went DOWN is retired and its work moved, without waiting
                // for the transport's retries to run out.
                // A dead pair is looked at too, to be rebuilt when its port is back.
                // The engine lock busy means work is under way: watch then, rather than
                // wait for it (the port look never queues behind a caller that posts or
                // dispatches, nor makes that caller wake this thread).
                let watch = match me.engine.try_lock() {
                    Ok(e) => e.needs_watching(),
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().needs_watching(),
                    Err(std::sync::TryLockError::WouldBlock) => true,
                };
                let mut timeout = watch.then(|| PORT_CHECK.saturating_sub(checked.elapsed()));
                if let Some(t) = me.rearm_after() {
                    timeout = Some(timeout.map_or(t, |w| w.min(t)));
                }
                if let Err(e) = poll.poll(&mut events, timeout) {
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    tracing::error!(error = %e, "kvrail progress thread: poll failed");
                    return;
                }
                if shared.shutdown.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                if watch && checked.elapsed() >= PORT_CHECK {
                    me.check_ports(&shared);
                    checked = std::time::Instant::now();
                }
                for ev in events.iter() {
                    let Token(rail) = ev.token();
                    if rail < me.rails.len() {
                        me.on_cq_event(&shared, rail);
                    }
                }
                me.rearm_if_quiet(&shared);
            }
        })
        .map_err(verr)?;
        Ok(())
    }

    /// Retire every live queue pair on a rail whose port is no longer ACTIVE; start
    /// rebuilding dead pairs on rails whose port is.
    fn check_ports(&self, shared: &Shared) {
        let mut active = Vec::new();
        for (rail, r) in self.rails.iter().enumerate() {
            let state = match r.ctx.query_port(r.port) {
                Ok(a) if a.state == crate::transport::verbs::PortState::Active => {
                    active.push(rail);
                    continue;
                }
                Ok(a) => a.state.to_string(),
                Err(err) => err.to_string(),
            };
            let mut e = lock(&self.engine);
            let keys: Vec<PairKey> = e
                .pairs
                .iter()
                .filter(|(k, q)| k.1 == rail && q.dead.is_none())
                .map(|(k, _)| k.clone())
                .collect();
            let why = format!("port {} is {state}", r.name);
            for k in keys {
                self.fail_over(shared, &mut e, &k, &why);
            }
            self.fail_chans_on(shared, &mut e, rail, &why);
        }
        for (peer, req) in self.start_rebuilds(&active) {
            shared.request_qps(&peer, req);
        }
        for (peer, rail, ep) in self.start_chan_rebuilds(&active) {
            shared.request_chan(&peer, rail, ep);
        }
    }

    /// Wake the progress thread (to see the shutdown flag) and stop the posters.
    pub(crate) fn wake(&self) {
        let _ = self.waker.wake();
        self.stop_posters();
    }
}
