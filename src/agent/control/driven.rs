//! Caller-driven progress on a TCP connection (`AgentConfig::progress_spin_us`): a caller
//! that waits with a budget sends what is queued for the peer and reads the peer's answers
//! itself, as on verbs it polls the completion queues, while the connection's writer and
//! reader threads stay asleep.
//!
//! Why: with 32 small WRITEs in flight each batch crossed four threads — caller, writer,
//! the peer's server, reader, caller — two of them wake-ups inside this process, and a
//! looking caller took the CPU the writer and reader needed (4 KiB x 32 on two cores, two
//! processes: the client's threads spent ~4.5 us of CPU a transfer against ~1 us for a plain
//! one-thread socket loop doing the same). A caller that drives the socket itself needs
//! neither hand-off.
//!
//! The rules:
//! - Each pass of a driving caller marks the connection driven for one budget from now (at
//!   most [`WINDOW_MAX`]). Its threads do not touch the socket while it is driven: they
//!   sleep (bounded by the end of that window) and then resume, so what nobody drives any
//!   longer — work posted after a caller's last wait, an answer that arrives after it — is
//!   sent or read within that window. A caller that goes to sleep (its budget ran out, or
//!   it waits for a large answer) ends the window at once.
//! - Whoever holds a side's lock sends (reads); the threads hold it while they block on
//!   the socket, so a caller only ever tries the locks and never waits on the socket: what
//!   it cannot do without waiting — a batch the socket did not take whole, work that is not
//!   small, a message other than an answer, the end of the connection — it hands to the
//!   thread (which does it next, in order) and wakes it.

use crate::threads::nanos;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::msg::{Msg, Reader};
use super::Host;
use super::Work;
use crate::agent::tcp_batch::Batch;
use crate::threads::lock;

/// The longest a pass keeps the connection's threads asleep: with a long budget, work
/// posted after a caller's last pass still goes out (and answers are read) this soon.
pub(crate) const WINDOW_MAX: Duration = Duration::from_millis(16);

/// A look (`Agent::status`, `get_new_notifs`) reads the socket only if nobody did for this
/// long: a loop asking about every transfer in flight would otherwise make a receive call
/// for each, finding what the first found.
pub(crate) const LOOK_GAP: Duration = Duration::from_micros(5);

/// Who makes a pass: a caller waiting for an answer reads the socket every pass; a caller
/// looking once reads it only if nobody did within [`LOOK_GAP`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Pass {
    /// `Agent::wait`, `wait_notifs`: the caller spins on passes.
    Wait,
    /// `Agent::status`, `get_new_notifs`: one pass.
    Look,
}

/// The send side: the queue's receiving end, the socket and the batch being gathered.
pub(super) struct Out {
    pub(super) rx: mpsc::Receiver<Work>,
    pub(super) w: TcpStream,
    pub(super) batch: Batch,
    /// Work a caller took from the queue and left to the thread (after the batch's rest),
    /// or the error it met.
    pub(super) held: Option<std::io::Result<Work>>,
}

/// The receive side: the reader, and what a caller read and left to the thread (a
/// message, or why the connection ended).
pub(super) struct In {
    pub(super) r: Reader<TcpStream>,
    pub(super) stash: Option<Result<Msg, String>>,
    /// The connection's queue (a READ's notification is queued on it when its bytes are
    /// in); let go when the reader ends, so the writer ends once the agent's are gone.
    pub(super) tx: Option<mpsc::Sender<Work>>,
}

/// One connection's I/O, shared by its two threads and driving callers (see the module).
pub(crate) struct Driven {
    base: Instant,
    /// End of the driven window, nanoseconds after `base` (0: not driven).
    until: AtomicU64,
    /// When a caller last read the socket, nanoseconds after `base`.
    looked: AtomicU64,
    /// A caller left the writer something (`Out::held`, a batch's rest).
    out_handed: AtomicBool,
    /// A caller left the reader something (`In::stash`).
    in_handed: AtomicBool,
    park: Mutex<()>,
    cv: Condvar,
    pub(super) out: Mutex<Out>,
    pub(super) inp: Mutex<In>,
    /// Work items finished on the connection (sent or failed).
    pub(super) sent: Arc<AtomicU64>,
    pub(super) peer: String,
}

impl Driven {
    pub(super) fn new((out, inp): (Out, In), sent: Arc<AtomicU64>, peer: &str) -> Self {
        Self {
            base: Instant::now(),
            until: AtomicU64::new(0),
            looked: AtomicU64::new(0),
            out_handed: AtomicBool::new(false),
            in_handed: AtomicBool::new(false),
            park: Mutex::new(()),
            cv: Condvar::new(),
            out: Mutex::new(out),
            inp: Mutex::new(inp),
            sent,
            peer: peer.to_owned(),
        }
    }

