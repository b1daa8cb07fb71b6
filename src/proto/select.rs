//! Which bytes of a request's KV blocks cross the fabric, and when (SPEC §3, seed 001):
//! `chunk_mode` (+ `chunk_tokens`), `swa_window_mode` and `push_stream`. They change how much
//! or when data moves, never which bytes D ends up with: every token D will attend to is
//! sent; what is skipped holds no token D uses.
//!
//! Blocks are in the HND layout: `[kv head][token in block][head bytes]`, so a token range
//! of a block is one span per head.

/// The geometry of one block (one plane of one layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGeom {
    /// KV heads.
    pub kv_heads: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Bytes of one token of one head (`head_size × dtype bytes`).
    pub head_bytes: u64,
}

/// `len` bytes at `offset` of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Offset in the block.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl BlockGeom {
    /// Bytes of a block.
    pub fn block_bytes(&self) -> u64 {
        self.kv_heads * self.block_size * self.head_bytes
    }

    /// Tokens `[from, to)` of a block: one span per head (the whole block as one span when
    /// the range is the whole block).
    pub fn token_spans(&self, from: u64, to: u64) -> Vec<Span> {
        let (from, to) = (from.min(self.block_size), to.min(self.block_size));
        if from >= to {
            return Vec::new();
        }
        if from == 0 && to == self.block_size {
            return vec![Span {
                offset: 0,
                len: self.block_bytes(),
            }];
        }
        (0..self.kv_heads)
            .map(|h| Span {
                offset: (h * self.block_size + from) * self.head_bytes,
                len: (to - from) * self.head_bytes,
            })
            .collect()
    }
}

/// `chunk_mode`'s chunk size: the smallest value at least `bound` (default: one prefill
/// step) that divides the block's token span; the block size when none smaller does.
pub fn chunk_tokens(block_size: u64, bound: u64) -> u64 {
    let bound = bound.max(1);
    (bound..block_size)
        .find(|c| block_size.is_multiple_of(*c))
        .unwrap_or(block_size)
}

/// Token ranges `[from, to)` within each request block (by the block's index in the
/// request) that must cross the fabric.
pub type BlockRanges = Vec<(u64, Vec<(u64, u64)>)>;

/// Token ranges for a full-attention layer: full blocks whole; with `chunk` (chunk_mode) the
/// last block only up to the end of the chunk holding the last token; without, the last
/// block whole.
pub fn full_attention_ranges(block_size: u64, tokens: u64, chunk: Option<u64>) -> BlockRanges {
    let bs = block_size.max(1);
    (0..tokens.div_ceil(bs))
        .map(|b| {
            let in_block = (tokens - b * bs).min(bs);
            let to = match chunk {
                Some(c) if in_block < bs => (in_block.div_ceil(c.max(1)) * c.max(1)).min(bs),
                _ => bs,
            };
            (b, vec![(0, to)])
        })
        .collect()
}

/// A sliding window `swa_window_mode` cannot cut blocks by: it must divide the block size
/// more than once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "swa_window_mode needs block_size ({block_size}) to be a multiple (>1) of the window \
     ({window})"
)]
pub struct WindowError {
    /// Tokens per block.
    pub block_size: u64,
    /// The layer's window, tokens.
    pub window: u64,
}

/// Token ranges for a sliding-window layer of `window` tokens under `swa_window_mode`
/// (`block_size % window == 0`, ratio above 1): only the window-sized granules that hold
/// one of the last `window` tokens; blocks entirely before the window are skipped.
///
/// # Errors
/// [`WindowError`] when the window does not divide the block or equals it (the mode does
/// not apply).
pub fn window_ranges(
    block_size: u64,
    tokens: u64,
    window: u64,
) -> Result<BlockRanges, WindowError> {
    if window == 0 || !block_size.is_multiple_of(window) || block_size / window < 2 {
        return Err(WindowError { block_size, window });
    }
    let mut out: BlockRanges = Vec::new();
    if tokens == 0 {
        return Ok(out);
    }
    let first_granule = tokens.saturating_sub(window) / window;
    let last_granule = (tokens - 1) / window;
    for gr in first_granule..=last_granule {
        let (from, to) = (gr * window, (gr + 1) * window);
        let b = from / block_size;
        let r = (from - b * block_size, to - b * block_size);
        match out.last_mut() {
            Some((lb, v)) if *lb == b => match v.last_mut() {
                Some(last) if last.1 == r.0 => last.1 = r.1,
                _ => v.push(r),
            },
            _ => out.push((b, vec![r])),
        }
    }
    Ok(out)
}

