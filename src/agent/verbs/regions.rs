//! Registrations on verbs: a region's memory registered on every rail, its keys, and the range keys of grants.

use super::*;

impl Verbs {
    /// Register a region's buffer on every rail: once per port, the keys shared by its lanes
    /// (a second registration of the same pages per lane doubled the pinning work and the
    /// device's translation entries for nothing).
    pub(crate) fn register(&self, region: &Region) -> Result<Vec<Mr>, AgentError> {
        let mut access = Access::LOCAL_WRITE;
        // a fenced region gives no remote access through its own keys: only grants do
        if region.access.read && !region.fenced {
            access = access | Access::REMOTE_READ;
        }
        if region.access.write && !region.fenced {
            access = access | Access::REMOTE_WRITE;
        }
        let Some(buf) = region.host() else {
            // device memory: the NIC cannot reach it without dma-buf, which this agent does
            // not register; the host bounce stages it (see Agent::register_memory)
            return Ok(Vec::new());
        };
        let mut mrs: Vec<Mr> = Vec::with_capacity(self.rails.len());
        for (i, r) in self.rails.iter().enumerate() {
            let mr = match mrs.get(r.first_lane) {
                Some(first) if r.first_lane < i => first.share(),
                _ => Mr::register(&r.pd, buf, access).map_err(verr)?,
            };
            mrs.push(mr);
        }
        Ok(mrs)
    }

    /// Make this backend's per-rail series in `r` (once, at start).
    pub(crate) fn count_into(&self, r: &crate::metrics::Registry, agent: &str) {
        let names: Vec<&str> = self.rails.iter().map(|x| x.name.as_str()).collect();
        let s = RailStats {
            completions: ["progress", "caller"].map(|by| {
                r.counter(
                    "kvrail_completions_total",
                    "Work completions dispatched, by who polled them: the progress thread \
                     (woken by the completion channel) or a waiting caller (progress_spin_us).",
                    &[("agent", agent), ("by", by)],
                )
            }),
            bytes: (names.iter())
                .map(|n| {
                    ["read", "write"].map(|op| {
                        r.counter(
                            "kvrail_rail_bytes_total",
                            "Bytes moved by completed RDMA work requests, by rail and operation.",
                            &[("agent", agent), ("rail", n), ("op", op)],
                        )
                    })
                })
                .collect(),
            failovers: (names.iter())
                .map(|n| {
                    r.counter(
                        "kvrail_rail_failovers_total",
                        "Queue pairs that failed on the path, their work moved to other rails.",
                        &[("agent", agent), ("rail", n)],
                    )
                })
                .collect(),
            rebuilds: (names.iter())
                .map(|n| {
                    r.counter(
                        "kvrail_qp_rebuilds_total",
                        "Dead queue pairs replaced by new ones.",
                        &[("agent", agent), ("rail", n)],
                    )
                })
                .collect(),
        };
        let _ = self.stats.set(s);
    }

    /// A grant's keys over `[offset, offset + len)` of `buf`, one per rail in rail order.
    pub(crate) fn range_keys(
        &self,
        buf: &Arc<crate::mem::HostBuffer>,
        offset: u64,
        len: u64,
        access: crate::agent::region::RemoteAccess,
    ) -> Result<Vec<crate::transport::verbs::RangeKey>, AgentError> {
        let mut a = Access::NONE;
        if access.read {
            a = a | Access::REMOTE_READ;
        }
        if access.write {
            a = a | Access::REMOTE_WRITE;
        }
        self.rails
            .iter()
            .map(|r| {
                crate::transport::verbs::RangeKey::register(
                    &r.pd,
                    buf,
                    offset as usize,
                    len as usize,
                    a,
                )
                .map_err(|e| AgentError::InvalidMemory(format!("grant key on {}: {e}", r.name)))
            })
            .collect()
    }
}
