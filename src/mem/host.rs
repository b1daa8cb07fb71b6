//! Page-aligned host memory: what the agent registers, and what verbs memory regions
//! register. One buffer can be registered on
//! several devices (one region per rail, each with its own rkey) — how a transfer striped
//! over rails lands in one place. Every region holds an `Arc` of its buffer, so the pages
//! outlive every registration; CPU access is by copy (the NIC may access the memory at the
//! same time, so no `&[u8]` into it is ever handed out; CPU copies are serialized by a lock).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::MmapMut;

/// A host-memory error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemError {
    /// Allocating the memory failed.
    #[error("allocating {len} bytes of host memory failed: {source}")]
    Alloc {
        /// Bytes asked for.
        len: usize,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A byte range outside the buffer.
    #[error("range [{offset}, {offset}+{len}) is outside the {size}-byte buffer")]
    OutOfRange {
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// Buffer size.
        size: u64,
    },
    /// The device runtime refused a copy or allocation.
    #[error("device memory: {0}")]
    Device(String),
}

/// Anonymous, zeroed, page-aligned host memory.
pub struct HostBuffer {
    /// CPU copies take the lock; the device reaches the pages through the registration.
    map: Mutex<MmapMut>,
    /// Address of the first byte (fixed for the mapping's life).
    addr: usize,
    len: usize,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl HostBuffer {
    /// `len` zeroed bytes (pages are touched lazily).
    ///
    /// # Errors
    /// [`MemError::Alloc`] (also for `len == 0`).
    pub fn new(len: usize) -> Result<Arc<Self>, MemError> {
        if len == 0 {
            let source = std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a region needs at least one byte",
            );
            return Err(MemError::Alloc { len, source });
        }
        let mut map = MmapMut::map_anon(len).map_err(|source| MemError::Alloc { len, source })?;
        let addr = map.as_mut_ptr() as usize;
        Ok(Arc::new(Self {
            map: Mutex::new(map),
            addr,
            len,
        }))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty (never: zero-length buffers cannot be made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// The mapping's first byte, for registration with a device.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.lock().as_mut_ptr()
    }

    fn lock(&self) -> MutexGuard<'_, MmapMut> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>, MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(offset..end),
            _ => Err(MemError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: self.len as u64,
            }),
        }
    }

    /// Copy `data` in at `offset`.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`].
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        let r = self.check(offset, data.len())?;
        self.lock()[r].copy_from_slice(data);
        Ok(())
    }

    /// Copy `out.len()` bytes out from `offset`.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`].
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), MemError> {
        let r = self.check(offset, out.len())?;
        out.copy_from_slice(&self.lock()[r]);
        Ok(())
    }
}

impl HostBuffer {
    /// Run `f` on `len` bytes at `offset`, exclusively (CPU copies are serialized; a device
    /// runtime copies straight into or out of the buffer this way, with no extra copy).
    ///
    /// # Errors
    /// [`MemError::OutOfRange`], or `f`'s error.
    pub fn with_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> Result<R, MemError>,
    ) -> Result<R, MemError> {
        let r = self.check(offset, len)?;
        f(&mut self.lock()[r])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_in_and_out_with_bounds() {
        let b = HostBuffer::new(8192).unwrap();
        assert_eq!(b.addr() % 4096, 0, "page aligned");
        b.write(4090, b"abcdef").unwrap();
        let mut out = [0u8; 8];
        b.read(4088, &mut out).unwrap();
        assert_eq!(&out, b"\0\0abcdef");
        assert!(matches!(
            b.write(8190, b"abc"),
            Err(MemError::OutOfRange { .. })
        ));
        assert!(b.read(usize::MAX, &mut out).is_err());
        assert!(HostBuffer::new(0).is_err());
    }
}
