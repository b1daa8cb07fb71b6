//! The threads kvrail starts: named, and run on the CPUs the process may use rather than
//! on the core its caller was pinned to.
//!
//! A thread inherits the CPU affinity of the thread that starts it. Engines pin their
//! inference threads: vLLM's CPU worker binds its worker thread and OpenMP threads to the
//! cores it picked (`VLLM_CPU_OMP_THREADS_BIND`, `auto` by default), and two engines on one
//! host can pick the same core. kvrail's listener, its peer connections and the connector's
//! service thread, started from that worker, then share that core with threads that spin
//! (vLLM's worker polls its message queue with `sched_yield` after each step). Measured
//! with vLLM 0.32 serving P and D on a 2-core host: P's side channel accepted D's
//! connection 10 to 20 s late, the lease ran out, and D's first request failed; with the
//! binding off, every request loaded its KV in about 1 s.
//!
//! So each thread kvrail starts first sets its affinity to the CPUs named by
//! `KVRAIL_CPUS` (a list such as `0-3,8`: for an operator who keeps kvrail off cores set
//! aside for something else), else to every online CPU; the kernel keeps it within the
//! process's cpuset (a container's CPUs). Where neither can be set the thread keeps the
//! affinity it inherited.

use std::sync::OnceLock;
use std::thread::JoinHandle;

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// The environment variable naming the CPUs kvrail's threads run on.
pub const CPUS_ENV: &str = "KVRAIL_CPUS";

/// Start a thread named `name` that runs `f` on the CPUs kvrail's threads use.
///
/// # Errors
/// The operating system's, when it cannot start a thread.
///
/// # Example
/// ```
/// let t = kvrail::threads::spawn("kvrail-example", || 2 + 2).unwrap();
/// assert_eq!(t.join().unwrap(), 4);
/// ```
pub fn spawn<F, T>(name: impl Into<String>, f: F) -> std::io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            unpin();
            f()
        })
}

/// Move the calling thread onto kvrail's CPUs (nothing where they cannot be set).
fn unpin() {
    if let Some(set) = cpus() {
        // EINVAL: none of them is in the process's cpuset; the thread keeps what it had
        let _ = sched_setaffinity(Pid::from_raw(0), set);
    }
}

/// kvrail's CPUs, worked out once per process.
fn cpus() -> Option<&'static CpuSet> {
    static CPUS: OnceLock<Option<CpuSet>> = OnceLock::new();
    CPUS.get_or_init(|| {
        if let Ok(v) = std::env::var(CPUS_ENV) {
            match cpu_set(&v) {
                Ok(s) => return Some(s),
                Err(e) => tracing::warn!(
                    "{CPUS_ENV}={v:?}: {e}; kvrail's threads run on every online CPU"
                ),
            }
        }
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
        cpu_set(online.trim()).ok()
    })
    .as_ref()
}

/// A CPU list as the kernel writes one (`0-3,8,10-11`).
fn cpu_set(list: &str) -> Result<CpuSet, String> {
    let mut set = CpuSet::new();
    let mut any = false;
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let num = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("{part:?} is not a CPU number or range"))
        };
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(format!("{part:?}: the range runs backwards"));
        }
        for c in a..=b {
            set.set(c).map_err(|_| {
                format!(
                    "CPU {c} is beyond the {} this build handles",
                    CpuSet::count()
                )
            })?;
            any = true;
        }
    }
    if any {
        Ok(set)
    } else {
        Err("no CPU named".into())
    }
}

/// Lock `m`, taking the data even when a thread panicked while holding it: kvrail's state
/// stays consistent at every unlock, so a panic elsewhere must not turn every later call into
/// one.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `d` in nanoseconds (saturating): the unit of the clocks kept in atomics by waiting
/// callers and polling threads.
pub(crate) fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sched::sched_getaffinity;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        let s = cpu_set("0-2, 5,7-7").unwrap();
        let on: Vec<usize> = (0..16).filter(|&c| s.is_set(c).unwrap()).collect();
        assert_eq!(on, [0, 1, 2, 5, 7]);
        for bad in ["", "x", "3-1", "1-", ",", "99999"] {
            assert!(cpu_set(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// A thread started from a thread pinned to one CPU runs on every online CPU (the
    /// defect: kvrail's threads shared the core an engine pinned its worker to).
    #[test]
    fn a_thread_started_from_a_pinned_thread_is_not_pinned() {
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
        let all = cpu_set(online.trim()).unwrap();
        let n = (0..CpuSet::count())
            .filter(|&c| all.is_set(c).unwrap())
            .count();
        let me = Pid::from_raw(0);
        let allowed = sched_getaffinity(me).unwrap();
        let allowed_n = (0..CpuSet::count())
            .filter(|&c| allowed.is_set(c).unwrap())
            .count();
        if n < 2 || allowed_n < 2 {
            eprintln!("one CPU here: nothing to show");
            return;
        }
        let first = (0..CpuSet::count())
            .find(|&c| allowed.is_set(c).unwrap())
            .unwrap();
        // a pinned "engine" thread starts kvrail's thread, and a plain one for contrast
        let (ours, plain) = std::thread::spawn(move || {
            let mut one = CpuSet::new();
            one.set(first).unwrap();
            sched_setaffinity(me, &one).unwrap();
            let count = || {
                let s = sched_getaffinity(Pid::from_raw(0)).unwrap();
                (0..CpuSet::count())
                    .filter(|&c| s.is_set(c).unwrap())
                    .count()
            };
            let ours = spawn("kvrail-test", count).unwrap().join().unwrap();
            let plain = std::thread::spawn(count).join().unwrap();
            (ours, plain)
        })
        .join()
        .unwrap();
        assert_eq!(plain, 1, "std's thread inherits the pinning");
        assert!(
            ours > 1 && ours >= allowed_n,
            "kvrail's thread runs on {ours} CPU(s); the process may use {allowed_n}"
        );
    }
}
