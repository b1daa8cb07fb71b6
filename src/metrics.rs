//! Counters and gauges: one registry per agent (the connector worker on it adds its own),
//! read from Rust ([`Registry::snapshot`]), C and Python (a JSON snapshot), and served in
//! the Prometheus text exposition format ([`Registry::render_prometheus`]; the agent's
//! `metrics_listen` endpoint).
//!
//! Handles ([`Counter`], [`Gauge`]) are made once and updated with one atomic operation,
//! so the data path never looks a series up. Gauges that are cheaper to read than to keep
//! (staging occupancy, live grants) are computed at scrape time ([`Registry::gauge_fn`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;

/// A monotonically increasing count.
#[derive(Clone, Debug, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    /// Add one.
    pub fn inc(&self) {
        self.add(1);
    }

    /// Add `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Clone, Debug, Default)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    /// Set it.
    pub fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }

    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counter or gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
}

/// A value read at scrape time (None: no sample now, e.g. the owner is gone). Called with
/// no lock of the registry held: it may take its owner's locks, and its owner may bump
/// counters (take the registry's lock) while holding them.
type ReadFn = Arc<dyn Fn() -> Option<f64> + Send + Sync>;

enum Value {
    Atomic(Arc<AtomicU64>),
    Read(ReadFn),
}

struct Family {
    help: &'static str,
    kind: Kind,
    /// Label set (sorted pairs) → value.
    series: BTreeMap<Vec<(String, String)>, Value>,
}

/// One sample of a snapshot.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sample {
    /// Metric name (`kvrail_…`).
    pub name: String,
    /// Counter or gauge.
    pub kind: Kind,
    /// Label pairs, sorted by name.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

/// The counters and gauges of one agent (and what runs on it).
#[derive(Default)]
pub struct Registry {
    families: Mutex<BTreeMap<&'static str, Family>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("families", &self.lock().len())
            .finish()
    }
}

