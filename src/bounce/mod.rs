//! Host bounce (`kv_buffer_device = "cpu"`, and the fallback of `"rbln"` where no dma-buf
//! path exists): transfers between device memories that the NIC cannot reach, staged
//! through pinned, registered host buffers.
//!
//! A [`Bounce`] wraps an [`Agent`]. For every linked peer it registers two staging regions
//! of `slots × slot_size` bytes: one the peer WRITEs into, one it sends from. A transfer's
//! bytes go in chunks of at most one slot: the sender copies device → host into a free slot,
//! RDMA-WRITEs it into the same slot of the receiver, whose agent delivers the chunk's
//! notification only after the bytes landed; the receiver copies host → device and
//! acknowledges, which frees the slot. With several slots the three steps of consecutive
//! chunks overlap. The engine's notification rides on the last chunk and is delivered only
//! after every chunk is in the destination device memory; a WRITE completes at the initiator
//! when the receiver acknowledged every chunk, a READ when the last chunk is in local device
//! memory. A READ asks the peer to send (the same pipeline, reversed).
//!
//! The protocol's messages are agent notifications with a private prefix; the bounce
//! driver thread takes every notification from the agent, so engines read theirs from
//! [`Bounce::get_new_notifs`]. Failures are bounded: a chunk whose RDMA fails, a device copy
//! the runtime refuses, or a peer that acknowledges nothing for `ack_timeout` fails the
//! transfer with the cause; nothing reports success for bytes that did not land.

mod driver;
mod wire;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::agent::{Agent, AgentError, XferId, XferOp, XferStatus};
use crate::mem::DeviceMemory;
use driver::{Job, State, Xfer};
use wire::{Part, Piece, Tag, Wire};

/// How a [`Bounce`] stages bytes.
#[derive(Debug, Clone)]
pub struct BounceConfig {
    /// Staging slots per peer and direction (chunks in flight); at least 1.
    pub slots: u32,
    /// Bytes per slot (largest chunk).
    pub slot_size: u64,
    /// A transfer that sees no progress from its peer for this long fails.
    pub ack_timeout: Duration,
}

impl Default for BounceConfig {
    fn default() -> Self {
        Self {
            slots: 4,
            slot_size: 1 << 20,
            ack_timeout: Duration::from_secs(30),
        }
    }
}

/// A device region added with [`Bounce::add_device_memory`] (ids are per [`Bounce`]; a
/// peer learns them when linking).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevRegionId(pub u32);

/// `len` bytes at `offset` of a device region (local or the peer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevDesc {
    /// The region.
    pub region: DevRegionId,
    /// Offset in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl DevDesc {
    /// `len` bytes at `offset` of `region`.
    pub fn new(region: DevRegionId, offset: u64, len: u64) -> Self {
        Self {
            region,
            offset,
            len,
        }
    }
}

/// Counters of a [`Bounce`] since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BounceStats {
    /// Chunks WRITten into peers' staging slots.
    pub chunks_sent: u64,
    /// Bytes in them.
    pub bytes_sent: u64,
    /// Chunks received and placed (or refused) in device memory.
    pub chunks_received: u64,
    /// Most chunk WRITEs in flight at once (above 1: copies and RDMA overlapped).
    pub max_in_flight: usize,
}

pub(crate) struct Shared {
    pub(crate) agent: Arc<Agent>,
    pub(crate) config: BounceConfig,
    pub(crate) state: Mutex<State>,
    /// Signalled when a transfer finishes or a link comes up.
    pub(crate) cv: Condvar,
    pub(crate) stop: AtomicBool,
    /// Bounce messages that did not parse (dropped).
    pub(crate) malformed: AtomicU64,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Device-to-device transfers through host staging buffers, over an [`Agent`].
pub struct Bounce {
    shared: Arc<Shared>,
    driver: Option<JoinHandle<()>>,
}

impl Bounce {
    /// Start bouncing over `agent` (its notifications are the driver's from now on).
    ///
    /// # Errors
    /// [`AgentError::Unsupported`] for zero slots or a zero slot size.
    pub fn new(agent: Arc<Agent>, config: BounceConfig) -> Result<Self, AgentError> {
        if config.slots == 0 || config.slot_size == 0 {
            return Err(AgentError::Unsupported(
                "host bounce needs at least one slot of at least one byte".into(),
            ));
        }
        let shared = Arc::new(Shared {
            agent,
            config,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            malformed: AtomicU64::new(0),
        });
        let s = shared.clone();
        let driver = std::thread::Builder::new()
            .name("kvrail-bounce".into())
            .spawn(move || driver::run(&s))
            .map_err(|e| AgentError::Unsupported(format!("spawning the bounce driver: {e}")))?;
        Ok(Self {
            shared,
            driver: Some(driver),
        })
    }

