//! The agent's gauges read at scrape time from its state (peers, grants, regions, refusals,
//! the host bounce, the metadata store).

use std::sync::Weak;

use super::*;

impl Shared {
    /// Series read from the agent's state at scrape time.
    pub(super) fn watch_gauges(self: &Arc<Self>) {
        let shared = self;
        let agent = shared.name.as_str();
        let w: Weak<Self> = Arc::downgrade(shared);
        let r = &self.stats.registry;
        let read = |f: fn(&Self) -> f64| {
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
        let bounce = |f: fn(&bounce::BounceStats) -> f64| {
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
