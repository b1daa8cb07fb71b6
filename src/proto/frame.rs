//! Side-channel framing: each message is a 4-byte big-endian length followed by that many
//! bytes (msgpack). [`FrameDecoder`] takes bytes as they arrive and yields whole frames; a
//! length over its bound is an error before any of the body is buffered.

/// Length prefix size.
pub const PREFIX: usize = 4;
/// Default largest frame (metadata of an agent with many regions fits well under it).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// A frame that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The announced length exceeds the bound.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame ({have} of {want} bytes)")]
    Truncated {
        /// Bytes received.
        have: usize,
        /// Bytes announced (prefix included).
        want: usize,
    },
}

/// Prefix `body` with its length.
///
/// # Errors
/// [`FrameError::TooLarge`] for a body over `u32::MAX` bytes.
pub fn encode(body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge {
        len: body.len(),
        max: u32::MAX as usize,
    })?;
    let mut v = Vec::with_capacity(PREFIX + body.len());
    v.extend_from_slice(&len.to_be_bytes());
    v.extend_from_slice(body);
    Ok(v)
}

/// Incremental frame decoder with a size bound. Taken bytes are skipped by an offset, and
/// the bytes not taken are moved to the front only when the buffer's tail has no room for
/// what comes next, so a read holding many small frames costs no memmove per frame; a
/// reader can receive straight into the tail ([`FrameDecoder::read_with`]) instead of
/// copying in what it received elsewhere.
#[derive(Debug)]
pub struct FrameDecoder {
    /// Bytes `start..end` are received and not taken; the rest is room.
    buf: Vec<u8>,
    /// Bytes of `buf` already taken.
    start: usize,
    /// End of the received bytes.
    end: usize,
    max: usize,
}

/// An emptied buffer larger than this (a large frame passed) is let go.
const KEEP: usize = 1 << 20;

