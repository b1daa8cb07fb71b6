//! The control channel, under both backends: framing (`msg`), the listener (`accept`), the
//! metadata request, the attach handshake, and one connection per peer with its writer and
//! reader threads. A connection that starts with `GetMetadata` gets the metadata; one that
//! starts with `Attach` is a peer's connection. Each agent sends its own transfers'
//! messages and notifications on the connection it opened to the peer (so they stay in
//! order), and serves the peer's on the connection the peer opened. What travels on it
//! belongs to others: the TCP data path's messages (`super::tcp`), the queue pair exchange
//! of the verbs lanes (`qp_exchange`), and notifications.

mod accept;
mod answer;
pub(crate) mod auth;
pub(crate) mod driven;
mod io;
pub(crate) mod listen;
pub(crate) mod msg;
#[cfg(feature = "verbs")]
pub(crate) mod qp_exchange;
mod reply;
pub(crate) mod work;

use std::net::{Shutdown as NetShutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use msg::{send, Msg, Reader};
use reply::no_answer;
pub(crate) use reply::{conn_err, expect_reply, HANDSHAKE_TIMEOUT};
pub(crate) use work::Work;

use super::config::AgentConfig;
use super::core::Core;
use super::metadata::AgentMetadata;
use super::{error::AgentError, error::XferError};
use crate::proto::handshake;
use crate::proto::handshake::HandshakeInfo;
use crate::threads::lock;

/// What the control channel asks of the agent around it, which implements it: its core
/// (transfers end, notifications arrive), what it says about itself (configuration,
/// handshake, metadata), the verbs lanes when it runs on them, the waiting callers that
/// drive a peer's first connection, and its orderly stop. The channel holds nothing else of
/// the agent's.
pub(crate) trait Host: std::ops::Deref<Target = Core> + Send + Sync {
    /// The agent's configuration.
    fn config(&self) -> &AgentConfig;
    /// What it says about itself to peers (checked both ways when attaching).
    fn handshake(&self) -> &HandshakeInfo;
    /// Its metadata as the side channel serves it now.
    fn metadata(&self) -> AgentMetadata;
    /// The verbs lanes, when the agent runs on them.
    #[cfg(feature = "verbs")]
    fn verbs(&self) -> Option<&Arc<crate::agent::verbs::Verbs>>;
    /// The agent as the verbs lanes see it.
    #[cfg(feature = "verbs")]
    fn lanes_host(&self) -> &dyn crate::agent::verbs::Host;
    /// True once the agent is stopping (the listener ends).
    fn stopping(&self) -> bool;
    /// A new id for a served connection (numbered notifications are ordered per one).
    fn new_conn(&self) -> u64;
    /// Waiting callers may drive `d` (a peer's first connection) from now on.
    fn drive(&self, d: &Arc<driven::Driven>);
    /// `d` ended: nobody drives it any more.
    fn undrive(&self, d: &Arc<driven::Driven>);
    /// A side-channel connection was refused by authentication.
    fn count_auth_refusal(&self);
    /// A side-channel connection from `ip` was refused by protected mode; true the first
    /// time for `ip` (the refusal is logged once per address).
    fn count_protected_refusal(&self, ip: std::net::IpAddr) -> bool;
    /// The agent is dropped: send what is queued for peers (bounded by [`FLUSH_ON_DROP`]
    /// without progress), leave the metadata store, and stop.
    fn flush_and_stop(&self);
    /// Close every peer's connections (after `flush_and_stop`).
    fn close_peers(&self);
    /// A peer sent its metadata (`PutMetadata`) or its leaving (`Forget`) on `s`: do it
    /// (where `accept_sent_metadata` allows) and answer `Taken` or `Refused`.
    fn take_sent(&self, s: TcpStream, m: Msg);
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a dropped agent waits for its queued messages without progress (notification
/// channels and TCP writers alike).
pub(crate) const FLUSH_ON_DROP: Duration = Duration::from_secs(2);

/// Get a peer's metadata bytes from its side channel.
pub(crate) fn fetch_metadata(
    addr: SocketAddr,
    secret: Option<&crate::agent::secret::ClusterSecret>,
) -> Result<Vec<u8>, AgentError> {
    match request(addr, secret, &Msg::GetMetadata, HANDSHAKE_TIMEOUT)? {
        Msg::Metadata(b) => Ok(b),
        other => Err(conn_err(
            "side channel: unexpected reply from",
            addr,
            format!("{other:?}"),
        )),
    }
}

/// One request on a fresh side-channel connection to `addr`: authenticate (with
/// `secret`), send `m`, and read the one answer, waiting at most `wait` for it.
pub(crate) fn request(
    addr: SocketAddr,
    secret: Option<&crate::agent::secret::ClusterSecret>,
    m: &Msg,
    wait: Duration,
) -> Result<Msg, AgentError> {
    let hint = "is the peer agent running, and is side_channel_host set to an address this host can reach?";
    let s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| {
        conn_err(
            "side channel: cannot connect to",
            addr,
            format!("{e}; {hint}"),
        )
    })?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).ok();
    let mut w = s
        .try_clone()
        .map_err(|e| conn_err("side channel", addr, e))?;
    let mut r = Reader::new(s);
    if let Some(k) = secret {
        auth::prove(k, &mut w, &mut r, addr)?;
    }
    send(&mut w, m).map_err(|e| conn_err("side channel: send to", addr, e))?;
    w.set_read_timeout(Some(wait)).ok();
    match r.next() {
        Ok(Some(reply)) => Ok(reply),
        Ok(None) => Err(conn_err("side channel: closed by", addr, "no answer")),
        Err(e) => Err(conn_err("side channel: no answer from", addr, no_answer(e))),
    }
}

/// A transfer at least this large, carrying no notification, may go on any of a peer's TCP
/// connections (`AgentConfig::tcp_conns`); the rest goes on the first.
pub(crate) const LANE_MIN: u64 = 1 << 20;

/// The connections of one peer, which fail together: one that ends (its reader saw the end,
/// its writer could not send, the agent closed it) closes them all before the peer's
/// transfers are failed, so no transfer is posted on the others meanwhile, and the peer is
/// connected again as a whole (`Agent::load_remote`); a transfer made before is never
/// posted on the new connections (the peer's epoch), so no late answer on the old ones can
/// complete it.
#[derive(Clone, Default)]
struct Group {
    closed: Arc<std::sync::atomic::AtomicBool>,
    socks: Arc<Mutex<Vec<TcpStream>>>,
}

impl Group {
    fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }

    /// Close every connection of the group, both ways (their readers and writers stop).
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for s in lock(&self.socks).iter() {
            let _ = s.shutdown(NetShutdown::Both);
        }
    }
}

