//! A tiny test runner for the lab suites (harness = false): runs named cases, catches
//! panics, prints one line per case and a closing `N passed, N failed` line that CI reads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A case that runs longer than this is reported as hung and the suite exits with failure
/// (a hang must be bounded and explained, not wait for the VM's timeout).
const CASE_LIMIT: Duration = Duration::from_secs(300);

pub struct Runner {
    suite: &'static str,
    filters: Vec<String>,
    passed: usize,
    failed: Vec<String>,
    skipped: usize,
}

impl Runner {
    /// Filters are the non-flag command-line arguments (as `cargo test NAME` passes them).
    pub fn new(suite: &'static str) -> Self {
        let filters = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        Self {
            suite,
            filters,
            passed: 0,
            failed: Vec::new(),
            skipped: 0,
        }
    }

    fn selected(&self, name: &str) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| name.contains(f.as_str()))
    }

    /// Run one case.
    pub fn run(&mut self, name: &str, f: impl FnOnce() -> Result<(), String>) {
        if !self.selected(name) {
            return;
        }
        let t = Instant::now();
        let (done, watch) = mpsc::channel::<()>();
        let case = name.to_owned();
        let suite = self.suite;
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = watch.recv_timeout(CASE_LIMIT) {
                println!(
                    "test {case} ... FAILED: HUNG for more than {} s; aborting the suite",
                    CASE_LIMIT.as_secs()
                );
                println!("\n{suite}: 0 passed, 1 failed (hang)");
                std::process::exit(2);
            }
        });
        let res = catch_unwind(AssertUnwindSafe(f));
        let _ = done.send(());
        let secs = t.elapsed().as_secs_f64();
        match res {
            Ok(Ok(())) => {
                println!("test {name} ... ok ({secs:.2} s)");
                self.passed += 1;
            }
            Ok(Err(e)) => {
                println!("test {name} ... FAILED ({secs:.2} s)\n    {e}");
                self.failed.push(name.to_owned());
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                println!("test {name} ... FAILED (panicked after {secs:.2} s)\n    {msg}");
                self.failed.push(name.to_owned());
            }
        }
    }

    /// Count a case as skipped (with the reason printed once by the caller).
    pub fn skip(&mut self, name: &str) {
        if self.selected(name) {
            println!("test {name} ... SKIPPED");
            self.skipped += 1;
        }
    }

    /// Print the summary and exit with 1 when anything failed.
    pub fn finish(self) -> ! {
        if !self.failed.is_empty() {
            println!("\nfailures:");
            for f in &self.failed {
                println!("    {f}");
            }
        }
        println!();
        let skipped = if self.skipped > 0 {
            format!(", {} skipped", self.skipped)
        } else {
            String::new()
        };
        println!(
            "{}: {} passed, {} failed{skipped}",
            self.suite,
            self.passed,
            self.failed.len()
        );
        std::process::exit(if self.failed.is_empty() { 0 } else { 1 })
    }
}