impl FrameDecoder {
    /// A decoder that refuses frames over `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            end: 0,
            max,
        }
    }

    /// The bytes not taken yet.
    fn rest(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn take(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > KEEP {
                self.buf = Vec::new();
            }
        }
    }

    /// Room for `n` more bytes after the received ones: the bytes not taken move to the
    /// front first, and the buffer grows only if that is not enough.
    fn room(&mut self, n: usize) -> &mut [u8] {
        if self.buf.len() - self.end < n && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() - self.end < n {
            let want = (self.end + n).max(2 * self.buf.len());
            self.buf.resize(want, 0);
        }
        &mut self.buf[self.end..self.end + n]
    }

    /// Add received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.room(bytes.len()).copy_from_slice(bytes);
        self.end += bytes.len();
    }

    /// Receive up to `n` bytes straight into the buffer: `read` fills the front of the room
    /// it is given and says how many bytes it put there (0: none, the end of the stream for
    /// a stream reader).
    ///
    /// # Errors
    /// What `read` returns.
    pub fn read_with<E>(
        &mut self,
        n: usize,
        read: impl FnOnce(&mut [u8]) -> Result<usize, E>,
    ) -> Result<usize, E> {
        let got = read(self.room(n))?.min(n);
        self.end += got;
        Ok(got)
    }

    /// The length of the next frame's body, once its prefix is buffered.
    fn announced(&self) -> Result<Option<usize>, FrameError> {
        let r = self.rest();
        if r.len() < PREFIX {
            return Ok(None);
        }
        let len = u32::from_be_bytes([r[0], r[1], r[2], r[3]]) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        Ok(Some(len))
    }

    /// The next whole frame's body, if one is buffered.
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] as soon as a prefix announces more than the bound (the
    /// connection should be dropped: the stream cannot be resynchronized).
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        self.next_frame_with(<[u8]>::to_vec)
    }

    /// [`FrameDecoder::next_frame`] without copying the body out: `f` reads it in place.
    ///
    /// # Errors
    /// As [`FrameDecoder::next_frame`].
    pub fn next_frame_with<T>(
        &mut self,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<T>, FrameError> {
        let Some(len) = self.announced()? else {
            return Ok(None);
        };
        if self.rest().len() < PREFIX + len {
            return Ok(None);
        }
        let t = f(&self.rest()[PREFIX..PREFIX + len]);
        self.take(PREFIX + len);
        Ok(Some(t))
    }

    /// Whether a whole frame is buffered (the next [`FrameDecoder::next_frame`] needs no more
    /// bytes; an over-long announcement counts: it fails without reading).
    pub fn has_frame(&self) -> bool {
        match self.announced() {
            Ok(Some(len)) => self.rest().len() >= PREFIX + len,
            Ok(None) => false,
            Err(_) => true,
        }
    }

    /// Bytes buffered and not yet taken.
    pub fn buffered(&self) -> usize {
        self.rest().len()
    }

    /// Move up to `out.len()` buffered bytes that are not a frame (the raw payload that
    /// follows a data header) into the front of `out`; returns how many.
    pub fn take_raw(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.buffered());
        out[..n].copy_from_slice(&self.rest()[..n]);
        self.take(n);
        n
    }

    /// The peer closed the stream: fine between frames, an error inside one.
    ///
    /// # Errors
    /// [`FrameError::Truncated`].
    pub fn finish(&self) -> Result<(), FrameError> {
        let r = self.rest();
        if r.is_empty() {
            return Ok(());
        }
        let want = if r.len() >= PREFIX {
            PREFIX + u32::from_be_bytes([r[0], r[1], r[2], r[3]]) as usize
        } else {
            PREFIX
        };
        Err(FrameError::Truncated {
            have: r.len(),
            want,
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn frames_across_arbitrary_splits() {
        let mut wire = encode(b"hello").unwrap();
        wire.extend(encode(b"").unwrap());
        wire.extend(encode(&[7u8; 1000]).unwrap());
        for split in [1, 2, 3, 5, 7, 1009] {
            let mut d = FrameDecoder::new(4096);
            let mut got = Vec::new();
            for chunk in wire.chunks(split) {
                d.push(chunk);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(
                got,
                vec![b"hello".to_vec(), vec![], vec![7u8; 1000]],
                "split {split}"
            );
            assert_eq!(d.finish(), Ok(()));
        }
    }

    #[test]
    fn oversized_and_truncated() {
        let mut d = FrameDecoder::new(10);
        d.push(&[0, 0, 0, 11]);
        assert_eq!(
            d.next_frame(),
            Err(FrameError::TooLarge { len: 11, max: 10 })
        );
        let mut d = FrameDecoder::new(10);
        d.push(&[0, 0, 0, 5, 1, 2]);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.finish(), Err(FrameError::Truncated { have: 6, want: 9 }));
        assert_eq!(
            d.finish().unwrap_err().to_string(),
            "stream ended inside a frame (6 of 9 bytes)"
        );
        let mut d = FrameDecoder::new(10);
        d.push(&[0xff, 0xff, 0xff, 0xff]);
        assert!(
            d.next_frame().is_err(),
            "a 4 GiB announcement is refused, not allocated"
        );
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2000), max in 0usize..512) {
            let mut d = FrameDecoder::new(max);
            d.push(&bytes);
            while let Ok(Some(f)) = d.next_frame() {
                prop_assert!(f.len() <= max);
            }
            let _ = d.finish();
        }

        /// Frames each followed by raw bytes (a data header and its payload), pushed (or
        /// received in place) in arbitrary pieces and taken as they become available: every
        /// frame and every raw byte comes out in order, and `has_frame` says exactly when
        /// `next_frame` yields.
        #[test]
        fn frames_and_raw_bytes_across_splits(
            items in prop::collection::vec((prop::collection::vec(any::<u8>(), 0..40), 0usize..300), 1..30),
            splits in prop::collection::vec(1usize..200, 1..50),
        ) {
            let mut wire = Vec::new();
            let mut raw_total = 0u8;
            for (body, raw) in &items {
                wire.extend(encode(body).unwrap());
                wire.extend((0..*raw).map(|i| (i as u8).wrapping_add(raw_total)));
                raw_total = raw_total.wrapping_add(1);
            }
            let mut d = FrameDecoder::new(64);
            let (mut at, mut k, mut next) = (0, 0, 0);
            let mut raw_left: Option<usize> = None;
            let mut got_raw = Vec::new();
            let mut want_raw = Vec::new();
            while next < items.len() {
                if let Some(n) = raw_left {
                    let mut out = vec![0u8; n];
                    let t = d.take_raw(&mut out);
                    got_raw.extend_from_slice(&out[..t]);
                    raw_left = (t < n).then_some(n - t);
                    if raw_left.is_none() {
                        next += 1;
                    }
                } else if d.has_frame() {
                    let f = d.next_frame().unwrap().unwrap();
                    prop_assert_eq!(&f, &items[next].0);
                    want_raw.extend((0..items[next].1).map(|i| (i as u8).wrapping_add(next as u8)));
                    raw_left = Some(items[next].1);
                    if items[next].1 == 0 {
                        raw_left = None;
                        next += 1;
                    }
                    continue;
                } else {
                    prop_assert_eq!(d.next_frame().unwrap(), None);
                }
                if raw_left.is_some() || !d.has_frame() {
                    if at >= wire.len() {
                        break;
                    }
                    let n = splits[k % splits.len()].min(wire.len() - at);
                    if k % 2 == 0 {
                        d.push(&wire[at..at + n]);
                    } else {
                        // received in place, into more room than the bytes that came
                        let got = d.read_with::<()>(n + k % 7, |room| {
                            room[..n].copy_from_slice(&wire[at..at + n]);
                            Ok(n)
                        });
                        prop_assert_eq!(got, Ok(n));
                    }
                    at += n;
                    k += 1;
                }
            }
            prop_assert_eq!(next, items.len());
            prop_assert_eq!(got_raw, want_raw);
            prop_assert_eq!(d.buffered(), 0);
            prop_assert_eq!(d.finish(), Ok(()));
        }
    }
}
