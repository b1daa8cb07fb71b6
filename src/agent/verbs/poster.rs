//! Posting off the engine lock: one poster thread per rail takes the chunks the engine
//! queued for that rail's queue pairs, in order (so each queue pair sees its requests in
//! queue order), and posts them — consecutive chunks for one queue pair in one call.
//!
//! Why a thread per rail: rxe (Soft-RoCE) does a user queue pair's packet work inside
//! `ibv_post_send`, so one thread posting for every rail moves one rail at a time; on
//! hardware it keeps the doorbell out of the engine lock. Slices are counted in flight when
//! queued here; a chunk whose post fails fails its queue pair (unless that pair already
//! died or was rebuilt, in which case its slices were already moved elsewhere).

use std::sync::{mpsc, Arc};

use super::{lock, Pending, Verbs, CHUNK};
use crate::agent::{AgentError, Shared, XferOp};
use crate::transport::verbs::{Qp, SendWr, Sge};

/// Slices of one transfer for one queue pair, the last one to be signaled.
pub(super) struct Chunk {
    /// The pair (peer, local rail).
    pub(super) key: (String, usize),
    pub(super) qp: Qp,
    pub(super) xfer: u64,
    pub(super) slices: Vec<Pending>,
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
    rx: std::sync::Mutex<Vec<mpsc::Receiver<Job>>>,
}

impl Posters {
    pub(super) fn new(rails: usize) -> Self {
        let (tx, rx) = (0..rails).map(|_| mpsc::channel()).unzip();
        Self {
            tx,
            rx: std::sync::Mutex::new(rx),
        }
    }
}

impl Verbs {
    /// Start one poster thread per rail.
    pub(super) fn spawn_posters(self: &Arc<Self>, shared: &Arc<Shared>) -> Result<(), AgentError> {
        let rxs: Vec<mpsc::Receiver<Job>> = std::mem::take(&mut *lock(&self.posters.rx));
        for (rail, rx) in rxs.into_iter().enumerate() {
            let me = self.clone();
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("kvrail-post-{}", self.rails[rail].name))
                .spawn(move || me.poster(&shared, rail, &rx))
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

    fn poster(&self, shared: &Shared, rail: usize, rx: &mpsc::Receiver<Job>) {
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

    /// Post consecutive chunks for one queue pair in one call.
    fn post_run(&self, shared: &Shared, rail: usize, run: &[Chunk]) {
        let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(run.len() * CHUNK);
        for c in run {
            let (xfer, n) = (c.xfer, c.slices.len());
            for (i, p) in c.slices.iter().enumerate() {
                let mr = &p.region.mrs[rail];
                let sge = Sge::new(mr, p.local_off as usize, p.len as usize);
                let wr = match p.op {
                    XferOp::Write => SendWr::write(0, sge, p.remote, p.remote_off),
                    XferOp::Read => SendWr::read(0, sge, p.remote, p.remote_off),
                };
                wrs.push(if i + 1 == n {
                    SendWr {
                        wr_id: (xfer << 16) | n as u64,
                        ..wr
                    }
                } else {
                    wr.unsignaled()
                });
            }
        }
        let (key, qp) = (&run[0].key, &run[0].qp);
        if let Err(err) = qp.post_send(&wrs) {
            drop(wrs);
            let msg = format!("posting on {}: {err}", self.rails[rail].name);
            let mut e = lock(&self.engine);
            let current = e
                .pairs
                .get(key)
                .is_some_and(|q| q.dead.is_none() && q.qp.qpn() == qp.qpn());
            if current {
                self.kill_pair(shared, &mut e, key, &msg);
            }
        }
    }
}
