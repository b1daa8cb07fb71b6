//! Host bounce: how the agent moves memory the NIC cannot reach (NPU memory without a
//! dma-buf path) on the verbs backend. It is a path inside the agent, not an API beside it:
//! [`crate::agent::Agent::post`] hands a transfer here when either side of it is device
//! memory, and the transfer's status, notification and errors are the agent's as for any
//! other transfer.
//!
//! For every peer the engine registers two staging regions of `slots × slot_size` bytes:
//! one the peer WRITEs into, one it sends from. A transfer's bytes go in chunks of at most
//! one slot: the sender copies its region (device → host, or host → host for a host region
//! paired with device memory) into a free slot, RDMA-WRITEs it into the same slot of the
//! receiver, whose agent hands the chunk's message here only after the bytes landed; the
//! receiver copies host → region and acknowledges, which frees the slot. With several slots
//! the steps of consecutive chunks overlap. The engine's notification rides on the last
//! chunk and is delivered only after every chunk is in the destination's memory; a WRITE
//! completes at the initiator when the receiver acknowledged every chunk, a READ when the
//! last chunk is in local memory. A READ asks the peer to send (the same pipeline,
//! reversed).
//!
//! The protocol's messages are agent notifications with a private prefix, routed to the
//! engine by the agent (the engine's own notifications never see them). Failures are
//! bounded: a chunk whose RDMA fails, a copy the runtime refuses, or a peer that
//! acknowledges nothing for `ack_timeout` fails the transfer with the cause; nothing reports
//! success for bytes that did not land.

mod driver;
pub(crate) mod wire;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::agent::backend::{Backend, DevicePath, Posted};
use crate::agent::{error::AgentError, xfer::Desc, xfer::XferOp, Agent, WeakAgent};
use driver::State;
use wire::Piece;

/// An agent transfer to bounce.
pub(crate) struct Post {
    /// The agent's transfer id.
    pub(crate) id: u64,
    pub(crate) op: XferOp,
    pub(crate) peer: String,
    /// Local → remote, in order.
    pub(crate) pieces: Vec<Piece>,
    /// For the peer, after the last byte.
    pub(crate) notif: Option<Vec<u8>>,
}

pub use crate::agent::config::BounceConfig;

pub use crate::agent::stats::BounceStats;

pub(crate) struct Core {
    pub(crate) agent: WeakAgent,
    pub(crate) config: BounceConfig,
    pub(crate) state: Mutex<State>,
    /// Bounce messages routed here by the agent, not yet handled.
    pub(crate) inbox: Mutex<VecDeque<(String, Vec<u8>)>>,
    /// Signalled with `inbox` when a message arrives or the engine stops.
    pub(crate) wake: Condvar,
    pub(crate) stop: AtomicBool,
    pub(crate) malformed: AtomicU64,
    /// Transfers with a record in the state: while there are none, releases are not noted
    /// (most transfers never bounce).
    pub(crate) tracked: AtomicU64,
    /// Transfers the agent released since the driver last looked. A list of its own, not the
    /// state: the driver itself releases its chunk transfers with the state locked.
    pub(crate) released: Mutex<Vec<u64>>,
}

impl Core {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A bounce message from `from`, for the driver.
    fn incoming(&self, from: &str, bytes: Vec<u8>) {
        let mut q = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back((from.to_owned(), bytes));
        self.wake.notify_all();
    }
}

/// The agent's host-bounce engine (one per verbs agent), with its driver thread.
pub(crate) struct Engine {
    core: Arc<Core>,
}

impl Engine {
    /// Start the engine for the agent `agent` refers to.
    ///
    /// # Errors
    /// [`AgentError::Unsupported`] for zero slots or a zero slot size, or no thread.
    pub(crate) fn start(agent: WeakAgent, config: BounceConfig) -> Result<Self, AgentError> {
        if config.slots == 0 || config.slot_size == 0 {
            return Err(AgentError::Unsupported(
                "bounce: at least one staging slot of at least one byte".into(),
            ));
        }
        let core = Arc::new(Core {
            agent,
            config,
            state: Mutex::new(State::default()),
            inbox: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            malformed: AtomicU64::new(0),
            tracked: AtomicU64::new(0),
            released: Mutex::new(Vec::new()),
        });
        let c = core.clone();
        crate::threads::spawn("kvrail-bounce", move || driver::run(&c))
            .map_err(|e| AgentError::Unsupported(format!("spawning the bounce driver: {e}")))?;
        Ok(Self { core })
    }

