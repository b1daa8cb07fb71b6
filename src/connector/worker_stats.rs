//! A worker's series in its agent's registry (see [`crate::metrics`]), updated once per
//! engine step (`get_finished`) from the worker's own counts.

use crate::metrics::{Counter, Gauge, Registry};

use super::meta::Finished;

/// A counter fed from a running total kept elsewhere.
struct Total {
    c: Counter,
    last: u64,
}

impl Total {
    fn new(c: Counter) -> Self {
        Self { c, last: 0 }
    }

    fn to(&mut self, v: u64) {
        self.c.add(v.saturating_sub(self.last));
        self.last = self.last.max(v);
    }
}

pub(crate) struct WorkerStats {
    leases: Gauge,
    grants: Gauge,
    pub(crate) heartbeats_in: Counter,
    pub(crate) heartbeats_out: Counter,
    /// P, push: registrations matched and written (each D rank's).
    pub(crate) pushed: Counter,
    bytes: Total,
    dropped: Total,
    malformed: Total,
    freed: Counter,
    received: Counter,
    failed: Counter,
}

/// What the worker reports each step.
pub(crate) struct Step<'a> {
    pub(crate) finished: &'a Finished,
    pub(crate) leases: usize,
    pub(crate) grants: usize,
    pub(crate) bytes_posted: u64,
    pub(crate) push_dropped: u64,
    pub(crate) malformed: u64,
}

impl WorkerStats {
    pub(crate) fn new(r: &Registry, agent: &str) -> Self {
        let a = [("agent", agent)];
        let req = |outcome| {
            r.counter(
                "kvrail_connector_requests_total",
                "Requests the worker finished: P's blocks freed (freed), D's KV received \
                 (received) or not (failed).",
                &[("agent", agent), ("outcome", outcome)],
            )
        };
        Self {
            leases: r.gauge(
                "kvrail_connector_leases_held",
                "P: requests whose blocks wait for D under a lease.",
                &a,
            ),
            grants: r.gauge(
                "kvrail_connector_grants_live",
                "Requests whose blocks peers may reach through a grant (fence_blocks).",
                &a,
            ),
            heartbeats_in: r.counter(
                "kvrail_connector_heartbeats_received_total",
                "P: heartbeat messages received from D ranks.",
                &a,
            ),
            heartbeats_out: r.counter(
                "kvrail_connector_heartbeats_sent_total",
                "D: heartbeat messages queued for P ranks.",
                &a,
            ),
            pushed: r.counter(
                "kvrail_connector_push_matches_written_total",
                "P: push registrations matched with a finished prefill and written (per D rank).",
                &a,
            ),
            bytes: Total::new(r.counter(
                "kvrail_connector_kv_bytes_posted_total",
                "KV bytes the worker's READs and WRITEs asked the fabric to move.",
                &a,
            )),
            dropped: Total::new(r.counter(
                "kvrail_connector_push_dropped_total",
                "P: push work dropped after a failed handshake or WRITE.",
                &a,
            )),
            malformed: Total::new(r.counter(
                "kvrail_connector_malformed_messages_total",
                "Connector messages dropped because they did not parse or named another engine.",
                &a,
            )),
            freed: req("freed"),
            received: req("received"),
            failed: req("failed"),
        }
    }

    pub(crate) fn step(&mut self, s: &Step<'_>) {
        self.leases.set(s.leases as u64);
        self.grants.set(s.grants as u64);
        self.bytes.to(s.bytes_posted);
        self.dropped.to(s.push_dropped);
        self.malformed.to(s.malformed);
        self.freed.add(s.finished.sending.len() as u64);
        self.received.add(s.finished.recving.len() as u64);
        self.failed.add(s.finished.failed_recving.len() as u64);
    }
}
