//! Memory kvrail moves. [`HostBuffer`] is page-aligned host memory that the agent and
//! the verbs layer share; CPU access is by copy because a NIC may access it concurrently.
//! [`DeviceMemory`] is accelerator memory reached by copies through its runtime
//! ([`NpuMemory`] through `rbln-sys`); [`MemoryPath`] decides between registering it with the
//! NIC through dma-buf and bouncing it through host buffers (`crate::agent::bounce`).
//! The only `unsafe` here is `raw` (the caller's memory given as an address, an FFI
//! boundary): the device reaches the pages through its registration (in
//! `transport::verbs`), the CPU through copies under a lock, NPU memory through `rbln-sys`.

mod device;
mod host;
mod path;
#[allow(unsafe_code)]
mod raw;

pub use device::{DeviceMemory, Dmabuf, NpuMemory};
pub use host::{HostBuffer, HostOwner, MemError};
pub use path::{ConfigError, KvBufferDevice, MemoryPath, NicDmabuf};

/// A region needs at least one byte.
fn nonempty(len: usize) -> Result<(), MemError> {
    if len == 0 {
        let source = std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a region needs at least one byte",
        );
        return Err(MemError::Alloc { len, source });
    }
    Ok(())
}
