//! `kvrail._kvrail.Scheduler` and `Worker`: the P/D connector's two roles for Python engines
//! (the `kvrail.vllm` connector drives them). Requests cross as (id, prompt tokens,
//! `kv_transfer_params` JSON); the scheduler's metadata for the workers as bytes.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use kvrail::agent::{Agent as Core, AgentConfig};
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::tp::rank_agent_name;
use kvrail::connector::{
    agent_config, placement, ConnectorMetadata, EngineRequest, Finished, KvCaches, KvLayout,
    KvTransferParams, Scheduler as CoreScheduler, Worker as CoreWorker,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn config(json: &str) -> PyResult<KvTransferConfig> {
    KvTransferConfig::from_json(json).map_err(errors::config)
}

/// A request from its id, prompt length and `kv_transfer_params` JSON (None: none).
fn request(id: &str, prompt_tokens: u64, params: Option<&str>) -> PyResult<EngineRequest> {
    let params = params
        .map(|j| {
            KvTransferParams::from_json(j).map_err(|e| errors::misuse("kv_transfer_params", e))
        })
        .transpose()?;
    Ok(EngineRequest {
        request_id: id.to_owned(),
        prompt_tokens,
        params,
    })
}

/// Checks a request's `kv_transfer_params` JSON as the connector reads it: MisuseError naming
/// the key and value of the wrong type (the engine then treats the request as a plain one).
#[pyfunction]
pub(crate) fn check_kv_transfer_params(json: &str) -> PyResult<()> {
    request("check", 0, Some(json)).map(drop)
}

/// The connector's scheduler side (one per engine).
#[pyclass(module = "kvrail._kvrail", frozen)]
pub(crate) struct Scheduler {
    s: Mutex<CoreScheduler>,
}

#[pymethods]
impl Scheduler {
    /// For engine `engine_id` whose rank-0 worker's side channel is `side_channel_addr`
    /// ("ip:port"), from the `kv_transfer_config` JSON (an unknown key raises ConfigError).
    #[new]
    fn new(
        kv_transfer_config: &str,
        engine_id: &str,
        side_channel_addr: &str,
        tp_size: u32,
    ) -> PyResult<Self> {
        let cfg = config(kv_transfer_config)?;
        let addr = side_channel_addr.parse().map_err(|e| {
            errors::misuse("side_channel_addr", format!("{side_channel_addr:?}: {e}"))
        })?;
        Ok(Self {
            s: Mutex::new(CoreScheduler::new(cfg, engine_id, addr, tp_size.max(1))),
        })
    }

    /// A request entered the scheduler: a remote prefill's heartbeats start now. Returns
    /// whether it is tracked.
    #[pyo3(signature = (request_id, prompt_tokens, params = None))]
    fn on_new_request(
        &self,
        request_id: &str,
        prompt_tokens: u64,
        params: Option<&str>,
    ) -> PyResult<bool> {
        let r = request(request_id, prompt_tokens, params)?;
        Ok(lock(&self.s).on_new_request(&r, Instant::now()))
    }

    /// (tokens the connector loads beyond `num_computed`, whether asynchronously).
    #[pyo3(signature = (request_id, prompt_tokens, params, num_computed))]
    fn get_num_new_matched_tokens(
        &self,
        request_id: &str,
        prompt_tokens: u64,
        params: Option<&str>,
        num_computed: u64,
    ) -> PyResult<(u64, bool)> {
        let r = request(request_id, prompt_tokens, params)?;
        Ok(lock(&self.s).get_num_new_matched_tokens(&r, num_computed, Instant::now()))
    }

    /// Blocks were allocated for a request; with external tokens the workers receive there.
    #[pyo3(signature = (request_id, prompt_tokens, params, block_ids, num_external_tokens))]
    fn update_state_after_alloc(
        &self,
        request_id: &str,
        prompt_tokens: u64,
        params: Option<&str>,
        block_ids: Vec<u64>,
        num_external_tokens: u64,
    ) -> PyResult<()> {
        let r = request(request_id, prompt_tokens, params)?;
        lock(&self.s).update_state_after_alloc(&r, block_ids, num_external_tokens, Instant::now());
        Ok(())
    }

    /// P with push_stream: after a prefill step, `computed` prompt tokens are in `block_ids`.
    #[pyo3(signature = (request_id, prompt_tokens, params, block_ids, computed))]
    fn prefill_progress(
        &self,
        request_id: &str,
        prompt_tokens: u64,
        params: Option<&str>,
        block_ids: Vec<u64>,
        computed: u64,
    ) -> PyResult<()> {
        let r = request(request_id, prompt_tokens, params)?;
        lock(&self.s).prefill_progress(&r, &block_ids, computed);
        Ok(())
    }

    /// This step's metadata for the workers (bytes for `Worker.start_load_kv`).
    fn build_connector_meta<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let m = lock(&self.s).build_connector_meta(Instant::now());
        PyBytes::new(py, &m.encode())
    }

    /// A request finished: (whether its blocks stay allocated for D, the transfer
    /// parameters for D as JSON or None). `completed`: it ran to its end (not aborted);
    /// `computed_tokens`: tokens whose KV its blocks hold. With `bidirectional_kv_xfer`, D
    /// keeps such a decode leg's blocks for the next turn and returns its parameters.
    #[pyo3(signature = (request_id, prompt_tokens, params, block_ids, completed=false, computed_tokens=0))]
    fn request_finished(
        &self,
        request_id: &str,
        prompt_tokens: u64,
        params: Option<&str>,
        block_ids: Vec<u64>,
        completed: bool,
        computed_tokens: u64,
    ) -> PyResult<(bool, Option<String>)> {
        let r = request(request_id, prompt_tokens, params)?;
        let end = kvrail::connector::RequestEnd {
            completed,
            computed_tokens,
        };
        let (delay, p) = lock(&self.s).request_finished_as(&r, &block_ids, end);
        let p = p
            .map(|p| serde_json::to_string(&p))
            .transpose()
            .map_err(|e| errors::misuse("kv_transfer_params", e))?;
        Ok((delay, p))
    }

    /// The workers' report, merged over ranks: requests sent, received, failed to receive.
    fn update_connector_output(
        &self,
        sending: Vec<String>,
        recving: Vec<String>,
        failed_recving: Vec<String>,
    ) {
        lock(&self.s).update_connector_output(&Finished {
            sending,
            recving,
            failed_recving,
        });
    }

    /// P with TP above 1: each rank's side-channel port.
    fn set_rank_ports(&self, ports: Vec<u16>) {
        lock(&self.s).set_rank_ports(ports);
    }

    /// Whether push work is under way (the engine keeps stepping while it is).
    fn has_pending_push_work(&self) -> bool {
        lock(&self.s).has_pending_push_work()
    }

    /// Requests with heartbeats running.
    fn heartbeating(&self) -> usize {
        lock(&self.s).heartbeating()
    }

    /// P: requests whose blocks wait for D.
    fn held(&self) -> usize {
        lock(&self.s).held()
    }
}

