//! Page-aligned host memory: what the agent registers, and what verbs memory regions
//! register. One buffer can be registered on
//! several devices (one region per rail, each with its own rkey) — how a transfer striped
//! over rails lands in one place. Every region holds an `Arc` of its buffer, so the pages
//! outlive every registration; CPU access is by copy (the NIC may access the memory at the
//! same time, so no `&[u8]` into it is ever handed out).

use std::fmt;
use std::sync::Arc;

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
}

/// Anonymous, zeroed, page-aligned host memory.
pub struct HostBuffer {
    map: MmapMut,
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
        let map = MmapMut::map_anon(len).map_err(|source| MemError::Alloc { len, source })?;
        Ok(Arc::new(Self { map }))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty (never: zero-length buffers cannot be made).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// The mapping's first byte, for registration with a device.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // memmap2 hands out the mapping's raw pointer (not one derived from a reference).
        self.map.as_ptr() as *mut u8
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), MemError> {
        if offset.checked_add(len).is_some_and(|end| end <= self.len()) {
            Ok(())
        } else {
            Err(MemError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                size: self.len() as u64,
            })
        }
    }

    /// Copy `data` in at `offset`.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`].
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.check(offset, data.len())?;
        // SAFETY: range checked; the mapping is writable and lives as long as `self`; raw
        // copies because the NIC may access the memory concurrently.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Copy `out.len()` bytes out from `offset`.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`].
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), MemError> {
        self.check(offset, out.len())?;
        // SAFETY: range checked; the mapping lives as long as `self`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
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
