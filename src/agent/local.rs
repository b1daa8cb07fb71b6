//! What the agent's own paths (the host-bounce engine) use of it: its local regions by id,
//! its transfer table's outcomes, its notification queue and its copy counter.
#![cfg_attr(not(feature = "verbs"), allow(dead_code))]

use super::{error::AgentError, error::XferError, region::RegionId, region::RemoteAccess, Agent};

impl Agent {
    /// Local region `id`'s length and remote access.
    pub(crate) fn local_region(&self, id: RegionId) -> Option<(u64, RemoteAccess)> {
        let r = self.shared.region(id.0).ok()?;
        Some((r.len(), r.access))
    }

    /// Copy `out.len()` bytes at `offset` of local region `id` out (device memory through
    /// its runtime).
    pub(crate) fn read_local(
        &self,
        id: RegionId,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), AgentError> {
        self.shared.region(id.0)?.read(offset, out)
    }

    /// Copy `data` into local region `id` at `offset`; `remote` (a peer's WRITE) needs the
    /// region to allow remote WRITE.
    pub(crate) fn write_local(
        &self,
        id: RegionId,
        offset: u64,
        data: &[u8],
        remote: bool,
    ) -> Result<(), AgentError> {
        let r = self.shared.region(id.0)?;
        if remote && !r.access.write {
            return Err(AgentError::InvalidDesc {
                side: "remote",
                index: 0,
                reason: format!("region {} does not allow remote WRITE", id.0),
            });
        }
        r.write(offset, data)
    }

    /// Transfer `id` ended (a no-op unless it is in progress).
    pub(crate) fn finish_xfer(&self, id: u64, res: Result<(), XferError>) {
        self.shared.finish(id, res);
    }

    /// Queue a notification from `from` for the engine.
    pub(crate) fn deliver_user_notif(&self, from: &str, bytes: Vec<u8>) {
        self.shared.deliver_user_notif(from, bytes);
    }

    /// The CPU copied `n` payload bytes of a transfer.
    pub(crate) fn count_payload_copy(&self, n: u64) {
        self.shared.count_copy(n);
    }

    /// The host bounce's counters (verbs backend; `None` on TCP, which moves device memory
    /// by copies through the runtime, no staging).
    pub fn bounce_stats(&self) -> Option<super::bounce::BounceStats> {
        self.shared.bounce.get().map(|b| b.stats())
    }
}