/// One KV cache allocation of the engine: (address, bytes, memory type, device, layer
/// names, offsets of pooled layers or None, bytes of one pooled layer).
type CacheSpec = (u64, u64, String, i32, Vec<String>, Option<Vec<u64>>, u64);

/// The connector's worker side (one per TP rank), over the engine's own KV cache.
#[pyclass(module = "kvrail._kvrail", frozen)]
pub(crate) struct Worker {
    w: Arc<Mutex<CoreWorker>>,
    agent: Arc<Core>,
}

/// How long the service thread sleeps at most between two looks (leases, grant
/// timeouts and withdrawals come due without a notification).
const SERVE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Serve `w` while the engine idles (no steps call `get_finished`): woken by every
/// notification, and every [`SERVE_EVERY`]; ends when the worker is dropped.
fn serve_while_idle(w: std::sync::Weak<Mutex<CoreWorker>>, agent: Arc<Core>) {
    let spawned = kvrail::threads::spawn(format!("kvrail-serve-{}", agent.name()), move || loop {
        agent.wait_for_notifs(SERVE_EVERY);
        let Some(w) = w.upgrade() else { return };
        lock(&w).serve(Instant::now());
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no service thread: the worker is served by engine steps only");
    }
}

impl Worker {
    #[allow(unsafe_code)] // the engine's memory, by address
    fn caches(specs: Vec<CacheSpec>) -> PyResult<KvCaches> {
        if specs.is_empty() {
            return Ok(KvCaches::Allocate);
        }
        let mut out = Vec::with_capacity(specs.len());
        for (i, (addr, len, kind, dev, layers, offsets, layer_len)) in specs.into_iter().enumerate()
        {
            if layers.is_empty() {
                return Err(errors::misuse(
                    &format!("caches[{i}].layers"),
                    "none (name the layers it holds)",
                ));
            }
            // SAFETY: the caller's promise (kvrail.vllm keeps the engine's tensors referenced
            // while the worker lives): memory of that kind, allocated while registered.
            let m = unsafe { crate::raw::region(addr, len, &kind, dev) }.map_err(|e| {
                Python::with_gil(|py| {
                    errors::MisuseError::new_err(format!("caches[{i}]: {}", e.value(py)))
                })
            })?;
            out.push(match offsets {
                None => m.layers(layers),
                Some(o) => {
                    if o.len() != layers.len() {
                        return Err(errors::misuse(
                            &format!("caches[{i}].offsets"),
                            format!("{} offsets for {} layers", o.len(), layers.len()),
                        ));
                    }
                    m.pooled_layers(layers.into_iter().zip(o).collect(), layer_len)
                }
            });
        }
        Ok(KvCaches::Engine(out))
    }
}

#[pymethods]
impl Worker {
    /// TP rank `tp_rank` of `tp_size` of engine `engine_id`: its agent (`agent_config_json`
    /// as for `kvrail.Agent`), the `kv_transfer_config` JSON, the KV layout JSON
    /// (`{"layers", "num_blocks", "block_bytes", "planes", "block_size", "kv_heads"}`), and
    /// the engine's caches registered in place (empty: kvrail allocates them).
    #[new]
    #[pyo3(signature = (engine_id, agent_config_json, kv_transfer_config, layout_json, tp_rank, tp_size, caches))]
    #[allow(clippy::too_many_arguments)] // the constructor's arguments, as in the C ABI
    fn new(
        py: Python<'_>,
        engine_id: &str,
        agent_config_json: Option<&str>,
        kv_transfer_config: &str,
        layout_json: &str,
        tp_rank: u32,
        tp_size: u32,
        caches: Vec<CacheSpec>,
    ) -> PyResult<Self> {
        let cfg = config(kv_transfer_config)?;
        let layout: KvLayout = serde_json::from_str(layout_json)
            .map_err(|e| e.to_string())
            .and_then(|l: KvLayout| l.validate().map(|()| l).map_err(|e| e.to_string()))
            .map_err(|e| errors::ConfigError::new_err(format!("layout: {e}")))?;
        let base =
            AgentConfig::from_json(agent_config_json.unwrap_or("")).map_err(errors::config)?;
        let caches = Self::caches(caches)?;
        // the rails of the NPU's NUMA node (runtime, else rbln-smi and sysfs)
        let ac = placement::for_caches(agent_config(&cfg, &layout, base), &caches);
        let name = rank_agent_name(engine_id, tp_rank);
        let (w, agent) = py
            .allow_threads(move || -> Result<_, kvrail::agent::AgentError> {
                let agent = Arc::new(Core::new(&name, ac)?);
                let w = CoreWorker::with_caches(
                    agent.clone(),
                    cfg,
                    layout,
                    (tp_rank, tp_size.max(1)),
                    caches,
                )?;
                Ok((w, agent))
            })
            .map_err(errors::agent)?;
        let w = Arc::new(Mutex::new(w));
        serve_while_idle(Arc::downgrade(&w), agent.clone());
        Ok(Self { w, agent })
    }

    /// "ip:port" of this rank's side channel (P's rank 0 goes in the transfer parameters).
    #[getter]
    fn side_channel_addr(&self) -> String {
        self.agent.side_channel_addr().to_string()
    }

    /// "verbs" or "tcp".
    #[getter]
    fn backend(&self) -> &'static str {
        match self.agent.metadata().backend {
            kvrail::agent::metadata::BackendKind::Verbs => "verbs",
            _ => "tcp",
        }
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> String {
        self.agent.name().to_owned()
    }

    /// Start this step's work from the scheduler's metadata (bytes). Returns the requests
    /// this step starts receiving, with their blocks: (request id, block ids).
    fn start_load_kv(&self, py: Python<'_>, meta: &[u8]) -> PyResult<Vec<(String, Vec<u64>)>> {
        let m = ConnectorMetadata::decode(meta).map_err(|e| errors::misuse("meta", e))?;
        let recv = m
            .reqs_to_recv
            .iter()
            .map(|r| (r.request_id.clone(), r.local_block_ids.clone()))
            .collect();
        py.allow_threads(|| lock(&self.w).start_load_kv(&m, Instant::now()));
        Ok(recv)
    }

    /// Wait until `layer`'s KV is loaded (loads are whole-request: returns at once).
    fn wait_for_layer_load(&self, layer: &str) {
        lock(&self.w).wait_for_layer_load(layer);
    }

    /// `layer`'s KV was computed (saves happen when the request finishes: nothing to do).
    fn save_kv_layer(&self, layer: &str) {
        lock(&self.w).save_kv_layer(layer);
    }

    /// Wait for this step's saves (none are asynchronous).
    fn wait_for_save(&self) {
        lock(&self.w).wait_for_save();
    }

    /// (sent, received, failed to receive) request ids since the last call.
    fn get_finished(&self, py: Python<'_>) -> (Vec<String>, Vec<String>, Vec<String>) {
        let f = py.allow_threads(|| lock(&self.w).get_finished(Instant::now()));
        (f.sending, f.recving, f.failed_recving)
    }

    /// P: requests whose blocks are held under a lease.
    fn leased(&self) -> usize {
        lock(&self.w).leased()
    }

    /// Bytes of the transfers this worker posted.
    fn bytes_posted(&self) -> u64 {
        lock(&self.w).bytes_posted()
    }

    /// Push registrations or WRITEs dropped.
    fn push_dropped(&self) -> u64 {
        lock(&self.w).push_dropped()
    }

    /// Malformed notifications dropped.
    fn malformed(&self) -> u64 {
        lock(&self.w).malformed
    }

    /// Read-backs declined: the keeper's blocks expire before the READ would end.
    fn expired_reads(&self) -> u64 {
        lock(&self.w).expired_reads
    }

    /// Read-backs done: a previous turn's KV reused.
    fn read_backs(&self) -> u64 {
        lock(&self.w).read_backs
    }

    /// Leases that ran out before their peer finished.
    fn leases_expired(&self) -> u64 {
        lock(&self.w).leases_expired
    }

    /// Payload bytes kvrail copied on the host.
    fn payload_bytes_copied(&self) -> u64 {
        self.agent.payload_bytes_copied()
    }

    /// The worker's and its agent's counters and gauges, as JSON text.
    fn metrics_json(&self) -> String {
        self.agent.metrics().to_json().to_string()
    }
}
