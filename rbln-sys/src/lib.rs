//! The RBLN NPU runtime's public C API, loaded at run time.
//!
//! Nothing links against the vendor library: [`RblnLib::load`] `dlopen`s it (the
//! `RBLN_RUNTIME_LIB` environment variable names the file; otherwise `librbln.so.1`,
//! `librbln.so` and `librbln_rt.so` are tried in that order) and resolves every symbol once
//! into a table. A missing library or symbol is a typed error naming what was tried, never a
//! link failure or a crash, so everything that depends on this crate builds and runs where no
//! NPU runtime is installed.
//!
//! What is bound, and how sure we are of it:
//! - **Public and required**: `rbln_get_device_count(int*)`, `rbln_malloc(int, uint64_t,
//!   void**)`, `rbln_free(int, void*)`, `rbln_memcpy(int, void*, const void*, uint64_t, int)`
//!   with kinds host→device 0, device→host 1, device→device 2; return 0 on success.
//! - **kvrail's own optional ABI** (`rbln_rdma_*`, version 1), resolved only if present. No
//!   public RBLN library exports NPU memory as a dma-buf; the vendor's NIXL plugin does that
//!   privately. A shim built on an RBLN host (or a future vendor API) may provide:
//!   - `int rbln_rdma_abi_version(void)` — returns 1;
//!   - `int rbln_rdma_device_numa_node(int dev, int* node)` — -1 when unknown;
//!   - `int rbln_rdma_export_dmabuf(int dev, void* ptr, uint64_t len, int* fd,
//!     uint64_t* offset, uint64_t* iova)` — a dma-buf fd (owned by the caller) covering the
//!     allocation that starts at `ptr`, the offset of `ptr` in it, and the address the NIC
//!     should use for it.
//!
//!   Without the export entry point the transport uses host bounce ([`RblnLib::dmabuf_export`]
//!   says why).
//!
//! The NUMA node of an NPU comes from sysfs (`/sys/bus/pci/devices/<bus>/numa_node`) and from
//! `rbln-smi -j` where installed ([`smi`]).
#![allow(unsafe_code)] // an FFI binding: every unsafe block states why it is sound

mod alloc;
mod load;
pub mod smi;
pub mod test_runtime;

pub use alloc::{DeviceAlloc, Dmabuf};
pub use load::{LoadError, RblnError, RblnLib, ENV_LIB, SEARCH};

/// Direction of an `rbln_memcpy` (`RBLNMemcpyType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum MemcpyKind {
    /// Host → device.
    HostToDevice = 0,
    /// Device → host.
    DeviceToHost = 1,
    /// Device → device.
    DeviceToDevice = 2,
}