/// One connection's writer: its queue, and the work items it has finished (sent or
/// failed; a drop waits while this moves).
struct Conn {
    tx: mpsc::Sender<Work>,
    sent: Arc<std::sync::atomic::AtomicU64>,
}

/// This agent's data connections to one peer: the first (control, small work and
/// notifications, in order) and, on the TCP backend, more lanes for large transfers.
pub(crate) struct PeerConn {
    /// The first, then the lanes (`AgentConfig::tcp_conns` in all on TCP; one on verbs).
    conns: Vec<Conn>,
    shared: Arc<dyn Host>,
    /// The peer's connections, closed together.
    group: Group,
    /// Which connection the next large transfer takes.
    turn: std::sync::atomic::AtomicUsize,
    /// Transfers sent on each connection.
    counts: Vec<crate::metrics::Counter>,
}

impl PeerConn {
    /// Connect to `peer` at `addr`: attach (and exchange queue pairs on verbs), then open
    /// the TCP backend's further lanes. A lane that cannot be opened is logged and left out
    /// (the peer is served on fewer connections).
    pub(crate) fn connect(
        shared: Arc<dyn Host>,
        addr: SocketAddr,
        peer: &str,
        meta: &crate::agent::metadata::AgentMetadata,
    ) -> Result<Self, AgentError> {
        let group = Group::default();
        let mut conns = vec![open(&shared, addr, (peer, &group), Some(meta))?];
        // lanes only where the data goes over TCP (not to a peer served by queue pairs)
        #[cfg(feature = "verbs")]
        let on_tcp =
            shared.verbs().is_none() || meta.backend != crate::agent::metadata::BackendKind::Verbs;
        #[cfg(not(feature = "verbs"))]
        let on_tcp = true;
        let lanes = if on_tcp {
            shared.config().tcp_conns.saturating_sub(1)
        } else {
            0
        };
        for k in 1..=lanes {
            match open(&shared, addr, (peer, &group), None) {
                Ok(lane) => conns.push(lane),
                Err(e) => {
                    tracing::warn!(agent = %shared.name, %peer, error = %e,
                        "TCP connection {k} of {} not opened: large transfers use fewer",
                        lanes + 1);
                    break;
                }
            }
        }
        Ok(Self {
            counts: shared.stats.tcp_lanes(&shared.name, conns.len()),
            conns,
            shared,
            group,
            turn: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The writer queue for a transfer of `bytes` (`notif`: it carries one): the next
    /// connection in turn for a large one without a notification, else the first; and
    /// whether the peer's connections are open.
    pub(crate) fn sender_for(&self, bytes: u64, notif: bool) -> (mpsc::Sender<Work>, bool) {
        let mut k = 0;
        if self.conns.len() > 1 && bytes >= LANE_MIN && !notif {
            k = self.turn.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        }
        if let Some(c) = self.counts.get(k) {
            c.inc();
        }
        (self.conns[k].tx.clone(), self.is_open())
    }

    /// Every connection's writer queue and progress count (the first's first).
    pub(crate) fn writers(&self) -> Vec<(mpsc::Sender<Work>, Arc<std::sync::atomic::AtomicU64>)> {
        (self.conns.iter())
            .map(|c| (c.tx.clone(), c.sent.clone()))
            .collect()
    }

    pub(crate) fn submit(&self, w: Work) {
        if let Err(mpsc::SendError(Work::Xfer { id, .. })) = self.conns[0].tx.send(w) {
            self.shared.finish(id, Err(XferError::Closed));
        }
    }

    /// Queue work for the first connection's writer; false when it is closed.
    #[cfg(feature = "verbs")]
    pub(crate) fn try_submit(&self, w: Work) -> bool {
        self.conns[0].tx.send(w).is_ok()
    }

    /// False once the peer's connections closed.
    /// (A flag, not a `getpeername` per post: a reader sets it when its connection ends,
    /// a writer when a send fails, `close` when the agent closes them.)
    pub(crate) fn is_open(&self) -> bool {
        self.group.is_open()
    }

    /// Close every connection to the peer.
    pub(crate) fn close(&self) {
        self.group.close();
    }
}

/// One connection of `group` to `peer`: attach, with the queue-pair exchange when `meta` is
/// given (the first), and start its reader and writer threads.
fn open(
    shared: &Arc<dyn Host>,
    addr: SocketAddr,
    (peer, group): (&str, &Group),
    meta: Option<&crate::agent::metadata::AgentMetadata>,
) -> Result<Conn, AgentError> {
    let s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| conn_err("cannot connect to the data address of", addr, e))?;
    s.set_nodelay(true).ok();
    let mut w = s
        .try_clone()
        .map_err(|e| conn_err("data connection", addr, e))?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).ok();
    let rs = s
        .try_clone()
        .map_err(|e| conn_err("data connection", addr, e))?;
    let mut reader = Reader::new(rs);
    if let Some(k) = &shared.config().cluster_secret {
        auth::prove(k, &mut w, &mut reader, addr)?;
    }
    send(
        &mut w,
        &Msg::Attach {
            info: shared.handshake().clone(),
        },
    )
    .map_err(|e| conn_err("attach to", addr, e))?;
    expect_reply(
        &mut reader,
        addr,
        "attach to",
        "peer refused us at",
        |m| match m {
            Msg::Attached => Ok(()),
            m => Err(m),
        },
    )?;
    #[cfg(feature = "verbs")]
    if let Some(meta) = meta {
        qp_exchange::open_qps(&**shared, &mut w, &mut reader, (addr, peer), meta)?;
    }
    #[cfg(not(feature = "verbs"))]
    let _ = meta;
    s.set_read_timeout(None).ok();
    let (tx, rx) = mpsc::channel::<Work>();
    let sd = s
        .try_clone()
        .map_err(|e| conn_err("data connection", addr, e))?;
    lock(&group.socks).push(sd);
    if !group.is_open() {
        // a connection of the group ended while this one attached
        let _ = s.shutdown(NetShutdown::Both);
    }
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let out = driven::Out {
        rx,
        w,
        batch: super::tcp_batch::Batch::default(),
        held: None,
    };
    let inp = driven::In {
        r: reader,
        stash: None,
        tx: Some(tx.clone()),
    };
    let d = Arc::new(driven::Driven::new((out, inp), sent.clone(), peer));
    // the first connection's answers and small work may be driven by waiting callers
    if meta.is_some() {
        shared.drive(&d);
    }
    let (sh, d2, g) = (shared.clone(), d.clone(), group.clone());
    spawn_for(&**shared, ("rd", peer), addr, move |name| {
        let why = io::initiator_reader(&*sh, &d2);
        sh.undrive(&d2);
        // Nothing will answer on this connection again: stop the group both ways, so the
        // writers fail (and fail what is queued) instead of sending into half-open sockets
        // whose answers nobody reads; then fail what is in flight.
        g.close();
        sh.fail_peer(name, &why);
    })?;
    let (sh, g) = (shared.clone(), group.clone());
    spawn_for(&**shared, ("wr", peer), addr, move |name| {
        io::writer(&*sh, &d, name, &g);
    })?;
    Ok(Conn { tx, sent })
}

/// Start a connection's `kind` thread ("rd", "wr") for `peer`, named after both and inside
/// the peer's tracing span; `run` gets the peer's name.
fn spawn_for(
    shared: &dyn Host,
    (kind, peer): (&str, &str),
    addr: SocketAddr,
    run: impl FnOnce(&str) + Send + 'static,
) -> Result<(), AgentError> {
    let (agent, name) = (shared.name.clone(), peer.to_owned());
    crate::threads::spawn(format!("kvrail-{kind}-{name}"), move || {
        let _span = tracing::info_span!("peer", agent = %agent, peer = %name).entered();
        run(&name);
    })
    .map(drop)
    .map_err(|e| conn_err("thread for", addr, e))
}

/// Stops the listener and every connection when the last agent handle drops.
pub(crate) struct Shutdown {
    shared: Arc<dyn Host>,
    wake: SocketAddr,
    conns: Conns,
    /// The Prometheus endpoint, when configured (stops with the agent).
    pub(crate) metrics: std::sync::OnceLock<super::metrics_http::Endpoint>,
}

/// The attached connections being served (a clone of each, to close them at shutdown),
/// by serial; each leaves when its serving thread ends.
type Conns = Arc<Mutex<std::collections::HashMap<u64, TcpStream>>>;

#[cfg(test)]
mod tests;