    /// The agent underneath.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.shared.agent
    }

    /// Counters since the start.
    pub fn stats(&self) -> BounceStats {
        self.shared.lock().stats
    }

    /// Bounce messages received that did not parse (dropped, never acted on).
    pub fn malformed(&self) -> u64 {
        self.shared.malformed.load(Ordering::Relaxed)
    }

    /// Make device memory available to transfers; linked peers learn of it.
    pub fn add_device_memory(&self, mem: Arc<dyn DeviceMemory>) -> DevRegionId {
        let mut st = self.shared.lock();
        let id = st.next_dev;
        st.next_dev += 1;
        st.devices.insert(id, mem);
        let peers: Vec<String> = st
            .links
            .iter()
            .filter(|(_, l)| l.peer.is_some())
            .map(|(p, _)| p.clone())
            .collect();
        for p in peers {
            let hello = driver::hello(&self.shared, &st, &p, false);
            driver::send(&self.shared, &p, &hello);
        }
        DevRegionId(id)
    }

    /// Link to the peer whose side channel is at `addr` (loading its metadata; the peer
    /// links back) and return its name once both sides' staging buffers are known.
    ///
    /// # Errors
    /// What [`Agent::load_remote`] returns; [`AgentError::Connection`] when the peer does not
    /// answer within 10 s (is it running a [`Bounce`]?).
    pub fn connect(&self, addr: SocketAddr) -> Result<String, AgentError> {
        let peer = self.shared.agent.load_remote(addr)?;
        let mut st = self.shared.lock();
        driver::ensure_link(&self.shared, &mut st, &peer)?;
        let hello = driver::hello(&self.shared, &st, &peer, true);
        driver::send(&self.shared, &peer, &hello);
        let deadline = Instant::now() + Duration::from_secs(10);
        while st.links.get(&peer).is_none_or(|l| l.peer.is_none()) {
            let now = Instant::now();
            if now >= deadline {
                return Err(AgentError::Connection {
                    what: "host-bounce link to",
                    addr: addr.to_string(),
                    message: "the peer did not answer within 10 s (is it running kvrail's \
                              host bounce?)"
                        .into(),
                });
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(peer)
    }

    /// Describe a transfer: `local[i]` (device memory here) pairs with `remote[i]` (the
    /// peer's device memory); `notif` reaches the peer after every byte is in place.
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`] (not linked), [`AgentError::LengthMismatch`],
    /// [`AgentError::InvalidDesc`] naming the side, index and problem.
    pub fn create_xfer(
        &self,
        op: XferOp,
        local: Vec<DevDesc>,
        peer: &str,
        remote: Vec<DevDesc>,
        notif: Option<Vec<u8>>,
    ) -> Result<XferId, AgentError> {
        if local.len() != remote.len() {
            return Err(AgentError::LengthMismatch {
                local: local.len(),
                remote: remote.len(),
            });
        }
        let mut st = self.shared.lock();
        let link = st
            .links
            .get(peer)
            .filter(|l| l.peer.is_some())
            .ok_or_else(|| AgentError::UnknownPeer(peer.into()))?;
        for (i, (l, r)) in local.iter().zip(&remote).enumerate() {
            let size = st.devices.get(&l.region.0).map(|m| m.size());
            check_desc("local", i, l, size)?;
            check_desc("remote", i, r, link.peer_regions.get(&r.region.0).copied())?;
            if l.len != r.len {
                return Err(AgentError::InvalidDesc {
                    side: "remote",
                    index: i,
                    reason: format!("{} bytes, local has {}", r.len, l.len),
                });
            }
        }
        let id = st.next_xid;
        st.next_xid += 1;
        st.xfers
            .insert(id, Xfer::new(op, peer, local, remote, notif));
        Ok(XferId(id))
    }

    /// Start a created (or finished) transfer.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`], [`AgentError::UnknownPeer`] when the
    /// link is gone.
    pub fn post(&self, id: XferId) -> Result<(), AgentError> {
        let sh = &self.shared;
        let mut st = sh.lock();
        let x = st.xfers.get_mut(&id.0).ok_or(AgentError::NoXfer(id.0))?;
        if x.status == XferStatus::InProgress {
            return Err(AgentError::Active(id.0));
        }
        x.reset();
        let (op, peer, gen) = (x.op, x.peer.clone(), x.gen);
        let pieces: Vec<Piece> = x.pieces();
        let notif = x.notif.clone();
        if !st.links.contains_key(&peer) {
            return Err(AgentError::UnknownPeer(peer));
        }
        match op {
            XferOp::Write => {
                let job = Job {
                    tag: Tag {
                        xid: id.0,
                        read: false,
                        gen,
                    },
                    pieces: pieces.into(),
                    notif,
                    sent: 0,
                };
                if let Some(l) = st.links.get_mut(&peer) {
                    l.queue.push_back(job);
                }
                driver::pump(sh, &mut st, &peer);
            }
            XferOp::Read => {
                // the peer sends src (its device) → dst (ours): swap the roles
                let pieces = pieces
                    .into_iter()
                    .map(|p| Piece {
                        src: p.dst,
                        dst: p.src,
                    })
                    .collect();
                driver::send(
                    sh,
                    &peer,
                    &Wire::ReadReq {
                        xid: id.0,
                        gen,
                        pieces,
                    },
                );
            }
        }
        Ok(())
    }

    /// Where a transfer stands.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub fn status(&self, id: XferId) -> Result<XferStatus, AgentError> {
        let st = self.shared.lock();
        st.xfers
            .get(&id.0)
            .map(|x| x.status.clone())
            .ok_or(AgentError::NoXfer(id.0))
    }

