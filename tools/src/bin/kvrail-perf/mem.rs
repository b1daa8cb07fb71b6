//! `--mem`: which memory the two agents move — host memory, or NPU memory of the RBLN
//! runtime `RBLN_RUNTIME_LIB` names (kvrail's test runtime in the lab), which the agent
//! stages through its host bounce on verbs.

use std::sync::Arc;

use kvrail::agent::{Agent, MemRegion, RegionId, RemoteAccess};
use kvrail::mem::NpuMemory;
use rbln_sys::RblnLib;

use crate::args::Mem;

fn runtime() -> Result<Arc<RblnLib>, String> {
    RblnLib::shared().map_err(|e| format!("--mem npu: {e}"))
}

/// Register `len` bytes of `mem` (NPU memory on device `dev`) with `access`.
pub(crate) fn register(
    a: &Agent,
    mem: Mem,
    len: u64,
    access: RemoteAccess,
    dev: i32,
) -> Result<RegionId, String> {
    match mem {
        Mem::Host => a
            .register(len as usize, access, vec![])
            .map_err(|e| e.to_string()),
        Mem::Npu => {
            let m = NpuMemory::new(&runtime()?, dev, len).map_err(|e| e.to_string())?;
            a.register_memory(MemRegion::device(m, dev).access(access))
                .map_err(|e| e.to_string())
        }
    }
}

/// The runtime's file, for the report's header.
pub(crate) fn runtime_path() -> Option<String> {
    runtime().ok().map(|l| l.path().to_owned())
}