fn spans_of(g: &BlockGeom, ranges: BlockRanges) -> Vec<(u64, Vec<Span>)> {
    ranges
        .into_iter()
        .map(|(b, rs)| {
            let spans = rs.iter().flat_map(|&(f, t)| g.token_spans(f, t)).collect();
            (b, spans)
        })
        .collect()
}

/// [`full_attention_ranges`] as byte spans of each block.
pub fn full_attention_spans(
    g: &BlockGeom,
    tokens: u64,
    chunk: Option<u64>,
) -> Vec<(u64, Vec<Span>)> {
    spans_of(g, full_attention_ranges(g.block_size, tokens, chunk))
}

/// [`window_ranges`] as byte spans of each block.
///
/// # Errors
/// As [`window_ranges`].
pub fn window_spans(
    g: &BlockGeom,
    tokens: u64,
    window: u64,
) -> Result<Vec<(u64, Vec<Span>)>, WindowError> {
    Ok(spans_of(g, window_ranges(g.block_size, tokens, window)?))
}

/// `push_stream`: after each prefill step (`done[i]` tokens computed so far, rising), the
/// blocks it closed go at once; the block holding the prompt's last tokens goes when the
/// prefill ends. Returns, per step, the block indexes to send then.
pub fn stream_schedule(done: &[u64], tokens: u64, block_size: u64) -> Vec<Vec<u64>> {
    let mut sent = 0;
    let total = tokens.div_ceil(block_size);
    done.iter()
        .enumerate()
        .map(|(i, &d)| {
            let last = i + 1 == done.len();
            let closed = if last {
                total
            } else {
                (d.min(tokens)) / block_size
            };
            let v: Vec<u64> = (sent..closed).collect();
            sent = sent.max(closed);
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: BlockGeom = BlockGeom {
        kv_heads: 4,
        block_size: 64,
        head_bytes: 8,
    };

    /// The KV of a prompt: token t's bytes are non-zero; slots after the prompt are zero.
    fn source(tokens: u64) -> Vec<Vec<u8>> {
        (0..tokens.div_ceil(G.block_size))
            .map(|b| {
                let mut v = vec![0u8; G.block_bytes() as usize];
                for h in 0..G.kv_heads {
                    for t in 0..G.block_size {
                        let tok = b * G.block_size + t;
                        if tok < tokens {
                            for i in 0..G.head_bytes {
                                v[((h * G.block_size + t) * G.head_bytes + i) as usize] =
                                    (tok * 7 + h * 3 + i) as u8 | 1;
                            }
                        }
                    }
                }
                v
            })
            .collect()
    }

    /// D's blocks start as garbage (0xEE); copy the selected spans; count bytes.
    fn apply(src: &[Vec<u8>], sel: &[(u64, Vec<Span>)]) -> (Vec<Vec<u8>>, u64) {
        let mut dst: Vec<Vec<u8>> = src.iter().map(|b| vec![0xEE; b.len()]).collect();
        let mut n = 0;
        for (b, spans) in sel {
            for s in spans {
                let r = s.offset as usize..(s.offset + s.len) as usize;
                dst[*b as usize][r.clone()].copy_from_slice(&src[*b as usize][r]);
                n += s.len;
            }
        }
        (dst, n)
    }

    /// Every byte of the tokens in `[from, to)` is on D.
    fn same_tokens(src: &[Vec<u8>], dst: &[Vec<u8>], from: u64, to: u64) {
        for tok in from..to {
            let (b, t) = ((tok / G.block_size) as usize, tok % G.block_size);
            for h in 0..G.kv_heads {
                let at = ((h * G.block_size + t) * G.head_bytes) as usize;
                let r = at..at + G.head_bytes as usize;
                assert_eq!(src[b][r.clone()], dst[b][r], "token {tok} head {h}");
            }
        }
    }

    #[test]
    fn chunk_size_is_the_smallest_divisor_at_least_the_bound() {
        assert_eq!(chunk_tokens(1024, 512), 512);
        assert_eq!(chunk_tokens(1024, 300), 512);
        assert_eq!(chunk_tokens(1024, 1), 1);
        assert_eq!(chunk_tokens(96, 40), 48);
        assert_eq!(
            chunk_tokens(16, 512),
            16,
            "a step larger than the block: whole blocks"
        );
    }

    #[test]
    fn chunk_mode_sends_fewer_bytes_and_d_has_every_token() {
        for tokens in [1, 17, 63, 64, 65, 100, 200, 256] {
            let src = source(tokens);
            let (full, full_n) = apply(&src, &full_attention_spans(&G, tokens, None));
            let c = chunk_tokens(G.block_size, 16);
            let (chunked, n) = apply(&src, &full_attention_spans(&G, tokens, Some(c)));
            same_tokens(&src, &full, 0, tokens);
            same_tokens(&src, &chunked, 0, tokens);
            assert_eq!(full_n, src.len() as u64 * G.block_bytes());
            // the last block carries only its chunks with tokens
            let last = tokens - (src.len() as u64 - 1) * G.block_size;
            let expect = (src.len() as u64 - 1) * G.block_bytes()
                + if last == G.block_size {
                    G.block_bytes()
                } else {
                    last.div_ceil(c) * c * G.kv_heads * G.head_bytes
                };
            assert_eq!(n, expect, "tokens {tokens}");
            assert!(n <= full_n);
            if tokens % G.block_size != 0 && tokens % G.block_size <= G.block_size - c {
                assert!(n < full_n, "tokens {tokens}: fewer bytes");
            }
        }
    }

    #[test]
    fn window_mode_sends_only_the_window_and_d_has_it() {
        let w = 16;
        for tokens in [1, 15, 16, 17, 64, 100, 129, 256] {
            let src = source(tokens);
            let sel = window_spans(&G, tokens, w).unwrap();
            let (dst, n) = apply(&src, &sel);
            same_tokens(&src, &dst, tokens.saturating_sub(w), tokens);
            // at most two granules of the window
            assert!(
                n <= 2 * w * G.kv_heads * G.head_bytes,
                "tokens {tokens}: {n}"
            );
            assert!(
                n < src.len() as u64 * G.block_bytes() || tokens <= w,
                "tokens {tokens}"
            );
        }
        assert!(window_spans(&G, 10, 64).is_err(), "ratio 1: not applicable");
        assert!(window_spans(&G, 10, 24).is_err(), "does not divide");
    }

    #[test]
    fn push_stream_sends_each_block_once_as_it_closes() {
        // 200 tokens, prefill steps of 64 tokens: blocks close at 64, 128, 192; the partial
        // last block goes at the end
        let s = stream_schedule(&[64, 128, 192, 200], 200, 64);
        assert_eq!(s, vec![vec![0], vec![1], vec![2], vec![3]]);
        let s = stream_schedule(&[50, 100, 150, 200], 200, 64);
        assert_eq!(s, vec![vec![], vec![0], vec![1], vec![2, 3]]);
        let all: Vec<u64> = s.concat();
        assert_eq!(all, vec![0, 1, 2, 3], "every block exactly once");
        assert_eq!(stream_schedule(&[10], 10, 64), vec![vec![0]]);
    }
}
