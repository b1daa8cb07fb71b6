//! Device memory: memory the CPU reaches only by copies through its runtime (an NPU's), and
//! that the NIC reaches only through a dma-buf export, when there is one.

use std::fmt;
use std::sync::Arc;

use super::{HostBuffer, MemError};

/// A dma-buf export of device memory (what `ibv_reg_dmabuf_mr` takes).
pub use rbln_sys::Dmabuf;

/// Accelerator memory, reached by copies. Implementations: [`NpuMemory`] (RBLN, through
/// `rbln-sys`) and [`HostBuffer`] (host memory standing in for a device, for tests).
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// What kind of memory (for logs): `"rbln"`, `"host"`.
    fn kind(&self) -> &'static str;
    /// Bytes.
    fn size(&self) -> u64;
    /// Copy `out.len()` bytes at `offset` to the host.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`], [`MemError::Device`].
    fn copy_to_host(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError>;
    /// Copy `data` to the device at `offset`.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`], [`MemError::Device`].
    fn copy_from_host(&self, offset: u64, data: &[u8]) -> Result<(), MemError>;
    /// The runtime's address of the first byte (for overlap checks and logs; 0 when the
    /// memory has none to show).
    fn device_addr(&self) -> u64 {
        0
    }
    /// Export the memory as a dma-buf for NIC registration.
    ///
    /// # Errors
    /// [`MemError::Device`] saying why it cannot (the default).
    fn export_dmabuf(&self) -> Result<Dmabuf, MemError> {
        Err(MemError::Device(format!(
            "{} memory has no dma-buf export",
            self.kind()
        )))
    }
}

/// NPU memory allocated with `rbln_malloc` through a loaded RBLN runtime.
#[derive(Debug)]
pub struct NpuMemory {
    alloc: rbln_sys::DeviceAlloc,
}

fn device_err(e: rbln_sys::RblnError) -> MemError {
    match e {
        rbln_sys::RblnError::OutOfRange { offset, len, size } => {
            MemError::OutOfRange { offset, len, size }
        }
        e => MemError::Device(e.to_string()),
    }
}

impl NpuMemory {
    /// Allocate `len` bytes on NPU `dev`.
    ///
    /// # Errors
    /// [`MemError::Device`] with the runtime's error.
    pub fn new(lib: &Arc<rbln_sys::RblnLib>, dev: i32, len: u64) -> Result<Arc<Self>, MemError> {
        let alloc = rbln_sys::DeviceAlloc::new(lib, dev, len).map_err(device_err)?;
        Ok(Arc::new(Self { alloc }))
    }

    pub(super) fn wrap(alloc: rbln_sys::DeviceAlloc) -> Arc<Self> {
        Arc::new(Self { alloc })
    }

    /// The device.
    pub fn device(&self) -> i32 {
        self.alloc.device()
    }

    /// The runtime's address of the first byte.
    pub fn addr(&self) -> u64 {
        self.alloc.addr()
    }
}

impl DeviceMemory for NpuMemory {
    fn kind(&self) -> &'static str {
        "rbln"
    }
    fn size(&self) -> u64 {
        self.alloc.len()
    }
    fn copy_to_host(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.alloc.copy_to_host(offset, out).map_err(device_err)
    }
    fn device_addr(&self) -> u64 {
        self.alloc.addr()
    }
    fn copy_from_host(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.alloc.copy_from_host(offset, data).map_err(device_err)
    }
    fn export_dmabuf(&self) -> Result<Dmabuf, MemError> {
        self.alloc.export_dmabuf().map_err(device_err)
    }
}

impl DeviceMemory for HostBuffer {
    fn kind(&self) -> &'static str {
        "host"
    }
    fn size(&self) -> u64 {
        self.len() as u64
    }
    fn copy_to_host(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.read(usize::try_from(offset).unwrap_or(usize::MAX), out)
    }
    fn copy_from_host(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.write(usize::try_from(offset).unwrap_or(usize::MAX), data)
    }
}
