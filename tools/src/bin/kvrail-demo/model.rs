//! The fake model: deterministic KV from token ids, layer, plane (K/V), head and dimension,
//! written into (and checked in) a real paged KV cache in the HND block layout:
//! block = `[head][token in block][dim]` of fp16, one plane for K and one for V per layer.

use kvrail::connector::{BlockOrder, KvLayout};

/// The model's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) layers: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_size: usize,
    pub(crate) block_size: usize,
    pub(crate) num_blocks: u64,
    /// Sliding window (tokens) of the odd layers, when the model has one.
    pub(crate) window: Option<usize>,
}

impl Shape {
    pub(crate) fn layout(&self) -> KvLayout {
        KvLayout {
            layers: (0..self.layers)
                .map(|i| format!("model.layers.{i}.self_attn"))
                .collect(),
            num_blocks: self.num_blocks,
            block_bytes: (self.kv_heads * self.block_size * self.head_size * 2) as u64,
            planes: 2,
            block_size: self.block_size as u32,
            kv_heads: self.kv_heads as u64,
            sliding_windows: self
                .window
                .map(|w| {
                    (0..self.layers)
                        .filter(|l| l % 2 == 1)
                        .map(|l| (format!("model.layers.{l}.self_attn"), w as u64))
                        .collect()
                })
                .unwrap_or_default(),
            physical_per_logical: 1,
            block_stride: 0,
            inner: BlockOrder::Hnd,
        }
    }

    /// The first token of `layer` that attention reads for a prompt of `n` tokens: 0, or
    /// the window's start on a sliding-window layer.
    pub(crate) fn first_attended(&self, layer: usize, n: u64) -> u64 {
        match self.window {
            Some(w) if layer % 2 == 1 => n.saturating_sub(w as u64),
            _ => 0,
        }
    }
}

/// The prompt's token ids (from the request id and length; the proxy sends both legs the
/// same ones).
pub(crate) fn tokens(seed: u64, n: u64) -> Vec<u32> {
    (0..n)
        .map(|i| {
            let x =
                (seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            (x >> 47) as u32 % 151_936
        })
        .collect()
}

/// One fp16 value of the KV of `token` at (layer, plane, head, dim): a pure function.
#[inline]
fn value(token: u32, pos: u64, layer: usize, plane: u64, head: usize, dim: usize) -> [u8; 2] {
    let x = u64::from(token).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ pos.rotate_left(7)
        ^ ((layer as u64) << 48)
        ^ (plane << 44)
        ^ ((head as u64) << 32)
        ^ (dim as u64);
    let h = x.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 40;
    (h as u16).to_le_bytes()
}

/// The bytes of block `bi` (the request's `bi`-th block) of `layer`'s `plane`: the tokens it
/// holds, zeros after the prompt's end.
pub(crate) fn block(shape: &Shape, toks: &[u32], layer: usize, plane: u64, bi: usize) -> Vec<u8> {
    let mut out = vec![0u8; shape.kv_heads * shape.block_size * shape.head_size * 2];
    for h in 0..shape.kv_heads {
        for t in 0..shape.block_size {
            let pos = bi * shape.block_size + t;
            let Some(&tok) = toks.get(pos) else {
                continue;
            };
            for d in 0..shape.head_size {
                let at = ((h * shape.block_size + t) * shape.head_size + d) * 2;
                out[at..at + 2].copy_from_slice(&value(tok, pos as u64, layer, plane, h, d));
            }
        }
    }
    out
}
