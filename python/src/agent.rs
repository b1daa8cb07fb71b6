//! `kvrail._kvrail.Agent`: the library's agent for Python, addressed the way NIXL is — by
//! (address, length) in registered memory — rather than by region and offset.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvrail::agent::metadata::BackendKind;
use kvrail::agent::{
    Agent as Core, AgentConfig, Desc, RegionId, RemoteAccess, XferId, XferOp, XferStatus,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors;

/// A local registration: where it is, and its region.
#[derive(Clone, Copy)]
struct Span {
    addr: u64,
    len: u64,
    region: RegionId,
}

/// The region of `spans` that holds `[addr, addr + len)`, as a descriptor.
fn find(spans: &[Span], addr: u64, len: u64) -> Option<Desc> {
    // spans are sorted by address and do not overlap (the agent refuses overlaps)
    let i = spans.partition_point(|s| s.addr <= addr).checked_sub(1)?;
    let s = spans[i];
    let end = addr.checked_add(len)?;
    (end <= s.addr + s.len).then(|| Desc::new(s.region, addr - s.addr, len))
}

/// `list` as descriptors in `spans` (the memory `owner` registered), or the first that is
/// not inside it, named by `side` and index.
fn place(spans: &[Span], list: &[(u64, u64)], side: &str, owner: &str) -> PyResult<Vec<Desc>> {
    list.iter()
        .enumerate()
        .map(|(i, &(a, n))| {
            find(spans, a, n).ok_or_else(|| {
                errors::misuse(
                    side,
                    format!(
                        "descriptor #{i} [{a:#x}, +{n}) is not inside memory {owner} registered"
                    ),
                )
            })
        })
        .collect()
}

/// "ip:port" as a socket address (a host name is resolved).
fn sock(addr: &str) -> PyResult<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map_err(|e| errors::misuse("addr", format!("{addr:?}: {e}")))?
        .next()
        .ok_or_else(|| errors::misuse("addr", format!("{addr:?}: no address")))
}

fn op(s: &str) -> PyResult<XferOp> {
    match s {
        "WRITE" => Ok(XferOp::Write),
        "READ" => Ok(XferOp::Read),
        o => Err(errors::misuse(
            "op",
            format!("{o:?}: use \"READ\" or \"WRITE\""),
        )),
    }
}

/// A kvrail agent: registers the caller's memory, exchanges metadata with peers, moves
/// descriptor lists by one-sided READ and WRITE, sends and receives notifications.
#[pyclass(module = "kvrail._kvrail", frozen)]
pub(crate) struct Agent {
    core: Arc<Core>,
    spans: Mutex<Vec<Span>>,
}

impl Agent {
    fn spans(&self) -> std::sync::MutexGuard<'_, Vec<Span>> {
        self.spans.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Descriptors of `list` in local registered memory, and in `peer`'s.
    fn descs(
        &self,
        peer: &str,
        local: &[(u64, u64)],
        remote: &[(u64, u64)],
    ) -> PyResult<(Vec<Desc>, Vec<Desc>)> {
        let l = place(&self.spans(), local, "local", "this agent")?;
        let meta = self
            .core
            .remote_metadata(peer)
            .ok_or_else(|| errors::agent(kvrail::agent::AgentError::UnknownPeer(peer.into())))?;
        let mut theirs: Vec<Span> = meta
            .regions
            .iter()
            .map(|r| Span {
                addr: r.addr,
                len: r.len,
                region: RegionId(r.id),
            })
            .collect();
        theirs.sort_unstable_by_key(|s| s.addr);
        let r = place(&theirs, remote, "remote", peer)?;
        Ok((l, r))
    }
}

fn status_str(s: &XferStatus) -> &'static str {
    match s {
        XferStatus::Done => "DONE",
        XferStatus::InProgress => "PROC",
        XferStatus::Error(_) => "ERR",
        _ => "NOT_POSTED",
    }
}

