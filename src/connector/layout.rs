//! The paged KV cache as the connector sees it: per layer, `planes` planes of `num_blocks`
//! blocks of `block_bytes` bytes each, `block_stride` apart (blocks back to back, or with
//! other layers' blocks between them), a block's bytes ordered HND `[head][token][bytes]`,
//! NHD `[token][head][bytes]` or packed (whole blocks only); and which descriptors move a
//! request between two workers whose caches may differ in block count and in their share
//! of the heads.
//!
//! How an engine's layouts map onto it (vLLM 0.32's per-layer views are `[B, H, N, C]`
//! with K and V in C, laid out by its `KVCacheLayout`): LBHNC is one plane, HND; LBNHC one
//! plane, NHD; BLHNC / BLNHC the same with `block_stride` = the layers' pages per block;
//! LHBNC has the heads outside the blocks: a plane per head. Older vLLMs' FlashAttention
//! `[2, B, N, H, D]` is two planes (K, V), NHD (HND when permuted); FlashInfer's
//! `[B, 2, N, H, D]` one packed plane; MLA `[B, N, C]` one plane of one head.

use std::collections::BTreeMap;

use super::tp::HeadSlice;
use crate::agent::{Agent, Desc, RegionId};
use crate::proto::select::{full_attention_ranges, window_ranges, BlockGeom, BlockRanges};

/// The shape of one worker's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Layer names, in region order (they travel in the handshake for PP routing).
    pub layers: Vec<String>,
    /// Blocks per layer.
    pub num_blocks: u64,
    /// Bytes of one block in one plane (`kv_heads × block_size × head_size × dtype bytes`).
    pub block_bytes: u64,
    /// Planes per layer (2: K and V).
    pub planes: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads in a block (HND: `[head][token][head bytes]`); 1 when unknown.
    #[serde(default = "one")]
    pub kv_heads: u64,
    /// Sliding-window layers: layer name → window (tokens). With `swa_window_mode` only the
    /// window of these layers moves.
    #[serde(default)]
    pub sliding_windows: BTreeMap<String, u64>,
    /// Physical blocks (of `block_size` tokens, what `num_blocks` counts) per logical block
    /// (what the engine's scheduler names): logical id `l` is physical `l*r .. l*r + r`.
    #[serde(default = "one")]
    pub physical_per_logical: u64,
    /// Bytes from a block's first byte to the next block's in a plane (0: `block_bytes`,
    /// blocks back to back). Larger where other layers' blocks lie between (a block-outer
    /// layout); then planes lie `num_blocks × block_stride` apart.
    #[serde(default)]
    pub block_stride: u64,
    /// How a block's bytes are ordered.
    #[serde(default)]
    pub inner: BlockOrder,
}

/// The order of a block's bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BlockOrder {
    /// `[head][token][head bytes]`: a head's tokens are contiguous.
    #[default]
    #[serde(rename = "HND")]
    Hnd,
    /// `[token][head][head bytes]`: a token's heads are contiguous.
    #[serde(rename = "NHD")]
    Nhd,
    /// Heads outermost, each head's bytes whole but in an order of the kernel's own (vLLM's
    /// CPU backend keeps a head's keys, then its values, in an ISA-specific arrangement):
    /// a share of the heads moves, a share of the tokens does not.
    #[serde(rename = "heads")]
    Heads,
    /// Neither (K and V interleaved inside the block, say): only whole blocks of every head
    /// move.
    #[serde(rename = "packed")]
    Packed,
}

impl BlockOrder {
    /// The name the handshake carries (`HND`, `NHD`, `heads`, `packed`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Hnd => "HND",
            Self::Nhd => "NHD",
            Self::Heads => "heads",
            Self::Packed => "packed",
        }
    }
}

/// Logical block ids as physical ones, `r` per logical block.
pub(crate) fn physical(ids: &[u64], r: u64) -> Vec<u64> {
    let r = r.max(1);
    ids.iter()
        .flat_map(|&l| (0..r).map(move |i| l * r + i))
        .collect()
}

fn one() -> u64 {
    1
}

impl KvLayout {
    /// The layout the handshake compares: the order of a block's bytes and its planes
    /// (`HND/2-plane`: K and V each a plane of `[head][token][bytes]`). The heads per block
    /// are not in it: TP sizes may differ.
    pub fn handshake_name(&self) -> String {
        format!("{}/{}-plane", self.inner.name(), self.planes)
    }

