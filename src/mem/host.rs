//! Host memory the agent and the verbs layer share: page-aligned memory kvrail allocates
//! ([`HostBuffer::new`]), or the caller's own — a `Vec<u8>` or a `memmap2::MmapMut` handed
//! over ([`HostBuffer::from_vec`], [`HostBuffer::from_mmap`], given back by
//! [`HostBuffer::into_owner`]), or a raw address range the caller keeps alive
//! ([`HostBuffer::from_raw`], `unsafe`). One buffer can be registered on several devices
//! (one region per rail, each with its own rkey) — how a transfer striped over rails lands in
//! one place. Every registration holds an `Arc` of its buffer, so the pages outlive it; CPU
//! access is by copy (the NIC may access the memory at the same time, so no `&[u8]` into it
//! is ever handed out; CPU copies are serialized by a lock). The NIC reads and writes the
//! caller's pages in place: kvrail copies none of them on the verbs path.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::MmapMut;

use super::nonempty;
use super::raw::RawRange;

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

/// Host memory registered with kvrail: its own or the caller's (see the module docs).
pub struct HostBuffer {
    /// CPU copies take the lock; the device reaches the pages through the registration.
    mem: Mutex<Backing>,
    /// Address of the first byte (fixed for the buffer's life).
    addr: usize,
    len: usize,
}

/// What holds a [`HostBuffer`]'s pages.
pub(super) enum Backing {
    /// Anonymous memory kvrail mapped ([`HostBuffer::new`]).
    Anon(MmapMut),
    /// The caller's mapping, handed over.
    Mmap(MmapMut),
    /// The caller's vector, handed over (never grown or moved while held).
    Vec(Vec<u8>),
    /// The caller's memory, which the caller keeps alive ([`HostBuffer::from_raw`]).
    Raw(RawRange),
}

impl Backing {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Self::Anon(m) | Self::Mmap(m) => m,
            Self::Vec(v) => v,
            Self::Raw(r) => r.bytes(),
        }
    }
}