#[pymethods]
impl Agent {
    /// Create an agent called `name`; `config_json` is a JSON object of agent keys (see
    /// `kvrail.AgentConfig` keys in the package docs); an unknown key raises ConfigError.
    #[new]
    #[pyo3(signature = (name, config_json = None))]
    fn new(py: Python<'_>, name: &str, config_json: Option<&str>) -> PyResult<Self> {
        let cfg = AgentConfig::from_json(config_json.unwrap_or("")).map_err(errors::config)?;
        let core = py
            .allow_threads(|| Core::new(name, cfg))
            .map_err(errors::agent)?;
        Ok(Self {
            core: Arc::new(core),
            spans: Mutex::new(Vec::new()),
        })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        self.core.name()
    }

    /// "verbs" or "tcp": the data path this agent uses.
    #[getter]
    fn backend(&self) -> &'static str {
        match self.core.metadata().backend {
            BackendKind::Verbs => "verbs",
            _ => "tcp",
        }
    }

    /// "ip:port" of the side channel peers load metadata from.
    #[getter]
    fn side_channel_addr(&self) -> String {
        self.core.side_channel_addr().to_string()
    }

    /// Register `length` bytes at `addr` in place: `mem_type` "DRAM" (host memory) or "VRAM"
    /// (NPU memory of device `dev_id`, through the RBLN runtime). Peers may READ and WRITE it.
    /// The memory must stay allocated until `deregister`; the caller (the Python layer
    /// keeps the owning object alive) promises that. Returns the region id.
    #[pyo3(signature = (addr, length, mem_type = "DRAM", dev_id = 0))]
    #[allow(unsafe_code)] // the one unsafe call of the glue: Python's memory, by address
    fn register(&self, addr: u64, length: u64, mem_type: &str, dev_id: i32) -> PyResult<u32> {
        // SAFETY: the caller's promise, stated above and kept by the Python layer, which
        // holds the owning object until deregistration.
        let m = unsafe { crate::raw::region(addr, length, mem_type, dev_id) }?;
        let id = self
            .core
            .register_memory(m.access(RemoteAccess::READ_WRITE))
            .map_err(errors::agent)?;
        let mut spans = self.spans();
        let at = spans.partition_point(|s| s.addr < addr);
        spans.insert(
            at,
            Span {
                addr,
                len: length,
                region: id,
            },
        );
        Ok(id.0)
    }

    /// Deregister a region (refused while a transfer uses it).
    fn deregister(&self, region: u32) -> PyResult<()> {
        self.core
            .deregister_memory(RegionId(region))
            .map_err(errors::agent)?;
        self.spans().retain(|s| s.region.0 != region);
        Ok(())
    }

    /// This agent's metadata (bytes to hand to a peer's `load_remote`).
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let m = self
            .core
            .metadata()
            .encode()
            .map_err(|e| errors::PeerError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &m))
    }

    /// Load a peer's metadata (bytes from its `metadata()`), check the handshake and
    /// connect. Returns the peer's name.
    fn load_remote(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<String> {
        let bytes = metadata.to_vec();
        let core = self.core.clone();
        py.allow_threads(move || core.load_remote_metadata(&bytes, None))
            .map_err(errors::agent)
    }

    /// Load a peer's metadata from its side channel at "ip:port". Returns its name.
    fn load_remote_addr(&self, py: Python<'_>, addr: &str) -> PyResult<String> {
        let a = sock(addr)?;
        let core = self.core.clone();
        py.allow_threads(move || core.load_remote(a))
            .map_err(errors::agent)
    }

    /// Load peer `name` by its name from the metadata store (config `metadata_store`); the
    /// store's watch then follows it (gone: invalidated; restarted: loaded again). Returns
    /// its name.
    fn load_by_name(&self, py: Python<'_>, name: &str) -> PyResult<String> {
        let (core, name) = (self.core.clone(), name.to_owned());
        py.allow_threads(move || core.load_by_name(&name))
            .map_err(errors::agent)
    }

    /// This agent's metadata naming only the regions that hold the (addr, len) ranges
    /// (NIXL's partial metadata; none: the connection details alone).
    fn partial_metadata<'py>(
        &self,
        py: Python<'py>,
        ranges: Vec<(u64, u64)>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let m = self
            .core
            .partial_metadata(&ranges)
            .map_err(errors::agent)?
            .encode()
            .map_err(|e| errors::PeerError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &m))
    }

    /// Load partial metadata: its regions are added to what is known of the peer; an
    /// unknown peer is connected only when `connect_unknown`. Returns its name.
    fn load_partial(
        &self,
        py: Python<'_>,
        metadata: &[u8],
        connect_unknown: bool,
    ) -> PyResult<String> {
        let bytes = metadata.to_vec();
        let core = self.core.clone();
        py.allow_threads(move || core.load_partial_metadata(&bytes, connect_unknown))
            .map_err(errors::agent)
    }

    /// Whether `peer`'s loaded metadata holds every (addr, len) range.
    fn covers(&self, peer: &str, ranges: Vec<(u64, u64)>) -> bool {
        self.core.remote_covers(peer, &ranges)
    }

    /// Send this agent's metadata (or `partial`, from `partial_metadata`) to the agent
    /// listening at "ip:port", which loads it and connects back (it needs
    /// `accept_sent_metadata`). Returns the name it answered with.
    #[pyo3(signature = (addr, partial = None))]
    fn send_metadata(
        &self,
        py: Python<'_>,
        addr: &str,
        partial: Option<&[u8]>,
    ) -> PyResult<String> {
        let a = sock(addr)?;
        let partial = partial
            .map(kvrail::agent::metadata::AgentMetadata::decode)
            .transpose()
            .map_err(|e| errors::misuse("partial", e.to_string()))?;
        let core = self.core.clone();
        py.allow_threads(move || core.send_metadata(a, partial))
            .map_err(errors::agent)
    }

    /// Tell the agent listening at "ip:port" to forget this one.
    fn send_invalidate(&self, py: Python<'_>, addr: &str) -> PyResult<()> {
        let a = sock(addr)?;
        let core = self.core.clone();
        py.allow_threads(move || core.send_forget(a))
            .map_err(errors::agent)
    }

    /// Write this agent's metadata to the metadata store now.
    fn publish_metadata(&self) {
        self.core.publish_metadata();
    }

    /// Take this agent's metadata and labels out of the metadata store (peers following it
    /// forget it; `publish_metadata` puts it back).
    fn unpublish_metadata(&self, py: Python<'_>) -> PyResult<()> {
        let core = self.core.clone();
        py.allow_threads(move || core.unpublish_metadata())
            .map_err(errors::agent)
    }

    /// Publish partial metadata (from `partial_metadata`) in the metadata store under
    /// `label`.
    fn publish_partial(&self, py: Python<'_>, label: &str, partial: &[u8]) -> PyResult<()> {
        let meta = kvrail::agent::metadata::AgentMetadata::decode(partial)
            .map_err(|e| errors::misuse("partial", e.to_string()))?;
        let (core, label) = (self.core.clone(), label.to_owned());
        py.allow_threads(move || core.publish_partial(&label, &meta))
            .map_err(errors::agent)
    }

    /// Load the partial metadata peer `name` published under `label` in the metadata
    /// store. Returns its name.
    fn load_label(&self, py: Python<'_>, name: &str, label: &str) -> PyResult<String> {
        let (core, name, label) = (self.core.clone(), name.to_owned(), label.to_owned());
        py.allow_threads(move || core.load_label(&name, &label))
            .map_err(errors::agent)
    }

    /// Whether the metadata store answers (None: no store configured).
    fn store_up(&self) -> Option<bool> {
        self.core.store_up()
    }

    /// Whether `peer`'s metadata is loaded.
    fn has_peer(&self, peer: &str) -> bool {
        self.core.remote_metadata(peer).is_some()
    }

    /// The peers whose metadata is loaded.
    fn peers(&self) -> Vec<String> {
        self.core.peers()
    }

    /// Forget a peer: its connection closes, its transfers fail.
    fn invalidate(&self, peer: &str) -> PyResult<()> {
        self.core.invalidate(peer).map_err(errors::agent)
    }

    /// Create a transfer of `op` ("READ"/"WRITE") between `local` and `peer`'s `remote`
    /// (lists of (addr, len), equal counts and sizes), with an optional notification the
    /// peer gets after every byte landed. Nothing moves until `post`. Returns its id.
    #[pyo3(signature = (op_name, local, peer, remote, notif = None))]
    fn create_xfer(
        &self,
        op_name: &str,
        local: Vec<(u64, u64)>,
        peer: &str,
        remote: Vec<(u64, u64)>,
        notif: Option<Vec<u8>>,
    ) -> PyResult<u64> {
        let op = op(op_name)?;
        let (l, r) = self.descs(peer, &local, &remote)?;
        self.core
            .create_xfer(op, l, peer, r, notif)
            .map(|x| x.0)
            .map_err(errors::agent)
    }

    /// Replace the notification the transfer sends when it next completes (None: none).
    #[pyo3(signature = (xfer, notif = None))]
    fn set_notif(&self, xfer: u64, notif: Option<Vec<u8>>) -> PyResult<()> {
        self.core
            .set_notif(XferId(xfer), notif)
            .map_err(errors::agent)
    }

    /// Post a transfer (again, once it is no longer in progress).
    fn post(&self, py: Python<'_>, xfer: u64) -> PyResult<()> {
        let core = self.core.clone();
        py.allow_threads(move || core.post(XferId(xfer)))
            .map_err(errors::agent)
    }

    /// "DONE", "PROC", "ERR" or "NOT_POSTED".
    fn status(&self, xfer: u64) -> PyResult<&'static str> {
        self.core
            .status(XferId(xfer))
            .map(|s| status_str(&s))
            .map_err(errors::agent)
    }

    /// Why the transfer failed, as its exception (None unless its status is "ERR").
    fn error(&self, xfer: u64) -> PyResult<Option<PyErr>> {
        Ok(
            match self.core.status(XferId(xfer)).map_err(errors::agent)? {
                XferStatus::Error(e) => Some(errors::xfer(&e)),
                _ => None,
            },
        )
    }

    /// Sleep (without the GIL) until the transfer is no longer in progress or `timeout_s`
    /// passed; returns its status string then.
    fn wait(&self, py: Python<'_>, xfer: u64, timeout_s: f64) -> PyResult<&'static str> {
        let core = self.core.clone();
        let t = Duration::from_secs_f64(timeout_s.max(0.0));
        py.allow_threads(move || core.wait(XferId(xfer), t))
            .map(|s| status_str(&s))
            .map_err(errors::agent)
    }

    /// Release a transfer that is not in progress.
    fn release(&self, xfer: u64) -> PyResult<()> {
        self.core.release(XferId(xfer)).map_err(errors::agent)
    }

    /// Send a notification to a peer (peers receive them in order).
    fn send_notif(&self, py: Python<'_>, peer: &str, msg: Vec<u8>) -> PyResult<()> {
        let core = self.core.clone();
        let peer = peer.to_owned();
        py.allow_threads(move || core.send_notif(&peer, msg))
            .map_err(errors::agent)
    }

    /// The notifications that arrived since the last call: a list of (peer, bytes).
    fn get_new_notifs<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        self.core
            .get_new_notifs()
            .into_iter()
            .map(|(p, m)| (p, PyBytes::new(py, &m)))
            .collect()
    }

    /// Like `get_new_notifs`, but sleeps (without the GIL) up to `timeout_s` for the first.
    fn wait_notifs<'py>(
        &self,
        py: Python<'py>,
        timeout_s: f64,
    ) -> Vec<(String, Bound<'py, PyBytes>)> {
        let core = self.core.clone();
        let t = Duration::from_secs_f64(timeout_s.max(0.0));
        py.allow_threads(move || core.wait_notifs(t))
            .into_iter()
            .map(|(p, m)| (p, PyBytes::new(py, &m)))
            .collect()
    }

    /// Payload bytes kvrail copied on the host (0 for host memory on verbs).
    fn payload_bytes_copied(&self) -> u64 {
        self.core.payload_bytes_copied()
    }

    /// (rail, bytes completed on it) for every rail (empty on TCP).
    fn rail_bytes(&self) -> Vec<(String, u64)> {
        self.core.rail_bytes()
    }

    /// Every counter and gauge now, as JSON text (a list of {name, kind, labels, value}).
    fn metrics_json(&self) -> String {
        self.core.metrics().to_json().to_string()
    }

    /// The same in the Prometheus text exposition format.
    fn metrics_prometheus(&self) -> String {
        self.core.metrics().render_prometheus()
    }
}
