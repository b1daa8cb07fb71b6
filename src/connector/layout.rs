//! The paged KV cache as the connector sees it: one registered region per layer, each
//! `planes` planes (K and V) of `num_blocks` blocks of `block_bytes` bytes, a block in the
//! HND layout `[head][token][head bytes]`; and which descriptors move a request between two
//! workers whose caches may differ in block count and in their share of the heads.

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
    /// Check that the layout can describe memory: at least one layer, no name twice,
    /// every count at least 1, whole heads and tokens in a block, and a layer size that
    /// fits an address space.
    ///
    /// # Errors
    /// The first field that is wrong, named.
    pub fn validate(&self) -> Result<(), String> {
        if self.layers.is_empty() {
            return Err("layers: no layers".into());
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(l) = self.layers.iter().find(|l| !seen.insert(l.as_str())) {
            return Err(format!("layers: {l:?} appears twice"));
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
                return Err(format!("{field}: must be at least 1"));
            }
        }
        let per_token = self.kv_heads * u64::from(self.block_size);
        if !self.block_bytes.is_multiple_of(per_token) {
            return Err(format!(
                "block_bytes: {} is not a whole number of bytes per head and token \
                 ({} heads × {} tokens)",
                self.block_bytes, self.kv_heads, self.block_size
            ));
        }
        let bytes = self
            .planes
            .checked_mul(self.num_blocks)
            .and_then(|n| n.checked_mul(self.block_bytes))
            .filter(|b| *b <= isize::MAX as u64);
        if bytes.is_none() {
            return Err(format!(
                "num_blocks: {} planes × {} blocks × {} bytes overflows a layer",
                self.planes, self.num_blocks, self.block_bytes
            ));
        }
        Ok(())
    }

    /// Bytes of one layer's region.
    pub fn layer_bytes(&self) -> u64 {
        self.planes * self.num_blocks * self.block_bytes
    }

    /// Offset of block `b` in plane `p` of a layer region.
    pub fn offset(&self, plane: u64, block: u64) -> u64 {
        (plane * self.num_blocks + block) * self.block_bytes
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
/// name), its blocks per plane and its KV heads per block (it may hold another share of the
/// heads, and another number of blocks, than we do).
pub(crate) struct PeerKv {
    pub(crate) regions: Vec<LayerAt>,
    pub(crate) num_blocks: u64,
    pub(crate) heads: u64,
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
    let mut regions = Vec::new();
    let mut num_blocks = None;
    for l in &layout.layers {
        let (r, (base, len)) = meta
            .regions
            .iter()
            .find_map(|r| r.layer_span(l).map(|s| (r, s)))
            .ok_or_else(|| format!("{peer} has no region for layer {l:?}"))?;
        let per_plane = layout.planes.max(1) * block_bytes;
        if block_bytes == 0 || len % per_plane != 0 {
            return Err(format!(
                "{peer}'s cache of layer {l:?} is {len} bytes: not whole blocks of {heads} \
                 heads × {} tokens × {} bytes in {} planes",
                g.block_size, g.head_bytes, layout.planes
            ));
        }
        let n = len / per_plane;
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
        let (bs, hb) = (g.block_size, g.head_bytes);
        let peer_block = peer.heads * bs * hb;
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
                    let rbase = rr.base + (p * peer.num_blocks + rj) * peer_block;
                    for &(from, to) in rs {
                        // a whole block: the slice's heads in one span; else a span per head
                        let (heads, per) = if from == 0 && to == bs {
                            (1, slice.count)
                        } else {
                            (slice.count, 1)
                        };
                        for h in 0..heads {
                            let at = |first: u64| ((first + h) * bs + from) * hb;
                            push_coalesced(
                                &mut l,
                                &mut r,
                                Desc::new(
                                    lr.region,
                                    lbase + at(slice.local),
                                    per * (to - from) * hb,
                                ),
                                Desc::new(
                                    rr.region,
                                    rbase + at(slice.remote),
                                    per * (to - from) * hb,
                                ),
                            );
                        }
                    }
                }
            }
        }
        Ok((l, r))
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
mod tests {
    use super::*;
    use crate::connector::tp::head_slices;

    fn layout(heads: u64, num_blocks: u64) -> KvLayout {
        KvLayout {
            layers: vec!["l0".into(), "swa1".into()],
            num_blocks,
            block_bytes: heads * 16 * 4, // heads × 16 tokens × 4 bytes
            planes: 2,
            block_size: 16,
            kv_heads: heads,
            sliding_windows: [("swa1".to_owned(), 4)].into(),
            physical_per_logical: 1,
        }
    }

