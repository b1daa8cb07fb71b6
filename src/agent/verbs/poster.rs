//! Posting off the engine lock: one poster thread per rail takes the chunks the engine
//! queued for that rail's queue pairs, in order (so each queue pair sees its requests in
//! queue order), and posts them — consecutive chunks for one queue pair in one call.
//!
//! Why a thread per rail: rxe (Soft-RoCE) does a user queue pair's packet work inside
//! `ibv_post_send`, so one thread posting for every rail moves one rail at a time; on
//! hardware it keeps the doorbell out of the engine lock. Slices are counted in flight when
//! queued here; a chunk whose post fails fails its queue pair (unless that pair already
//! died or was rebuilt, in which case its slices were already moved elsewhere).
//!
//! The only transfer in flight, on one rail, posted while that rail's poster has nothing
//! queued, is posted in place by the caller instead: one thread hand-off less per transfer,
//! which is what a single transfer in flight waits on. The caller posts it after letting go
//! of the engine lock, so a chunk queued to the poster meanwhile may reach the device first;
//! nothing relies on the order across transfers (each chunk's completion names its
//! transfer and its slice count).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use smallvec::SmallVec;

use super::Host;
use super::{lock, Engine, Pending, Verbs};
use crate::agent::{error::AgentError, xfer::XferOp};
use crate::transport::verbs::{Qp, SendWr, Sge};

/// Slices of one transfer for one queue pair, the last one to be signaled.
pub(super) struct Chunk {
    /// The pair (peer, local rail).
    pub(super) key: super::PairKey,
    pub(super) qp: Qp,
    pub(super) xfer: u64,
    pub(super) slices: Vec<Pending>,
}

/// Slices of one transfer the caller posts itself, after it let go of the engine lock.
pub(super) struct InPlace {
    pub(super) rail: usize,
    pub(super) qp: Qp,
    pub(super) xfer: u64,
    pub(super) slices: SmallVec<[Pending; 2]>,
}

/// Work for a rail's poster.
pub(super) enum Job {
    /// Post a chunk.
    Post(Chunk),
    /// Stop (the agent shuts down).
    Stop,
}

/// The senders to each rail's poster, and the receivers until the threads start.
pub(super) struct Posters {
    pub(super) tx: Vec<mpsc::Sender<Job>>,
    /// Chunks handed to each poster and not yet posted. Raised under the engine lock,
    /// lowered by the poster after posting: zero, seen under the engine lock, means every
    /// chunk queued so far is on the wire, so a chunk posted in place does not overtake
    /// them.
    pub(super) queued: Vec<AtomicUsize>,
    rx: std::sync::Mutex<Vec<mpsc::Receiver<Job>>>,
}

impl Posters {
    pub(super) fn new(rails: usize) -> Self {
        let (tx, rx) = (0..rails).map(|_| mpsc::channel()).unzip();
        Self {
            tx,
            queued: (0..rails).map(|_| AtomicUsize::new(0)).collect(),
            rx: std::sync::Mutex::new(rx),
        }
    }
}

impl Verbs {
    /// Start one poster thread per rail.
    pub(super) fn spawn_posters(
        self: &Arc<Self>,
        shared: &Arc<dyn Host>,
    ) -> Result<(), AgentError> {
        let rxs: Vec<mpsc::Receiver<Job>> = std::mem::take(&mut *lock(&self.posters.rx));
        for (rail, rx) in rxs.into_iter().enumerate() {
            let me = self.clone();
            let shared = shared.clone();
            crate::threads::spawn(
                format!("kvrail-post-{}", self.rails[rail].name),
                move || {
                    let _span = tracing::info_span!("agent", name = %shared.name).entered();
                    me.poster(&*shared, rail, &rx);
                },
            )
            .map_err(|e| AgentError::Unsupported(format!("verbs: poster thread: {e}")))?;
        }
        Ok(())
    }

    /// Ask every poster to stop.
    pub(super) fn stop_posters(&self) {
        for tx in &self.posters.tx {
            let _ = tx.send(Job::Stop);
        }
    }