/// The caller's memory given back by [`HostBuffer::into_owner`].
#[derive(Debug)]
#[non_exhaustive]
pub enum HostOwner {
    /// Memory kvrail allocated (dropping it unmaps it).
    Allocated(MmapMut),
    /// The mapping handed to [`HostBuffer::from_mmap`].
    Mmap(MmapMut),
    /// The vector handed to [`HostBuffer::from_vec`].
    Vec(Vec<u8>),
    /// A range registered with [`HostBuffer::from_raw`]: the caller owns it anyway.
    Raw {
        /// Its first byte.
        addr: usize,
        /// Bytes.
        len: usize,
    },
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
        nonempty(len)?;
        let map = MmapMut::map_anon(len).map_err(|source| MemError::Alloc { len, source })?;
        Ok(Self::wrap(Backing::Anon(map)))
    }

    /// The caller's vector, registered in place (all `v.len()` bytes; its capacity beyond
    /// that is not used). [`HostBuffer::into_owner`] gives it back.
    ///
    /// # Errors
    /// [`MemError::Alloc`] for an empty vector.
    pub fn from_vec(v: Vec<u8>) -> Result<Arc<Self>, MemError> {
        nonempty(v.len())?;
        Ok(Self::wrap(Backing::Vec(v)))
    }

    /// The caller's mapping (of a file, of huge pages, shared with another process …),
    /// registered in place. [`HostBuffer::into_owner`] gives it back.
    ///
    /// # Errors
    /// [`MemError::Alloc`] for an empty mapping.
    pub fn from_mmap(m: MmapMut) -> Result<Arc<Self>, MemError> {
        nonempty(m.len())?;
        Ok(Self::wrap(Backing::Mmap(m)))
    }

    /// The caller's memory at `r` ([`HostBuffer::from_raw`], beside [`RawRange`]).
    pub(super) fn wrap_raw(r: RawRange) -> Arc<Self> {
        Self::wrap(Backing::Raw(r))
    }

    pub(super) fn wrap(mut b: Backing) -> Arc<Self> {
        let bytes = b.bytes();
        let (addr, len) = (bytes.as_mut_ptr() as usize, bytes.len());
        Arc::new(Self {
            mem: Mutex::new(b),
            addr,
            len,
        })
    }

    /// The memory back, once nothing else holds the buffer (no registration, no transfer):
    /// `Err` returns the buffer when something still does.
    ///
    /// # Errors
    /// The buffer itself, while other `Arc`s of it live.
    pub fn into_owner(this: Arc<Self>) -> Result<HostOwner, Arc<Self>> {
        let me = Arc::try_unwrap(this)?;
        let (addr, len) = (me.addr, me.len);
        Ok(
            match me.mem.into_inner().unwrap_or_else(|p| p.into_inner()) {
                Backing::Anon(m) => HostOwner::Allocated(m),
                Backing::Mmap(m) => HostOwner::Mmap(m),
                Backing::Vec(v) => HostOwner::Vec(v),
                Backing::Raw(_) => HostOwner::Raw { addr, len },
            },
        )
    }

    /// True when the memory is the caller's (handed over or raw), not allocated by kvrail.
    pub fn is_callers(&self) -> bool {
        !matches!(*self.lock(), Backing::Anon(_))
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
        self.lock().bytes().as_mut_ptr()
    }

    fn lock(&self) -> MutexGuard<'_, Backing> {
        self.mem.lock().unwrap_or_else(|p| p.into_inner())
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
        self.lock().bytes()[r].copy_from_slice(data);
        Ok(())
    }

    /// Copy `parts` in one after another from `offset`, under one lock (a frame's header
    /// and payload): how many bytes. Nothing is written when they do not all fit.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`].
    pub fn write_parts(&self, offset: usize, parts: &[&[u8]]) -> Result<usize, MemError> {
        let len = parts.iter().map(|p| p.len()).sum();
        self.with_mut(offset, len, |bytes| {
            let mut at = 0;
            for p in parts {
                bytes[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
            Ok(len)
        })
    }

    /// Copy `out.len()` bytes out from `offset`.
    ///
    /// # Errors
    /// [`MemError::OutOfRange`].
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), MemError> {
        let r = self.check(offset, out.len())?;
        out.copy_from_slice(&self.lock().bytes()[r]);
        Ok(())
    }
}

/// A [`HostBuffer`]'s bytes under its CPU lock (see [`HostBuffer::locked`]).
pub(crate) struct HostGuard<'a>(MutexGuard<'a, Backing>);

impl HostGuard<'_> {
    /// The whole buffer.
    pub(crate) fn bytes(&mut self) -> &[u8] {
        self.0.bytes()
    }
}

impl HostBuffer {
    /// Hold the CPU lock (one holder takes several buffers' locks in address order only, and
    /// never waits on a socket while it holds them).
    pub(crate) fn locked(&self) -> HostGuard<'_> {
        HostGuard(self.lock())
    }

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
        f(&mut self.lock().bytes()[r])
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

    #[test]
    fn parts_land_back_to_back_or_not_at_all() {
        let b = HostBuffer::new(4096).unwrap();
        assert_eq!(b.write_parts(100, &[b"hd", b"", b"abc", b"z"]).unwrap(), 6);
        let mut out = [0u8; 8];
        b.read(99, &mut out).unwrap();
        assert_eq!(&out, b"\0hdabcz\0");
        // the last part would end past the buffer: none of them is written
        assert!(matches!(
            b.write_parts(4090, &[b"xyz", b"1234"]),
            Err(MemError::OutOfRange { len: 7, .. })
        ));
        let mut tail = [9u8; 6];
        b.read(4090, &mut tail).unwrap();
        assert_eq!(tail, [0; 6]);
    }
}
