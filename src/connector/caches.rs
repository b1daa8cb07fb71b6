//! `register_kv_caches`: the engine hands the worker its own KV cache — one allocation per
//! layer, or pooled allocations holding several layers at known offsets (a hybrid
//! allocator's) — and the worker registers it in place with the agent. `kv_buffer_device`
//! says what memory that is: `"cpu"` host memory, registered directly; `"rbln"` NPU memory,
//! registered through dma-buf where the rails can, and otherwise moved by copies through
//! the runtime (said once, at warning level, with the reason).

use super::config::KvTransferConfig;
use super::layout::{KvLayout, LayerAt};
use crate::agent::metadata::MemKind;
use crate::agent::{Agent, AgentError, MemRegion, RegionId, RemoteAccess};
use crate::mem::KvBufferDevice;

/// The KV cache a worker moves.
#[derive(Debug, Clone)]
pub enum KvCaches {
    /// kvrail allocates zeroed host memory, one region per layer (demos, tests, and an
    /// engine that fills the cache through the agent).
    Allocate,
    /// The engine's own memory: each [`MemRegion`] holds one layer
    /// ([`MemRegion::layers`]) or several ([`MemRegion::pooled_layers`]); every layer of the
    /// layout must be in exactly one, `layout.layer_bytes()` long. The worker sets the
    /// remote access its role needs.
    Engine(Vec<MemRegion>),
}

impl KvCaches {
    /// The device of the first NPU cache (None: host memory, or kvrail allocates).
    pub fn npu_device(&self) -> Option<i32> {
        match self {
            Self::Engine(rs) => rs
                .iter()
                .find(|m| m.kind() == crate::agent::metadata::MemKind::Npu)
                .map(MemRegion::device_id),
            Self::Allocate => None,
        }
    }
}

fn bad(key: &str, why: String) -> AgentError {
    AgentError::InvalidMemory(format!("{key}: {why}"))
}

/// Register `caches` for `layout` on `agent` with `access` (`fenced`: reachable only
/// through grants): where each layer lies (layout order), and the regions registered.
///
/// # Errors
/// [`AgentError::InvalidMemory`] naming the layer or `kv_buffer_device` when the caches do
/// not match the layout or the configured memory; what registration returns.
pub(crate) fn register(
    agent: &Agent,
    cfg: &KvTransferConfig,
    layout: &KvLayout,
    caches: KvCaches,
    (access, fenced): (RemoteAccess, bool),
) -> Result<(Vec<LayerAt>, Vec<RegionId>), AgentError> {
    let fence = |m: MemRegion| if fenced { m.fenced() } else { m };
    let regions = match caches {
        KvCaches::Allocate => {
            let ids = layout
                .layers
                .iter()
                .map(|l| {
                    let buf = crate::mem::HostBuffer::new(layout.layer_bytes() as usize)
                        .map_err(|e| AgentError::InvalidMemory(e.to_string()))?;
                    let m = MemRegion::host(buf).access(access).layers(vec![l.clone()]);
                    agent.register_memory(fence(m))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let at = ids.iter().map(|&r| LayerAt::whole(r)).collect();
            return Ok((at, ids));
        }
        KvCaches::Engine(regions) => regions,
    };
    // check everything before registering anything
    let mut place: Vec<Option<(usize, u64)>> = vec![None; layout.layers.len()];
    for (k, m) in regions.iter().enumerate() {
        let want = match cfg.buffer_device {
            KvBufferDevice::Cpu => MemKind::Host,
            KvBufferDevice::Rbln => MemKind::Npu,
        };
        if m.kind() != want {
            return Err(bad(
                KvBufferDevice::KEY,
                format!(
                    "{:?} configures {want:?} memory, but cache #{k} is {:?} memory",
                    match cfg.buffer_device {
                        KvBufferDevice::Cpu => "cpu",
                        KvBufferDevice::Rbln => "rbln",
                    },
                    m.kind()
                ),
            ));
        }
        for (name, off, len) in m.layer_spans() {
            let i = layout
                .layers
                .iter()
                .position(|l| *l == name)
                .ok_or_else(|| bad(&name, format!("cache #{k} holds a layer the layout lacks")))?;
            if place[i].is_some() {
                return Err(bad(&name, "the layer is in two caches".into()));
            }
            if len != layout.layer_bytes() {
                return Err(bad(
                    &name,
                    format!(
                        "{len} bytes in cache #{k}, the layout needs {} ({} planes × {} blocks \
                         × {} bytes)",
                        layout.layer_bytes(),
                        layout.planes,
                        layout.num_blocks,
                        layout.block_bytes
                    ),
                ));
            }
            place[i] = Some((k, off));
        }
    }
    if let Some(i) = place.iter().position(Option::is_none) {
        return Err(bad(
            &layout.layers[i],
            "no cache holds this layer of the layout".into(),
        ));
    }
    let mut ids = Vec::with_capacity(regions.len());
    for m in regions {
        match agent.register_memory(fence(m.access(access))) {
            Ok(id) => ids.push(id),
            Err(e) => {
                for id in ids {
                    let _ = agent.deregister(id);
                }
                return Err(e);
            }
        }
    }
    let at = place
        .into_iter()
        .flatten()
        .map(|(k, base)| LayerAt {
            region: ids[k],
            base,
        })
        .collect();
    Ok((at, ids))
}
