//! The agent's counters and gauges in its [`Registry`] (see [`crate::metrics`]): handles
//! made once at start, bumped on the paths they count.

use std::sync::Arc;

use super::{error::XferError, xfer::XferOp};
use crate::metrics::{Counter, Registry};

/// Index of an operation in per-operation arrays.
pub(crate) fn op_index(op: XferOp) -> usize {
    match op {
        XferOp::Read => 0,
        XferOp::Write => 1,
    }
}

const OPS: [&str; 2] = ["read", "write"];

/// Counters of an agent's host bounce since it started (`Agent::bounce_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BounceStats {
    /// Chunks WRITten into peers' staging slots.
    pub chunks_sent: u64,
    /// Bytes in them.
    pub bytes_sent: u64,
    /// Chunks received and placed (or refused) in local memory.
    pub chunks_received: u64,
    /// Most chunk WRITEs in flight at once (above 1: copies and RDMA overlapped).
    pub max_in_flight: usize,
    /// Bounce messages received that did not parse (dropped, never acted on).
    pub malformed: u64,
}

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
}