    #[test]
    fn layouts_that_cannot_describe_memory_are_refused_naming_the_field() {
        assert_eq!(layout(2, 8).validate(), Ok(()));
        type Spoil = fn(&mut KvLayout);
        let cases: [(&str, Spoil); 8] = [
            ("layers: no layers", |l| l.layers.clear()),
            ("layers: \"l0\" appears twice", |l| {
                l.layers[1] = "l0".into()
            }),
            ("num_blocks: must be", |l| l.num_blocks = 0),
            ("block_size: must be", |l| l.block_size = 0),
            ("kv_heads: must be", |l| l.kv_heads = 0),
            ("planes: must be", |l| l.planes = 0),
            ("block_bytes: 129 is not", |l| l.block_bytes = 129),
            ("num_blocks: 2 planes × 9223372036854775807 blocks", |l| {
                l.num_blocks = u64::MAX / 2
            }),
        ];
        for (want, spoil) in cases {
            let mut l = layout(2, 8);
            spoil(&mut l);
            let e = l.validate().unwrap_err();
            assert!(e.starts_with(want), "{want}: {e}");
        }
    }

    fn at(ids: &[u32]) -> Vec<LayerAt> {
        ids.iter().map(|&i| LayerAt::whole(RegionId(i))).collect()
    }

    fn whole(heads: u64) -> HeadSlice {
        HeadSlice {
            peer_rank: 0,
            local: 0,
            remote: 0,
            count: heads,
        }
    }

    #[test]
    fn whole_blocks_coalesce_and_the_peer_keeps_its_own_block_count() {
        let l = layout(1, 10);
        let peer = PeerKv {
            regions: at(&[5, 6]),
            num_blocks: 20,
            heads: 1,
        };
        let sel = Select::default();
        let (a, b) = l
            .transfer_descs(&at(&[0, 1]), &[1, 2, 3], &peer, &[4, 5, 9], &whole(1), sel)
            .unwrap();
        assert_eq!(a.len(), 8, "runs cut where the remote side breaks");
        assert_eq!(a[0], Desc::new(RegionId(0), 64, 128));
        assert_eq!(b[0], Desc::new(RegionId(5), 256, 128));
        assert_eq!(b[1], Desc::new(RegionId(5), 576, 64));
        // plane 1 (V) of the peer starts after ITS 20 blocks, not our 10
        assert_eq!(a[2], Desc::new(RegionId(0), (10 + 1) * 64, 128));
        assert_eq!(b[2], Desc::new(RegionId(5), (20 + 4) * 64, 128));
        assert!(a.iter().zip(&b).all(|(x, y)| x.len == y.len));
    }

    /// Every byte of a global KV cache: (layer, plane, global head, token, byte).
    fn val(layer: usize, plane: u64, head: u64, tok: u64, i: u64) -> u8 {
        ((layer as u64 * 31 + plane * 17 + head * 13 + tok * 7 + i) % 251) as u8 | 1
    }

    /// A rank's cache (one Vec per layer) holding `toks` tokens in `blocks`.
    fn cache(l: &KvLayout, rank: u64, blocks: &[u64], toks: u64) -> Vec<Vec<u8>> {
        let g = l.geom();
        (0..l.layers.len())
            .map(|li| {
                let mut v = vec![0u8; l.layer_bytes() as usize];
                for p in 0..l.planes {
                    for (k, &b) in blocks.iter().enumerate() {
                        for h in 0..g.kv_heads {
                            for t in 0..g.block_size {
                                let tok = k as u64 * g.block_size + t;
                                if tok >= toks {
                                    continue;
                                }
                                for i in 0..g.head_bytes {
                                    let at =
                                        l.offset(p, b) + (h * g.block_size + t) * g.head_bytes + i;
                                    v[at as usize] = val(li, p, rank * g.kv_heads + h, tok, i);
                                }
                            }
                        }
                    }
                }
                v
            })
            .collect()
    }

