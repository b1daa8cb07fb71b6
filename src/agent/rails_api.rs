//! What the agent knows of its rails: dma-buf support, links, bytes per rail, a peer's rails.

use super::*;

impl Agent {
    /// Whether each rail's device can register dma-buf memory, probed once when the agent
    /// started (verbs backend; empty on TCP, which never registers device memory).
    pub fn dmabuf_support(&self) -> Vec<crate::mem::NicDmabuf> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.rails.iter().map(|r| r.dmabuf_report()).collect();
        }
        Vec::new()
    }

    /// The local links the agent's rails run on, as (RDMA device, port) (verbs backend;
    /// empty on TCP).
    pub fn local_links(&self) -> Vec<(String, u8)> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            // a rail's name is `device:port`
            return v
                .rails
                .iter()
                .map(|r| {
                    let dev = r.name.rsplit_once(':').map_or(&*r.name, |(d, _)| d);
                    (dev.to_owned(), r.port)
                })
                // a rail's lanes (qps_per_rail) are one link
                .fold(Vec::new(), |mut v, l| {
                    if !v.contains(&l) {
                        v.push(l);
                    }
                    v
                });
        }
        Vec::new()
    }

    /// Bytes moved over each rail since the agent started (verbs backend; empty on TCP).
    pub fn rail_bytes(&self) -> Vec<(String, u64)> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.rail_bytes();
        }
        Vec::new()
    }

    /// The local rails with a working queue pair to `peer` (empty when it is reached over
    /// TCP).
    pub fn peer_rails(&self, peer: &str) -> Vec<String> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.shared.verbs {
            return v.peer_rails(peer);
        }
        let _ = peer;
        Vec::new()
    }
}
