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

/// Incremental frame decoder with a size bound.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    max: usize,
}

impl FrameDecoder {
    /// A decoder that refuses frames over `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            buf: Vec::new(),
            max,
        }
    }

    /// Add received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame's body, if one is buffered.
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] as soon as a prefix announces more than the bound (the
    /// connection should be dropped: the stream cannot be resynchronized).
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.buf.len() < PREFIX {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < PREFIX + len {
            return Ok(None);
        }
        let body = self.buf[PREFIX..PREFIX + len].to_vec();
        self.buf.drain(..PREFIX + len);
        Ok(Some(body))
    }

    /// Bytes buffered and not yet taken.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Move up to `out.len()` buffered bytes that are not a frame (the raw payload that
    /// follows a data header) into the front of `out`; returns how many.
    pub fn take_raw(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf.drain(..n);
        n
    }

    /// The peer closed the stream: fine between frames, an error inside one.
    ///
    /// # Errors
    /// [`FrameError::Truncated`].
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let want = if self.buf.len() >= PREFIX {
            PREFIX
                + u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize
        } else {
            PREFIX
        };
        Err(FrameError::Truncated {
            have: self.buf.len(),
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
    }
}