    fn now(&self) -> u64 {
        nanos(self.base.elapsed())
    }

    /// Whether a caller left the writer (`out`) or the reader something.
    fn handed(&self, out: bool) -> &AtomicBool {
        if out {
            &self.out_handed
        } else {
            &self.in_handed
        }
    }

    /// A thread's wait while callers drive the connection: until the window ends, or a
    /// caller hands this side (`out`: the writer's) something.
    pub(super) fn park(&self, out: bool) {
        let handed = self.handed(out);
        let mut g = lock(&self.park);
        loop {
            if handed.load(Ordering::Acquire) {
                return;
            }
            let (until, now) = (self.until.load(Ordering::Acquire), self.now());
            if until <= now {
                return;
            }
            let left = Duration::from_nanos(until - now);
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The thread took what it was handed (with its side's lock held).
    pub(super) fn taken(&self, out: bool) {
        let handed = self.handed(out);
        handed.store(false, Ordering::Release);
    }

    fn hand(&self, out: bool) {
        let handed = self.handed(out);
        handed.store(true, Ordering::Release);
        let _g = lock(&self.park);
        self.cv.notify_all();
    }

    /// No caller drives the connection any more: its threads resume now.
    pub(crate) fn release(&self) {
        if self.until.load(Ordering::Acquire) != 0 && self.until.swap(0, Ordering::AcqRel) != 0 {
            let _g = lock(&self.park);
            self.cv.notify_all();
        }
    }

    /// One pass of a caller with `budget`: mark the connection driven (for the budget, at
    /// most [`WINDOW_MAX`]), send what is queued, read what answers are here. Returns how
    /// many answers it dispatched. A [`Pass::Look`] reads only if nobody did within
    /// [`LOOK_GAP`].
    pub(crate) fn drive(&self, shared: &dyn Host, budget: Duration, pass: Pass) -> usize {
        let window = budget.min(WINDOW_MAX);
        let now = self.now();
        let end = now.saturating_add(nanos(window));
        self.until.fetch_max(end, Ordering::AcqRel);
        self.drive_out(shared);
        if pass == Pass::Look
            && now.saturating_sub(self.looked.load(Ordering::Acquire)) < nanos(LOOK_GAP)
        {
            return 0;
        }
        self.looked.store(now, Ordering::Release);
        self.drive_in(shared)
    }

    fn drive_out(&self, shared: &dyn Host) {
        let Ok(mut g) = self.out.try_lock() else {
            return; // the writer is at it
        };
        let o = &mut *g;
        if o.held.is_some() {
            return; // handed to the writer already
        }
        let mut rest = false;
        while let Ok(work) = o.rx.try_recv() {
            match o.batch.take(shared, work) {
                Ok(None) => {
                    self.sent.fetch_add(1, Ordering::Release);
                    if o.batch.full() {
                        match o.batch.try_send(shared, &o.w) {
                            Ok(true) => {}
                            Ok(false) => {
                                rest = true;
                                break;
                            }
                            Err(e) => {
                                o.held = Some(Err(e));
                                break;
                            }
                        }
                    }
                }
                Ok(Some(work)) => {
                    o.held = Some(Ok(work)); // large, or not a transfer: the writer's
                    break;
                }
                Err(e) => {
                    o.held = Some(Err(e));
                    break;
                }
            }
        }
        if !rest && !o.batch.is_empty() && !matches!(o.held, Some(Err(_))) {
            match o.batch.try_send(shared, &o.w) {
                Ok(done) => rest = !done,
                Err(e) => o.held = Some(Err(e)),
            }
        }
        if rest || o.held.is_some() {
            drop(g);
            self.hand(true);
        }
    }

    fn drive_in(&self, shared: &dyn Host) -> usize {
        let Ok(mut g) = self.inp.try_lock() else {
            return 0; // the reader is at it
        };
        let i = &mut *g;
        if i.stash.is_some() {
            return 0; // handed to the reader already
        }
        let mut n = 0;
        loop {
            let m = match i.r.try_next() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(why) => {
                    i.stash = Some(Err(why));
                    break;
                }
            };
            // answers only, whose bytes are here: nothing that would wait on the socket
            let here = match &m {
                Msg::Ack { .. } | Msg::Fail { .. } => true,
                Msg::ReadData { len, .. } => i.r.buffered() >= *len as usize,
                _ => false,
            };
            if !here {
                i.stash = Some(Ok(m));
                break;
            }
            if let Err(why) = super::answer::answer(shared, i.tx.as_ref(), &self.peer, m, &mut i.r)
            {
                i.stash = Some(Err(why));
                break;
            }
            n += 1;
        }
        if i.stash.is_some() {
            drop(g);
            self.hand(false);
        }
        n
    }
}
