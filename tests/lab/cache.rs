//! An engine's own KV cache for the connector suites: memory the test engine allocates
//! (host or NPU memory of kvrail's RBLN test runtime; one allocation per layer, or one
//! pooled allocation holding every layer at offsets with gaps between them) and hands to
//! `Worker::with_caches`. The engine writes its KV and checks what landed through its own
//! handles — never through the agent.

use std::sync::Arc;

use kvrail::agent::{MemRegion, RegionId};
use kvrail::connector::{KvCaches, KvLayout, Worker};
use kvrail::mem::{DeviceMemory, HostBuffer, NpuMemory};
use rbln_sys::RblnLib;

/// Where the engine's KV cache lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// kvrail allocates it (the engine goes through the agent's copies).
    Agent,
    /// Host memory, one allocation per layer.
    Host,
    /// Host memory, one pooled allocation for every layer.
    HostPooled,
    /// NPU memory (the test runtime), one allocation per layer.
    Npu,
    /// NPU memory, one pooled allocation.
    NpuPooled,
}

impl Cache {
    /// The `kv_buffer_device` this memory goes with.
    pub fn buffer_device(self) -> &'static str {
        match self {
            Self::Host | Self::HostPooled => "cpu",
            Self::Agent | Self::Npu | Self::NpuPooled => "rbln",
        }
    }
}

/// The RBLN test runtime, built once per test binary.
pub fn runtime() -> Arc<RblnLib> {
    static LIB: std::sync::OnceLock<Arc<RblnLib>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cache-rbln");
        let p = rbln_sys::test_runtime::build(&dir, &[]).expect("building the RBLN test runtime");
        RblnLib::load_from(p.to_str().unwrap()).expect("loading the RBLN test runtime")
    })
    .clone()
}

/// The engine's handles on its cache: per layer, its memory and the layer's first byte.
pub struct EngineCache {
    layers: Vec<(Arc<dyn DeviceMemory>, u64)>,
}

/// A gap between pooled layers (so a wrong base offset lands in the wrong bytes).
const GAP: u64 = 4096 + 64;

fn alloc(kind: Cache, len: u64, dev: i32) -> (Arc<dyn DeviceMemory>, MemRegion) {
    match kind {
        Cache::Host | Cache::HostPooled => {
            let b = HostBuffer::from_vec(vec![0u8; len as usize]).unwrap();
            (b.clone(), MemRegion::host(b))
        }
        _ => {
            let n = NpuMemory::new(&runtime(), dev, len).unwrap();
            (n.clone(), MemRegion::device(n, dev))
        }
    }
}

impl EngineCache {
    /// Allocate a cache of `kind` for `l` on device `dev`: the handles, and what to hand
    /// the worker (`None` for [`Cache::Agent`]).
    pub fn new(kind: Cache, l: &KvLayout, dev: i32) -> (Option<Self>, KvCaches) {
        let n = l.layers.len() as u64;
        let lb = l.layer_bytes();
        match kind {
            Cache::Agent => (None, KvCaches::Allocate),
            Cache::Host | Cache::Npu => {
                let (mut layers, mut regions) = (Vec::new(), Vec::new());
                for name in &l.layers {
                    let (m, r) = alloc(kind, lb, dev);
                    layers.push((m, 0));
                    regions.push(r.layers(vec![name.clone()]));
                }
                (Some(Self { layers }), KvCaches::Engine(regions))
            }
            Cache::HostPooled | Cache::NpuPooled => {
                let (m, r) = alloc(kind, GAP + n * (lb + GAP), dev);
                let at: Vec<(String, u64)> = l
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(i, name)| (name.clone(), GAP + i as u64 * (lb + GAP)))
                    .collect();
                let layers = at.iter().map(|(_, o)| (m.clone(), *o)).collect();
                (
                    Some(Self { layers }),
                    KvCaches::Engine(vec![r.pooled_layers(at, lb)]),
                )
            }
        }
    }

    /// The engine writes `data` at `off` of layer `li`'s cache.
    pub fn write(&self, li: usize, off: u64, data: &[u8]) {
        let (m, base) = &self.layers[li];
        m.copy_from_host(base + off, data).unwrap();
    }

    /// The engine reads `out.len()` bytes at `off` of layer `li`'s cache.
    pub fn read(&self, li: usize, off: u64, out: &mut [u8]) {
        let (m, base) = &self.layers[li];
        m.copy_to_host(base + off, out).unwrap();
    }
}

/// Write into layer `li` at `off`: through the engine's own memory, or the agent's copy
/// for a kvrail-allocated cache.
pub fn write(own: Option<&EngineCache>, w: &Worker, li: usize, off: u64, data: &[u8]) {
    match own {
        Some(c) => c.write(li, off, data),
        None => {
            let r: RegionId = w.regions()[li];
            w.agent().write_region(r, off, data).unwrap();
        }
    }
}

/// Read from layer `li` at `off` (see [`write`]).
pub fn read(own: Option<&EngineCache>, w: &Worker, li: usize, off: u64, out: &mut [u8]) {
    match own {
        Some(c) => c.read(li, off, out),
        None => {
            let r: RegionId = w.regions()[li];
            w.agent().read_region(r, off, out).unwrap();
        }
    }
}