fn labels(l: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = l
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    v.sort();
    v
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<&'static str, Family>> {
        self.families.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn atomic(
        &self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        l: &[(&str, &str)],
    ) -> Arc<AtomicU64> {
        let mut f = self.lock();
        let fam = f.entry(name).or_insert_with(|| Family {
            help,
            kind,
            series: BTreeMap::new(),
        });
        let v = fam
            .series
            .entry(labels(l))
            .or_insert_with(|| Value::Atomic(Arc::default()));
        match v {
            Value::Atomic(a) => a.clone(),
            // a read series of that name and labels: a fresh handle nobody reads
            Value::Read(_) => Arc::default(),
        }
    }

    /// The counter `name` with labels `l` (made on first use; the same one after).
    pub fn counter(&self, name: &'static str, help: &'static str, l: &[(&str, &str)]) -> Counter {
        Counter(self.atomic(name, help, Kind::Counter, l))
    }

    /// The gauge `name` with labels `l` (made on first use; the same one after).
    pub fn gauge(&self, name: &'static str, help: &'static str, l: &[(&str, &str)]) -> Gauge {
        Gauge(self.atomic(name, help, Kind::Gauge, l))
    }

    /// A gauge whose value `read` gives at scrape time (replacing one of the same labels).
    pub fn gauge_fn(
        &self,
        name: &'static str,
        help: &'static str,
        l: &[(&str, &str)],
        read: impl Fn() -> Option<f64> + Send + Sync + 'static,
    ) {
        self.read_fn(name, help, Kind::Gauge, l, Arc::new(read));
    }

    /// A counter kept elsewhere, read at scrape time (replacing one of the same labels).
    pub fn counter_fn(
        &self,
        name: &'static str,
        help: &'static str,
        l: &[(&str, &str)],
        read: impl Fn() -> Option<f64> + Send + Sync + 'static,
    ) {
        self.read_fn(name, help, Kind::Counter, l, Arc::new(read));
    }

    fn read_fn(
        &self,
        name: &'static str,
        help: &'static str,
        kind: Kind,
        l: &[(&str, &str)],
        read: ReadFn,
    ) {
        let mut f = self.lock();
        let fam = f.entry(name).or_insert_with(|| Family {
            help,
            kind,
            series: BTreeMap::new(),
        });
        fam.series.insert(labels(l), Value::Read(read));
    }

    /// Every sample now, by name and labels.
    pub fn snapshot(&self) -> Vec<Sample> {
        // the read functions run after the lock is released (see `ReadFn`)
        let mut pending: Vec<(Sample, Option<ReadFn>)> = Vec::new();
        for (name, fam) in self.lock().iter() {
            for (l, v) in &fam.series {
                let (value, read) = match v {
                    Value::Atomic(a) => (a.load(Ordering::Relaxed) as f64, None),
                    Value::Read(r) => (0.0, Some(r.clone())),
                };
                let s = Sample {
                    name: (*name).to_owned(),
                    kind: fam.kind,
                    labels: l.clone(),
                    value,
                };
                pending.push((s, read));
            }
        }
        pending
            .into_iter()
            .filter_map(|(mut s, read)| {
                if let Some(r) = read {
                    s.value = r()?;
                }
                Some(s)
            })
            .collect()
    }

    /// The value of `name` with exactly labels `l`, if it has a sample.
    pub fn value(&self, name: &str, l: &[(&str, &str)]) -> Option<f64> {
        let want = labels(l);
        self.snapshot()
            .into_iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    /// The snapshot as JSON: `[{"name", "kind", "labels": {…}, "value"}, …]`.
    pub fn to_json(&self) -> serde_json::Value {
        let v: Vec<serde_json::Value> = self
            .snapshot()
            .into_iter()
            .map(|s| {
                let labels: serde_json::Map<String, serde_json::Value> = (s.labels.into_iter())
                    .map(|(k, v)| (k, serde_json::Value::String(v)))
                    .collect();
                serde_json::json!({"name": s.name, "kind": s.kind, "labels": labels, "value": s.value})
            })
            .collect();
        serde_json::Value::Array(v)
    }

    /// The Prometheus text exposition format (version 0.0.4): `# HELP`, `# TYPE`, then
    /// one line per series, label values escaped.
    pub fn render_prometheus(&self) -> String {
        let samples = self.snapshot();
        let f = self.lock();
        let mut out = String::new();
        let mut last: Option<&str> = None;
        for s in &samples {
            if last != Some(s.name.as_str()) {
                let help = f.get(s.name.as_str()).map_or("", |fam| fam.help);
                let kind = match s.kind {
                    Kind::Counter => "counter",
                    Kind::Gauge => "gauge",
                };
                let _ = writeln!(out, "# HELP {} {}", s.name, escape_help(help));
                let _ = writeln!(out, "# TYPE {} {kind}", s.name);
                last = Some(s.name.as_str());
            }
            out.push_str(&s.name);
            if !s.labels.is_empty() {
                let l: Vec<String> = (s.labels.iter())
                    .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                    .collect();
                let _ = write!(out, "{{{}}}", l.join(","));
            }
            let _ = writeln!(out, " {}", s.value);
        }
        out
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_shared_and_the_text_format_is_exact() {
        let r = Registry::default();
        let a = r.counter(
            "kvrail_x_total",
            "Things.",
            &[("rail", "rxeA0:1"), ("op", "read")],
        );
        let b = r.counter(
            "kvrail_x_total",
            "Things.",
            &[("op", "read"), ("rail", "rxeA0:1")],
        );
        a.add(3);
        b.inc();
        assert_eq!(a.get(), 4, "one series whatever the label order");
        r.gauge("kvrail_g", "A \"gauge\"\nline two.", &[]).set(7);
        r.gauge_fn("kvrail_f", "Read late.", &[("who", "q\"\\\n")], || {
            Some(1.5)
        });
        r.gauge_fn("kvrail_gone", "No sample.", &[], || None);
        assert_eq!(
            r.render_prometheus(),
            "# HELP kvrail_f Read late.\n# TYPE kvrail_f gauge\nkvrail_f{who=\"q\\\"\\\\\\n\"} 1.5\n\
             # HELP kvrail_g A \"gauge\"\\nline two.\n# TYPE kvrail_g gauge\nkvrail_g 7\n\
             # HELP kvrail_x_total Things.\n# TYPE kvrail_x_total counter\n\
             kvrail_x_total{op=\"read\",rail=\"rxeA0:1\"} 4\n"
        );
        assert_eq!(
            r.value("kvrail_x_total", &[("rail", "rxeA0:1"), ("op", "read")]),
            Some(4.0)
        );
        let j = r.to_json();
        assert_eq!(j[2]["labels"]["rail"], "rxeA0:1");
        assert_eq!(j[2]["kind"], "counter");
    }

    /// A read function may bump the registry's counters (its owner does, under the locks
    /// the function takes): the snapshot runs it with no lock of its own held.
    #[test]
    fn read_functions_run_outside_the_registry_lock() {
        let r = Arc::new(Registry::default());
        let w = Arc::downgrade(&r);
        r.gauge_fn(
            "kvrail_reentrant",
            "Bumps a counter when read.",
            &[],
            move || {
                let r = w.upgrade()?;
                r.counter("kvrail_reads_total", "Reads.", &[]).inc();
                Some(1.0)
            },
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let r2 = r.clone();
        std::thread::spawn(move || {
            let _ = tx.send(r2.snapshot().len());
        });
        let n = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the snapshot deadlocked");
        assert_eq!(n, 1);
        assert_eq!(r.value("kvrail_reads_total", &[]), Some(1.0));
    }
}