    fn poster(&self, shared: &dyn Host, rail: usize, rx: &mpsc::Receiver<Job>) {
        let mut batch: Vec<Chunk> = Vec::new();
        while let Ok(first) = rx.recv() {
            let mut stop = false;
            // take what else is queued: consecutive chunks for one queue pair go in one call
            for job in std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                match job {
                    Job::Post(c) => batch.push(c),
                    Job::Stop => stop = true,
                }
                if batch.len() >= 16 || stop {
                    break;
                }
            }
            let mut i = 0;
            while i < batch.len() {
                let qpn = batch[i].qp.qpn();
                let j = i + batch[i..].iter().take_while(|b| b.qp.qpn() == qpn).count();
                self.post_run(shared, rail, &batch[i..j]);
                i = j;
            }
            batch.clear();
            if stop {
                return;
            }
        }
    }

    /// Post consecutive chunks for one queue pair in one call; a failure fails the pair
    /// (when it is still the current one).
    fn post_run(&self, shared: &dyn Host, rail: usize, run: &[Chunk]) {
        if let Err(msg) = self.post_chunks(rail, run) {
            let mut e = lock(&self.engine);
            self.post_failed(shared, &mut e, &run[0].key, &run[0].qp, &msg);
        }
        self.posters.queued[rail].fetch_sub(run.len(), Ordering::AcqRel);
    }

    /// A post on `qp`, the pair `key`'s, failed: fail that pair, unless it already died or
    /// was replaced (its slices were moved elsewhere then).
    pub(super) fn post_failed(
        &self,
        shared: &dyn Host,
        e: &mut Engine,
        key: &super::PairKey,
        qp: &Qp,
        msg: &str,
    ) {
        let current = e
            .pairs
            .get(key)
            .is_some_and(|q| q.dead.is_none() && q.qp.qpn() == qp.qpn());
        if current {
            self.kill_pair(shared, e, key, msg);
        }
    }

    /// Build the work requests of `run` (chunks for one queue pair) and post them.
    pub(super) fn post_chunks(&self, rail: usize, run: &[Chunk]) -> Result<(), String> {
        // as many requests as slices: a list sized for full chunks (64 each) took glibc's
        // large-allocation path, and its consolidation, on every post
        let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(run.iter().map(|c| c.slices.len()).sum());
        for c in run {
            push_wrs(&mut wrs, rail, c.xfer, &c.slices);
        }
        self.post_wrs(rail, &run[0].qp, &wrs)
    }

    /// Post the slices of transfer `xfer` on `qp` (the caller's thread, in place).
    pub(super) fn post_slices(
        &self,
        rail: usize,
        qp: &Qp,
        xfer: u64,
        slices: &[Pending],
    ) -> Result<(), String> {
        let mut wrs: SmallVec<[SendWr<'_>; 2]> = SmallVec::with_capacity(slices.len());
        push_wrs(&mut wrs, rail, xfer, slices);
        self.post_wrs(rail, qp, &wrs)
    }

    fn post_wrs(&self, rail: usize, qp: &Qp, wrs: &[SendWr<'_>]) -> Result<(), String> {
        qp.post_send(wrs)
            .map_err(|err| format!("posting on {}: {err}", self.rails[rail].name))
    }
}

/// The work requests of one transfer's slices on `rail`, the last one signaled (its
/// completion carries the transfer and the slice count).
fn push_wrs<'a>(wrs: &mut impl Extend<SendWr<'a>>, rail: usize, xfer: u64, slices: &'a [Pending]) {
    let n = slices.len();
    wrs.extend(slices.iter().enumerate().map(|(i, p)| {
        let mr = &p.region.mrs[rail];
        let sge = Sge::new(mr, p.local_off as usize, p.len as usize);
        let wr = match p.op {
            XferOp::Write => SendWr::write(0, sge, p.remote, p.remote_off),
            XferOp::Read => SendWr::read(0, sge, p.remote, p.remote_off),
        };
        if i + 1 == n {
            SendWr {
                wr_id: (xfer << 16) | n as u64,
                ..wr
            }
        } else {
            wr.unsignaled()
        }
    }));
}