    /// D (TP `dtp`) READs from P (TP `ptp`) with the selection; returns the bytes moved, and
    /// checks every byte D attends to: all tokens of full layers, the window's of `swa1`.
    fn pull(dtp: u32, ptp: u32, toks: u64, sel: Select) -> u64 {
        let total = 8;
        let (pl, dl) = (
            layout(total / u64::from(ptp), 40),
            layout(total / u64::from(dtp), 12),
        );
        let pblocks: Vec<u64> = (0..toks.div_ceil(16)).map(|i| 30 - 3 * i).collect();
        let dblocks: Vec<u64> = (0..toks.div_ceil(16)).map(|i| 2 + i).collect();
        let pcaches: Vec<_> = (0..u64::from(ptp))
            .map(|r| cache(&pl, r, &pblocks, toks))
            .collect();
        let mut moved = 0;
        for d in 0..dtp {
            let mut dc: Vec<Vec<u8>> = vec![vec![0xEE; dl.layer_bytes() as usize]; 2];
            let (slices, ph) = head_slices(dl.kv_heads, d, dtp, ptp).unwrap();
            for s in &slices {
                let peer = PeerKv {
                    regions: at(&[0, 1]),
                    num_blocks: 40,
                    heads: ph,
                };
                let (a, b) = dl
                    .transfer_descs(&at(&[0, 1]), &dblocks, &peer, &pblocks, s, sel)
                    .unwrap();
                for (x, y) in a.iter().zip(&b) {
                    let src = &pcaches[s.peer_rank as usize][y.region.0 as usize];
                    dc[x.region.0 as usize][x.offset as usize..(x.offset + x.len) as usize]
                        .copy_from_slice(&src[y.offset as usize..(y.offset + y.len) as usize]);
                    moved += x.len;
                }
            }
            let g = dl.geom();
            for (li, name) in dl.layers.iter().enumerate() {
                let from = match dl.sliding_windows.get(name) {
                    Some(w) if sel.swa => toks.saturating_sub(*w),
                    _ => 0,
                };
                for p in 0..2 {
                    for tok in from..toks {
                        let b = dblocks[(tok / 16) as usize];
                        for h in 0..g.kv_heads {
                            for i in 0..g.head_bytes {
                                let at = dl.offset(p, b) + (h * 16 + tok % 16) * g.head_bytes + i;
                                let want = val(li, p, u64::from(d) * g.kv_heads + h, tok, i);
                                assert_eq!(
                                    dc[li][at as usize], want,
                                    "D tp {dtp} rank {d} from P tp {ptp}: layer {li} plane {p} \
                                     token {tok} head {h}"
                                );
                            }
                        }
                    }
                }
            }
        }
        moved
    }

    #[test]
    fn block_ids_past_the_count_are_refused_not_read_from_the_next_plane() {
        let l = layout(1, 10);
        let peer = PeerKv {
            regions: at(&[5, 6]),
            num_blocks: 20,
            heads: 1,
        };
        let r = at(&[0, 1]);
        let sel = Select::default();
        let e = l
            .transfer_descs(&r, &[1], &peer, &[20], &whole(1), sel)
            .unwrap_err();
        assert!(e.contains("20 (of 20) at the peer"), "{e}");
        let e = l
            .transfer_descs(&r, &[10], &peer, &[3], &whole(1), sel)
            .unwrap_err();
        assert!(e.contains("block 10 (of 10) here"), "{e}");
        assert!(l
            .transfer_descs(&r, &[9], &peer, &[19], &whole(1), sel)
            .is_ok());
    }

    #[test]
    fn every_tp_pairing_gives_d_every_byte_of_its_heads() {
        let full = pull(
            1,
            1,
            70,
            Select {
                tokens: 70,
                ..Select::default()
            },
        );
        assert_eq!(
            full,
            2 * 2 * 5 * 8 * 16 * 4,
            "5 whole blocks of 8 heads, 2 layers, K and V"
        );
        for (dtp, ptp) in [(2, 1), (1, 2), (4, 2), (2, 4), (8, 1), (1, 8), (2, 2)] {
            assert_eq!(
                pull(
                    dtp,
                    ptp,
                    70,
                    Select {
                        tokens: 70,
                        ..Select::default()
                    }
                ),
                full
            );
        }
    }

    #[test]
    fn chunk_and_window_modes_move_less_and_keep_the_bytes_d_uses() {
        let base = Select {
            tokens: 70,
            ..Select::default()
        };
        let full = pull(1, 1, 70, base);
        // 70 tokens: the last block holds 6; chunk 4 → 8 of its 16 tokens go
        let chunked = pull(
            1,
            1,
            70,
            Select {
                chunk: Some(4),
                ..base
            },
        );
        assert_eq!(full - chunked, 2 * 2 * 8 * 8 * 4);
        // window 4 on swa1: 70 tokens → tokens 66..70 sit in granules 16 and 17 (64..72)
        let swa = pull(1, 1, 70, Select { swa: true, ..base });
        assert_eq!(
            swa,
            full / 2 + 2 * 8 * 8 * 4,
            "full l0 + two 4-token granules of swa1"
        );
        for (dtp, ptp) in [(2, 1), (1, 2), (4, 2)] {
            let both = Select {
                chunk: Some(4),
                swa: true,
                ..base
            };
            assert!(pull(dtp, ptp, 70, both) < full);
        }
        let bad = KvLayout {
            sliding_windows: [("swa1".to_owned(), 5)].into(),
            ..layout(1, 4)
        };
        let peer = PeerKv {
            regions: at(&[0, 1]),
            num_blocks: 4,
            heads: 1,
        };
        let e = bad
            .transfer_descs(
                &at(&[0, 1]),
                &[0],
                &peer,
                &[0],
                &whole(1),
                Select {
                    swa: true,
                    tokens: 3,
                    ..Select::default()
                },
            )
            .unwrap_err();
        assert!(e.contains("swa1") && e.contains("window (5)"), "{e}");
    }
}