    /// Check that the layout can describe memory: at least one layer, no name twice,
    /// every count at least 1, whole heads and tokens in a block, and a layer size that
    /// fits an address space.
    ///
    /// # Errors
    /// The first field that is wrong, named.
    pub fn validate(&self) -> Result<(), LayoutError> {
        if self.layers.is_empty() {
            return Err(LayoutError::new("layers", "no layers".into()));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(l) = self.layers.iter().find(|l| !seen.insert(l.as_str())) {
            return Err(LayoutError::new("layers", format!("{l:?} appears twice")));
        }
        for (field, v) in [
            ("num_blocks", self.num_blocks),
            ("block_bytes", self.block_bytes),
            ("planes", self.planes),
            ("block_size", u64::from(self.block_size)),
            ("kv_heads", self.kv_heads),
            ("physical_per_logical", self.physical_per_logical),
        ] {
            if v == 0 {
                return Err(LayoutError::new(field, "must be at least 1".into()));
            }
        }
        let per_token = self.kv_heads * u64::from(self.block_size);
        if !self.block_bytes.is_multiple_of(per_token) {
            return Err(LayoutError::new(
                "block_bytes",
                format!(
                    "{} is not a whole number of bytes per head and token ({} heads × {} tokens)",
                    self.block_bytes, self.kv_heads, self.block_size
                ),
            ));
        }
        if self.block_stride != 0 && self.block_stride < self.block_bytes {
            return Err(LayoutError::new(
                "block_stride",
                format!(
                    "{} is less than a block ({} bytes): blocks would overlap",
                    self.block_stride, self.block_bytes
                ),
            ));
        }
        let bytes = self
            .planes
            .checked_mul(self.num_blocks)
            .and_then(|n| n.checked_mul(self.stride()))
            .filter(|b| *b <= isize::MAX as u64);
        if bytes.is_none() {
            return Err(LayoutError::new(
                "num_blocks",
                format!(
                    "{} planes × {} blocks × {} bytes overflows a layer",
                    self.planes, self.num_blocks, self.block_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Bytes from a block to the next one in a plane.
    pub fn stride(&self) -> u64 {
        if self.block_stride == 0 {
            self.block_bytes
        } else {
            self.block_stride
        }
    }

    /// Bytes of one layer's span: from its first block's first byte to its last block's
    /// last byte (with blocks back to back, the whole of its planes).
    pub fn layer_bytes(&self) -> u64 {
        (self.planes * self.num_blocks - 1) * self.stride() + self.block_bytes
    }

    /// Offset of block `b` in plane `p` from the layer's first byte.
    pub fn offset(&self, plane: u64, block: u64) -> u64 {
        (plane * self.num_blocks + block) * self.stride()
    }

    /// True when blocks lie back to back (no other layer's bytes between them).
    pub fn dense(&self) -> bool {
        self.stride() == self.block_bytes
    }
}

/// Where one layer's cache lies: a region, and the layer's first byte in it (0 for a region
/// per layer; the layer's offset in a pooled allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerAt {
    pub(crate) region: RegionId,
    pub(crate) base: u64,
}

impl LayerAt {
    /// A whole region holding one layer.
    pub(crate) fn whole(region: RegionId) -> Self {
        Self { region, base: 0 }
    }
}

/// Where a peer worker keeps our layers: its regions (in our layer order, found by layer
/// name), its blocks per plane, its KV heads per block (it may hold another share of the
/// heads, and another number of blocks, than we do) and the bytes from one of its blocks to
/// the next.
pub(crate) struct PeerKv {
    pub(crate) regions: Vec<LayerAt>,
    pub(crate) num_blocks: u64,
    pub(crate) heads: u64,
    pub(crate) stride: u64,
}

/// `peer`'s KV for our layers, from the metadata loaded from it (pipeline-parallel routing:
/// region indexes may differ between the sides), when it holds `heads` heads per block.
pub(crate) fn peer_kv(
    agent: &Agent,
    peer: &str,
    layout: &KvLayout,
    heads: u64,
) -> Result<PeerKv, String> {
    let meta = agent
        .remote_metadata(peer)
        .ok_or_else(|| format!("no metadata for {peer}"))?;
    let g = layout.geom();
    let block_bytes = heads * g.block_size * g.head_bytes;
    // blocks back to back stay so at any share of the heads; with other layers' blocks
    // between them, the peer's pages are ours (the same share: checked by the caller)
    let stride = if layout.dense() {
        block_bytes
    } else if heads == layout.kv_heads.max(1) {
        layout.stride()
    } else {
        return Err(format!(
            "{peer} holds {heads} heads a block where this worker holds {}: a block-outer \
             layout (block_stride {}) moves whole pages only",
            layout.kv_heads,
            layout.stride()
        ));
    };
    let mut regions = Vec::new();
    let mut num_blocks = None;
    for l in &layout.layers {
        let (r, (base, len)) = meta
            .regions
            .iter()
            .find_map(|r| r.layer_span(l).map(|s| (r, s)))
            .ok_or_else(|| format!("{peer} has no region for layer {l:?}"))?;
        // a span is (planes × blocks − 1) strides and a block
        let spans = len
            .checked_sub(block_bytes)
            .filter(|n| block_bytes > 0 && n % stride == 0)
            .map(|n| n / stride + 1)
            .filter(|n| n % layout.planes.max(1) == 0);
        let Some(spans) = spans else {
            return Err(format!(
                "{peer}'s cache of layer {l:?} is {len} bytes: not whole blocks of {heads} \
                 heads × {} tokens × {} bytes, {stride} bytes apart, in {} planes",
                g.block_size, g.head_bytes, layout.planes
            ));
        };
        let n = spans / layout.planes.max(1);
        if num_blocks.is_some_and(|m| m != n) {
            return Err(format!("{peer}'s layer regions differ in size"));
        }
        num_blocks = Some(n);
        regions.push(LayerAt {
            region: RegionId(r.id),
            base,
        });
    }
    Ok(PeerKv {
        regions,
        num_blocks: num_blocks.unwrap_or(0),
        heads,
        stride,
    })
}

/// What of a request moves: its prompt `tokens` (0: unknown, whole blocks), `chunk_mode`'s
/// chunk, whether `swa_window_mode` cuts the sliding-window layers, and where the block
/// lists sit in the request.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Select {
    pub(crate) tokens: u64,
    pub(crate) chunk: Option<u64>,
    pub(crate) swa: bool,
    /// The request block index of the first pair when the two lists are paired explicitly
    /// (a streamed part of a request); None: the lists are aligned at the request's end.
    pub(crate) first: Option<u64>,
}

impl KvLayout {
    /// One block's geometry, for choosing token spans.
    pub fn geom(&self) -> BlockGeom {
        let heads = self.kv_heads.max(1);
        BlockGeom {
            kv_heads: heads,
            block_size: u64::from(self.block_size.max(1)),
            head_bytes: self.block_bytes / heads / u64::from(self.block_size.max(1)),
        }
    }

    /// P's blocks that hold the prompt: P's list starts at the prompt's first token, so the
    /// blocks past `tokens` (one an engine allocated for the sampled token, say) hold none
    /// and must not take part in aligning the lists. All of them when `tokens` is 0
    /// (unknown).
    pub(crate) fn prompt_blocks<'a>(&self, p_blocks: &'a [u64], tokens: u64) -> &'a [u64] {
        if tokens == 0 {
            return p_blocks;
        }
        let n = tokens.div_ceil(u64::from(self.block_size.max(1))) as usize;
        &p_blocks[..n.min(p_blocks.len())]
    }

    /// The token ranges of each request block that move for layer `layer`.
    fn ranges(&self, layer: &str, nblocks: u64, sel: Select) -> Result<BlockRanges, String> {
        let bs = u64::from(self.block_size.max(1));
        if sel.tokens == 0 {
            return Ok((0..nblocks).map(|b| (b, vec![(0, bs)])).collect());
        }
        match self.sliding_windows.get(layer).filter(|_| sel.swa) {
            Some(&w) => {
                window_ranges(bs, sel.tokens, w).map_err(|e| format!("layer {layer:?}: {e}"))
            }
            None => Ok(full_attention_ranges(bs, sel.tokens, sel.chunk)),
        }
    }

    /// The paired descriptors (ours, the peer's; same count, same lengths) that move a
    /// request between our `local` blocks and the peer's `remote` blocks: the heads of
    /// `slice`, and of each layer only the token ranges the selection keeps. The two block
    /// lists are aligned at their ends (one side may hold a prefix already); adjacent spans
    /// contiguous on both sides coalesce into one descriptor.
    ///
    /// # Errors
    /// A sliding window the block size does not suit; a block id past either side's count.
    pub(crate) fn transfer_descs(
        &self,
        local_regions: &[LayerAt],
        local: &[u64],
        peer: &PeerKv,
        remote: &[u64],
        slice: &HeadSlice,
        sel: Select,
    ) -> Result<(Vec<Desc>, Vec<Desc>), String> {
        let g = self.geom();
        let bs = g.block_size;
        let m = local.len().min(remote.len()) as u64;
        let nblocks = if sel.tokens == 0 {
            sel.first.unwrap_or(0) + m
        } else {
            sel.tokens.div_ceil(bs)
        };
        // request block k is pair k - shift
        let shift = match sel.first {
            Some(f) => i128::from(f),
            None => i128::from(nblocks) - i128::from(m),
        };
        let (mut l, mut r): (Vec<Desc>, Vec<Desc>) = (Vec::new(), Vec::new());
        for (i, layer) in self.layers.iter().enumerate() {
            let (Some(&lr), Some(&rr)) = (local_regions.get(i), peer.regions.get(i)) else {
                continue;
            };
            let ranges = self.ranges(layer, nblocks, sel)?;
            for p in 0..self.planes {
                for (k, rs) in &ranges {
                    let j = i128::from(*k) - shift;
                    if j < 0 || j >= i128::from(m) {
                        continue;
                    }
                    let j = j as u64;
                    let (lj, rj) = (
                        local[local.len() - m as usize + j as usize],
                        remote[remote.len() - m as usize + j as usize],
                    );
                    if lj >= self.num_blocks || rj >= peer.num_blocks {
                        // inside the region, a block id past the count would address the
                        // next plane: refuse it rather than move the wrong bytes
                        return Err(format!(
                            "block {lj} (of {}) here or {rj} (of {}) at the peer is out of range",
                            self.num_blocks, peer.num_blocks
                        ));
                    }
                    let lbase = lr.base + self.offset(p, lj);
                    let rbase = rr.base + (p * peer.num_blocks + rj) * peer.stride;
                    for &(from, to) in rs {
                        for (at_l, at_r, len) in self.spans(slice, (peer.heads, from, to))? {
                            push_coalesced(
                                &mut l,
                                &mut r,
                                Desc::new(lr.region, lbase + at_l, len),
                                Desc::new(rr.region, rbase + at_r, len),
                            );
                        }
                    }
                }
            }
        }
        Ok((l, r))
    }
}

impl KvLayout {
    /// The byte spans (offset here, offset at the peer, length) inside one block that hold
    /// tokens `from..to` of `slice`'s heads, where the peer's blocks hold `peer_heads` heads.
    fn spans(
        &self,
        slice: &HeadSlice,
        (peer_heads, from, to): (u64, u64, u64),
    ) -> Result<Vec<(u64, u64, u64)>, String> {
        let g = self.geom();
        let (bs, hb, heads) = (g.block_size, g.head_bytes, g.kv_heads);
        let whole_tokens = from == 0 && to == bs;
        let all_heads = slice.count == heads && peer_heads == heads;
        Ok(match self.inner {
            // a whole block: the slice's heads in one span; else a span per head
            BlockOrder::Hnd | BlockOrder::Heads if whole_tokens => vec![(
                slice.local * bs * hb,
                slice.remote * bs * hb,
                slice.count * bs * hb,
            )],
            BlockOrder::Hnd => (0..slice.count)
                .map(|h| {
                    let at = |first: u64| ((first + h) * bs + from) * hb;
                    (at(slice.local), at(slice.remote), (to - from) * hb)
                })
                .collect(),
            // every head: the tokens in one span; else a span per token
            BlockOrder::Nhd if all_heads => {
                vec![(
                    from * heads * hb,
                    from * heads * hb,
                    (to - from) * heads * hb,
                )]
            }
            BlockOrder::Nhd => (from..to)
                .map(|t| {
                    (
                        (t * heads + slice.local) * hb,
                        (t * peer_heads + slice.remote) * hb,
                        slice.count * hb,
                    )
                })
                .collect(),
            BlockOrder::Packed if whole_tokens && all_heads => vec![(0, 0, self.block_bytes)],
            BlockOrder::Packed => {
                return Err(format!(
                    "a packed block layout moves whole blocks of every head: not tokens \
                     {from}..{to} of {} of {heads} heads (chunk_mode, swa_window_mode and \
                     a TP size that differs from the peer's need HND or NHD blocks)",
                    slice.count
                ))
            }
            BlockOrder::Heads => {
                return Err(format!(
                    "this backend keeps a head's tokens in an order of its own: whole blocks \
                     move, not tokens {from}..{to} (chunk_mode and swa_window_mode need HND or \
                     NHD blocks)"
                ))
            }
        })
    }
}

/// Append a descriptor pair, merging it into the last pair when it continues both.
fn push_coalesced(l: &mut Vec<Desc>, r: &mut Vec<Desc>, a: Desc, b: Desc) {
    if let (Some(la), Some(lb)) = (l.last_mut(), r.last_mut()) {
        if la.region == a.region
            && lb.region == b.region
            && la.offset + la.len == a.offset
            && lb.offset + lb.len == b.offset
        {
            la.len += a.len;
            lb.len += b.len;
            return;
        }
    }
    l.push(a);
    r.push(b);
}

#[cfg(test)]
mod tests;

/// A KV layout that cannot describe memory: the field that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct LayoutError {
    /// The layout's field (`layers`, `num_blocks`, `block_bytes`, …).
    pub field: &'static str,
    /// What is wrong with it.
    pub why: String,
}

impl LayoutError {
    fn new(field: &'static str, why: String) -> Self {
        Self { field, why }
    }
}
