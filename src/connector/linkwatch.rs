//! The `link_down_exit_s` monitor: a thread that reads the state of the worker's local links
//! (`sys/class/infiniband/<device>/ports/<port>/state`, under an injectable root) every poll
//! interval and drives [`LinkWatch`]. When every link has been down for the configured time
//! it runs its action once: by default it logs why and exits the process with
//! [`LINK_DOWN_EXIT_CODE`], so the deployment replaces the instance.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::proto::linkwatch::LinkWatch;
use crate::rails::SysfsRoot;

/// The process exit status after `link_down_exit_s`.
pub const LINK_DOWN_EXIT_CODE: i32 = 75;

/// What runs when the links stayed down: it gets the reason.
pub type LinkDownAction = Box<dyn FnOnce(&str) + Send>;

/// The default action: log the reason and exit the process.
pub fn exit_process() -> LinkDownAction {
    Box::new(|why| {
        tracing::error!("{why}; exiting with status {LINK_DOWN_EXIT_CODE} (link_down_exit_s)");
        eprintln!("kvrail: {why}; exiting (link_down_exit_s)");
        std::process::exit(LINK_DOWN_EXIT_CODE);
    })
}

/// A running link monitor (stopped when dropped).
pub struct LinkMonitor {
    stop: Arc<(Mutex<bool>, Condvar)>,
    fired: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Whether `device:port` is ACTIVE under `root` (an unreadable state counts as down).
fn active(root: &SysfsRoot, dev: &str, port: u8) -> bool {
    root.port_state(dev, port).is_some_and(|s| s == "ACTIVE")
}

impl LinkMonitor {
    /// Watch `links` (device, port) under `root`, reading them every `poll`; run `action`
    /// once when all of them have been down for `exit_after`. With no links it watches
    /// nothing and never fires.
    pub fn start(
        links: Vec<(String, u8)>,
        root: SysfsRoot,
        exit_after: Duration,
        poll: Duration,
        action: LinkDownAction,
    ) -> Self {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let fired = Arc::new(AtomicBool::new(false));
        let (s, f) = (stop.clone(), fired.clone());
        let thread = crate::threads::spawn("kvrail-link-watch", move || {
            let mut w = LinkWatch::new(exit_after);
            let mut action = Some(action);
            loop {
                let up = links.iter().filter(|(d, p)| active(&root, d, *p)).count();
                w.handle_links(up, links.len(), Instant::now());
                if w.poll_exit() {
                    f.store(true, Ordering::Release);
                    let names: Vec<String> =
                        links.iter().map(|(d, p)| format!("{d}:{p}")).collect();
                    let why = format!(
                        "every local link ({}) has been down for {} s",
                        names.join(", "),
                        exit_after.as_secs_f64()
                    );
                    if let Some(a) = action.take() {
                        a(&why);
                    }
                }
                let (m, c) = &*s;
                let g = m.lock().unwrap_or_else(|p| p.into_inner());
                let (g, _) = c
                    .wait_timeout_while(g, poll, |stop| !*stop)
                    .unwrap_or_else(|p| p.into_inner());
                if *g {
                    return;
                }
            }
        })
        .ok();
        Self {
            stop,
            fired,
            thread,
        }
    }

    /// Whether the action ran.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }
}

impl Drop for LinkMonitor {
    fn drop(&mut self) {
        let (m, c) = &*self.stop;
        *m.lock().unwrap_or_else(|p| p.into_inner()) = true;
        c.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A fixture directory of the test's own, removed when the test ends.
    struct Tmp(std::path::PathBuf);

    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tmp(name: &str) -> Tmp {
        let d =
            std::env::temp_dir().join(format!("kvrail-linkwatch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Tmp(d)
    }

    fn set(root: &std::path::Path, dev: &str, state: &str) {
        let d = root.join(format!("sys/class/infiniband/{dev}/ports/1"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("state"), format!("{state}\n")).unwrap();
    }

    /// Real thread, real files: flipping the fixture's port states drives the monitor.
    #[test]
    fn fires_once_only_after_every_link_stayed_down() {
        let dir = tmp("once");
        let root = dir.0.as_path();
        set(root, "mlx5_0", "4: ACTIVE");
        set(root, "mlx5_1", "4: ACTIVE");
        let (tx, rx) = mpsc::channel();
        let m = LinkMonitor::start(
            vec![("mlx5_0".into(), 1), ("mlx5_1".into(), 1)],
            SysfsRoot::new(root),
            Duration::from_millis(300),
            Duration::from_millis(20),
            Box::new(move |why| {
                let _ = tx.send(why.to_owned());
            }),
        );
        set(root, "mlx5_0", "1: DOWN");
        assert!(
            rx.recv_timeout(Duration::from_millis(900)).is_err(),
            "one link is still up"
        );
        set(root, "mlx5_1", "1: DOWN");
        let why = rx.recv_timeout(Duration::from_secs(30)).expect("fired");
        assert!(why.contains("mlx5_0:1, mlx5_1:1"), "{why}");
        assert!(m.fired());
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "once");
    }

    #[test]
    fn a_link_back_in_time_stops_the_clock_and_no_links_never_fire() {
        let dir = tmp("back");
        let root = dir.0.as_path();
        set(root, "rxe0", "1: DOWN");
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        let m = LinkMonitor::start(
            vec![("rxe0".into(), 1)],
            SysfsRoot::new(root),
            Duration::from_secs(600),
            Duration::from_millis(20),
            Box::new(move |w| {
                let _ = tx.send(w.to_owned());
            }),
        );
        std::thread::sleep(Duration::from_millis(100));
        set(root, "rxe0", "4: ACTIVE");
        let none = LinkMonitor::start(
            Vec::new(),
            SysfsRoot::new(root),
            Duration::ZERO,
            Duration::from_millis(10),
            Box::new(move |w| {
                let _ = tx2.send(w.to_owned());
            }),
        );
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        assert!(!m.fired() && !none.fired());
    }
}
