//! kvrail's log records for Python's `logging`. Rust threads never take the GIL to log (a
//! thread holding one of kvrail's locks could otherwise wait for the GIL while Python waits
//! for that lock): records go into a bounded queue that a Python thread of the package drains
//! (`kvrail._logging`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;

/// Records kept at most (the oldest go first when Python does not keep up).
const CAP: usize = 10_000;

#[derive(Default)]
struct Queue {
    records: VecDeque<(u32, String, String)>,
    dropped: u64,
}

struct Logger {
    q: Mutex<Queue>,
    ready: Condvar,
    /// The package stopped draining (interpreter exit): `take_logs` no longer waits.
    stopped: AtomicBool,
}

fn logger() -> &'static Logger {
    static L: OnceLock<Logger> = OnceLock::new();
    L.get_or_init(|| Logger {
        q: Mutex::new(Queue::default()),
        ready: Condvar::new(),
        stopped: AtomicBool::new(false),
    })
}

impl log::Log for Logger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        // `tracing` turns each span's creation and end into a record of its own
        // ("agent; name=…", target `tracing::span`): context, not events; left out
        m.level() <= log::max_level() && !m.target().starts_with("tracing::span")
    }

    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        // Python's levels: DEBUG 10, INFO 20, WARNING 30, ERROR 40 (TRACE: 5)
        let level = match r.level() {
            log::Level::Error => 40,
            log::Level::Warn => 30,
            log::Level::Info => 20,
            log::Level::Debug => 10,
            log::Level::Trace => 5,
        };
        let mut q = self.q.lock().unwrap_or_else(PoisonError::into_inner);
        if q.records.len() >= CAP {
            q.records.pop_front();
            q.dropped += 1;
        }
        q.records
            .push_back((level, r.target().replace("::", "."), r.args().to_string()));
        self.ready.notify_one();
    }

    fn flush(&self) {}
}

/// Install the queue as the process's `log` logger (once; another installed logger wins).
pub(crate) fn install() {
    let _ = log::set_logger(logger());
}

/// Records at `level` (Python's number) and above are kept.
#[pyfunction]
pub(crate) fn set_log_level(level: u32) {
    log::set_max_level(match level {
        0..=5 => log::LevelFilter::Trace,
        6..=10 => log::LevelFilter::Debug,
        11..=20 => log::LevelFilter::Info,
        21..=30 => log::LevelFilter::Warn,
        31..=50 => log::LevelFilter::Error,
        _ => log::LevelFilter::Off,
    });
}

/// The records logged since the last call (waiting up to `timeout_s` for the first, without
/// the GIL): (Python level, logger name, message), and how many were dropped meanwhile.
#[pyfunction]
pub(crate) fn take_logs(py: Python<'_>, timeout_s: f64) -> (Vec<(u32, String, String)>, u64) {
    let t = Duration::from_secs_f64(timeout_s.max(0.0));
    py.allow_threads(|| {
        let l = logger();
        let mut q = l.q.lock().unwrap_or_else(PoisonError::into_inner);
        if q.records.is_empty() && !l.stopped.load(Ordering::Acquire) {
            q = l
                .ready
                .wait_timeout(q, t)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let dropped = std::mem::take(&mut q.dropped);
        (q.records.drain(..).collect(), dropped)
    })
}

/// Stop draining: a `take_logs` waiting now returns at once, and later ones do not wait.
///
/// The package calls it at interpreter exit (`atexit`), then joins its draining thread.
/// A daemon thread that comes back from `take_logs` (taking the GIL again) after the
/// interpreter began finalizing is ended by Python with `pthread_exit`, whose forced unwind
/// through the native frames aborts the process ("FATAL: exception not rethrown"); agents
/// dropped at exit log, which woke the thread at exactly that moment (6 of 10 exits of a
/// program that kept four agent pairs alive with DEBUG logging aborted).
#[pyfunction]
pub(crate) fn stop_logs() {
    let l = logger();
    l.stopped.store(true, Ordering::Release);
    // under the queue's lock, so a taker between its check and its wait cannot miss it
    let _q = l.q.lock().unwrap_or_else(PoisonError::into_inner);
    l.ready.notify_all();
}
