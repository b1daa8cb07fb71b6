//! The agent's counters and gauges in its [`Registry`] (see [`crate::metrics`]): handles
//! made once at start, bumped on the paths they count.

use std::sync::{Arc, Weak};

use super::{error::XferError, xfer::XferOp, Shared};
use crate::metrics::{Counter, Registry};
use crate::threads::lock;

/// Index of an operation in per-operation arrays.
pub(crate) fn op_index(op: XferOp) -> usize {
    match op {
        XferOp::Read => 0,
        XferOp::Write => 1,
    }
}

const OPS: [&str; 2] = ["read", "write"];

/// The agent's own series.
pub(crate) struct AgentStats {
    pub(crate) registry: Arc<Registry>,
    done: [Counter; 2],
    failed: [Counter; 2],
    /// TCP payload bytes moved by this agent's transfers, per operation.
    pub(crate) tcp_bytes: [Counter; 2],
    pub(crate) notifs_sent: Counter,
    pub(crate) notifs_received: Counter,
    pub(crate) handshake_failures: Counter,
    pub(crate) grants_made: Counter,
    pub(crate) grants_revoked: Counter,
    /// Waits (`Agent::wait`, `Agent::wait_notifs`) by where the answer was found: [0] by
    /// the waiting thread within its polling budget, [1] after it (the sleeping path).
    pub(crate) waits: [Counter; 2],
}

impl AgentStats {
    pub(crate) fn new(agent: &str) -> Self {
        let r = Arc::new(Registry::default());
        let per_op = |name, help, extra: &[(&str, &str)]| {
            OPS.map(|op| {
                let mut l = vec![("agent", agent), ("op", op)];
                l.extend_from_slice(extra);
                r.counter(name, help, &l)
            })
        };
        let one = |name, help| r.counter(name, help, &[("agent", agent)]);
        let xfers = "kvrail_transfers_total";
        let xhelp = "Transfers this agent initiated that ended, by operation and outcome.";
        Self {
            done: per_op(xfers, xhelp, &[("outcome", "done")]),
            failed: per_op(xfers, xhelp, &[("outcome", "failed")]),
            tcp_bytes: per_op(
                "kvrail_tcp_bytes_total",
                "Payload bytes this agent's transfers moved over TCP, by operation.",
                &[],
            ),
            notifs_sent: one(
                "kvrail_notifications_sent_total",
                "Notifications sent with send_notif.",
            ),
            notifs_received: one(
                "kvrail_notifications_received_total",
                "Notifications delivered to the engine.",
            ),
            handshake_failures: one(
                "kvrail_handshake_failures_total",
                "Peers this agent failed to load (refused handshake, bad metadata, unreachable).",
            ),
            grants_made: one(
                "kvrail_grants_made_total",
                "Grants made over fenced memory.",
            ),
            grants_revoked: one("kvrail_grants_revoked_total", "Grants revoked."),
            waits: ["polling", "sleeping"].map(|by| {
                r.counter(
                    "kvrail_waits_total",
                    "Waits for a transfer or a notification, by where the answer was found: \
                     by the waiting thread within progress_spin_us, or on the sleeping path.",
                    &[("agent", agent), ("by", by)],
                )
            }),
            registry: r,
        }
    }

    /// A transfer of `op` ended with `res`.
    pub(crate) fn ended(&self, agent: &str, op: XferOp, res: &Result<(), XferError>) {
        match res {
            Ok(()) => self.done[op_index(op)].inc(),
            Err(e) => {
                self.failed[op_index(op)].inc();
                let fault = format!("{:?}", e.fault()).to_lowercase();
                self.registry
                    .counter(
                        "kvrail_transfer_errors_total",
                        "Transfers that failed, by fault group.",
                        &[("agent", agent), ("fault", &fault)],
                    )
                    .inc();
            }
        }
    }

    /// The counters of transfers sent on each TCP connection to a peer (`conn` "0" the
    /// first; `AgentConfig::tcp_conns`), for `n` connections.
    pub(crate) fn tcp_lanes(&self, agent: &str, n: usize) -> Vec<Counter> {
        (0..n)
            .map(|k| {
                self.registry.counter(
                    "kvrail_tcp_conn_transfers_total",
                    "Transfers sent over TCP, by which of a peer's connections carried them \
                     (0: the first; large ones without a notification spread over all).",
                    &[("agent", agent), ("conn", &k.to_string())],
                )
            })
            .collect()
    }

    /// Series read from the agent's state at scrape time.
    pub(crate) fn watch(&self, shared: &Arc<Shared>) {
        let agent = shared.name.as_str();
        let w: Weak<Shared> = Arc::downgrade(shared);
        let r = &self.registry;
        let read = |f: fn(&Shared) -> f64| {
            let w = w.clone();
            move || w.upgrade().map(|s| f(&s))
        };
        r.gauge_fn(
            "kvrail_peers",
            "Peers loaded.",
            &[("agent", agent)],
            read(|s| lock(&s.peers).len() as f64),
        );
        r.gauge_fn(
            "kvrail_grants_live",
            "Grants made over fenced memory and not revoked.",
            &[("agent", agent)],
            read(|s| lock(&s.grants).made.len() as f64),
        );
        #[cfg(feature = "etcd")]
        if shared.store.is_some() {
            r.gauge_fn(
                "kvrail_metadata_store_up",
                "1 while the metadata store (etcd) answers, 0 while it is down.",
                &[("agent", agent)],
                read(|s| {
                    s.store
                        .as_ref()
                        .map_or(0.0, |st| f64::from(u8::from(st.etcd.is_up())))
                }),
            );
        }
        r.gauge_fn(
            "kvrail_regions",
            "Memory regions registered.",
            &[("agent", agent)],
            read(|s| lock(&s.regions).len() as f64),
        );
        r.counter_fn(
            "kvrail_auth_refusals_total",
            "Side-channel connections refused by the cluster-secret check.",
            &[("agent", agent)],
            read(|s| s.auth_refused.load(std::sync::atomic::Ordering::Relaxed) as f64),
        );
        r.counter_fn(
            "kvrail_protected_refusals_total",
            "Side-channel connections from beyond loopback refused because the agent has no \
             cluster_secret and is not insecure.",
            &[("agent", agent)],
            read(|s| s.open_refused.load(std::sync::atomic::Ordering::Relaxed) as f64),
        );
        r.counter_fn(
            "kvrail_payload_bytes_copied_total",
            "Payload bytes the CPU copied (TCP socket copies, device-memory copies).",
            &[("agent", agent)],
            read(|s| s.copied.load(std::sync::atomic::Ordering::Relaxed) as f64),
        );
        let bounce = |f: fn(&super::bounce::BounceStats) -> f64| {
            let w = w.clone();
            move || {
                let s = w.upgrade()?;
                s.bounce.get().map(|b| f(&b.stats()))
            }
        };
        r.counter_fn(
            "kvrail_bounce_bytes_sent_total",
            "Device-memory bytes the host bounce staged into peers' slots.",
            &[("agent", agent)],
            bounce(|b| b.bytes_sent as f64),
        );
        r.counter_fn(
            "kvrail_bounce_chunks_received_total",
            "Host-bounce chunks received and placed.",
            &[("agent", agent)],
            bounce(|b| b.chunks_received as f64),
        );
        r.gauge_fn(
            "kvrail_bounce_max_in_flight",
            "Most host-bounce chunk WRITEs in flight at once (staging occupancy high-water mark).",
            &[("agent", agent)],
            bounce(|b| b.max_in_flight as f64),
        );
    }
}