    /// What the agent's core asks first about each notification: the engine takes its own
    /// (those that start with [`wire::MAGIC`]).
    pub(crate) fn tap(&self) -> Arc<dyn crate::agent::core::NotifTap> {
        Arc::new(Tap(self.core.clone()))
    }

    /// Move an agent transfer through the staging slots. The agent learns the outcome
    /// through its transfer table.
    ///
    /// # Errors
    /// What registering the staging buffers returns.
    pub(crate) fn post(&self, agent: &Agent, req: Post) -> Result<(), AgentError> {
        driver::post(&self.core, agent, req)?;
        self.core.wake.notify_all();
        Ok(())
    }

    /// `peer` is gone (invalidated, or reloaded at a new address): its link is dropped.
    pub(crate) fn forget(&self, peer: &str) {
        self.core.lock().links.remove(peer);
    }

    /// The agent released transfer `id`: its record (kept for reposts) goes.
    pub(crate) fn forget_xfer(&self, id: u64) {
        if self.core.tracked.load(Ordering::Acquire) > 0 {
            let mut r = self.core.released.lock().unwrap_or_else(|p| p.into_inner());
            r.push(id);
        }
    }

    /// Counters since the start.
    pub(crate) fn stats(&self) -> BounceStats {
        BounceStats {
            malformed: self.core.malformed.load(Ordering::Relaxed),
            ..self.core.lock().stats
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The driver may hold the last reference to the agent and so drop this engine from
        // its own thread: it is told to stop, never joined.
        self.core.stop.store(true, Ordering::Release);
        let _q = self.core.inbox.lock().unwrap_or_else(|p| p.into_inner());
        self.core.wake.notify_all();
    }
}

/// The engine's side of the core's notification tap.
struct Tap(Arc<Core>);

impl crate::agent::core::NotifTap for Tap {
    fn take(&self, from: &str, bytes: Vec<u8>) -> Option<Vec<u8>> {
        if !bytes.starts_with(wire::MAGIC) {
            return Some(bytes);
        }
        // the engine's state, not an `Engine`: dropping one stops the driver
        self.0.incoming(from, bytes);
        None
    }
}

impl Backend for Engine {
    fn start(&self, x: Posted) -> Result<(), AgentError> {
        let part = |d: &Desc| wire::Part {
            region: d.region.0,
            offset: d.offset,
            len: d.len,
        };
        let pieces = x
            .local
            .iter()
            .zip(x.remote.iter())
            .map(|((_, l), r)| wire::Piece {
                src: part(l),
                dst: part(r),
            })
            .collect();
        let req = Post {
            id: x.id,
            op: x.op,
            peer: x.peer.to_string(),
            pieces,
            notif: x.notif,
        };
        // the caller posting holds the agent, so it is there
        let agent = (self.core.agent.upgrade())
            .ok_or_else(|| AgentError::Unsupported("bounce: the agent is gone".into()))?;
        self.post(&agent, req)
    }
}

impl DevicePath for Engine {
    fn stats(&self) -> BounceStats {
        Self::stats(self)
    }

    fn forget(&self, peer: &str) {
        Self::forget(self, peer);
    }

    fn forget_xfer(&self, id: u64) {
        Self::forget_xfer(self, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::agent::config::AgentConfig;

    /// The tap hands the engine's messages to its driver and leaves the engine running (it
    /// once wrapped the state in a throwaway `Engine`, whose drop stopped the driver at the
    /// first message: every device-memory transfer on verbs then stalled for 30 s).
    #[test]
    fn the_tap_takes_the_engines_messages_and_leaves_it_running() {
        let cfg = AgentConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            backend: crate::agent::BackendChoice::Tcp,
            ..AgentConfig::default()
        };
        let agent = Agent::new("bounce-tap", cfg).unwrap();
        let engine = Engine::start(agent.downgrade(), BounceConfig::default()).unwrap();
        let tap = engine.tap();
        let other = b"done:req-1".to_vec();
        assert_eq!(
            tap.take("peer", other.clone()),
            Some(other),
            "not the engine's"
        );
        for _ in 0..3 {
            let mut junk = wire::MAGIC.to_vec();
            junk.extend_from_slice(b"\xff not a bounce message");
            assert_eq!(tap.take("peer", junk), None, "the engine's: taken");
            assert!(
                !engine.core.stop.load(Ordering::Acquire),
                "the tap stopped the engine"
            );
        }
        // the driver reads all three (and drops them as malformed, never acting on them)
        let t0 = std::time::Instant::now();
        while engine.stats().malformed < 3 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{:?}",
                engine.stats()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