    /// Sleep until the transfer is no longer in progress, or `timeout` passed; its status.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`].
    pub fn wait(&self, id: XferId, timeout: Duration) -> Result<XferStatus, AgentError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        loop {
            let s = st
                .xfers
                .get(&id.0)
                .map(|x| x.status.clone())
                .ok_or(AgentError::NoXfer(id.0))?;
            let now = Instant::now();
            if s != XferStatus::InProgress || now >= deadline {
                return Ok(s);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Forget a transfer that is not in progress.
    ///
    /// # Errors
    /// [`AgentError::NoXfer`], [`AgentError::Active`].
    pub fn release(&self, id: XferId) -> Result<(), AgentError> {
        let mut st = self.shared.lock();
        match st.xfers.get(&id.0) {
            None => Err(AgentError::NoXfer(id.0)),
            Some(x) if x.status == XferStatus::InProgress => Err(AgentError::Active(id.0)),
            Some(_) => {
                st.xfers.remove(&id.0);
                Ok(())
            }
        }
    }

    /// The engine's notifications received since the last call (bounce messages removed).
    pub fn get_new_notifs(&self) -> Vec<(String, Vec<u8>)> {
        self.shared.lock().user_notifs.drain(..).collect()
    }

    /// Send the engine's notification to a linked peer.
    ///
    /// # Errors
    /// What [`Agent::send_notif`] returns.
    pub fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), AgentError> {
        self.shared.agent.send_notif(peer, bytes)
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.driver.take() {
            let _ = t.join();
        }
    }
}

fn check_desc(
    side: &'static str,
    index: usize,
    d: &DevDesc,
    size: Option<u64>,
) -> Result<(), AgentError> {
    let reason = match size {
        None => format!("no device region {}", d.region.0),
        Some(size) => match d.offset.checked_add(d.len) {
            Some(end) if end <= size => return Ok(()),
            _ => format!(
                "range [{}, {}+{}) is outside device region {} ({size} bytes)",
                d.offset, d.offset, d.len, d.region.0
            ),
        },
    };
    Err(AgentError::InvalidDesc {
        side,
        index,
        reason,
    })
}

/// A device region's part, for the wire.
fn part(d: &DevDesc) -> Part {
    Part {
        region: d.region.0,
        offset: d.offset,
        len: d.len,
    }
}
