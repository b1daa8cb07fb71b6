//! The paged KV cache as the connector sees it: one registered region per layer, each
//! `planes` planes (K and V) of `num_blocks` blocks of `block_bytes` bytes. Block `b` of a
//! layer is one descriptor per plane.

use crate::agent::{Agent, Desc, RegionId};
use crate::proto::select::BlockGeom;

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
}

fn one() -> u64 {
    1
}

impl KvLayout {
    /// Bytes of one layer's region.
    pub fn layer_bytes(&self) -> u64 {
        self.planes * self.num_blocks * self.block_bytes
    }

    /// Offset of block `b` in plane `p` of a layer region.
    pub fn offset(&self, plane: u64, block: u64) -> u64 {
        (plane * self.num_blocks + block) * self.block_bytes
    }

    /// Descriptors for `blocks` in every layer: for each layer, plane, block (in that order),
    /// with `regions[i]` the region of layer `i`. Consecutive blocks coalesce into one
    /// descriptor.
    pub fn descs(&self, regions: &[RegionId], blocks: &[u64]) -> Vec<Desc> {
        let mut out = Vec::new();
        for &r in regions {
            for p in 0..self.planes {
                let mut i = 0;
                while i < blocks.len() {
                    let mut j = i + 1;
                    while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                        j += 1;
                    }
                    out.push(Desc::new(
                        r,
                        self.offset(p, blocks[i]),
                        (j - i) as u64 * self.block_bytes,
                    ));
                    i = j;
                }
            }
        }
        out
    }

    /// Like [`KvLayout::descs`], pairing local `a` with remote `b` (same count): runs are
    /// cut where either side's block ids stop being consecutive, so the two lists match
    /// descriptor for descriptor.
    pub fn paired_descs(
        &self,
        local_regions: &[RegionId],
        local: &[u64],
        remote_regions: &[RegionId],
        remote: &[u64],
    ) -> (Vec<Desc>, Vec<Desc>) {
        let n = local.len().min(remote.len());
        let (mut l, mut r) = (Vec::new(), Vec::new());
        for (lr, rr) in local_regions.iter().zip(remote_regions) {
            for p in 0..self.planes {
                let mut i = 0;
                while i < n {
                    let mut j = i + 1;
                    while j < n && local[j] == local[j - 1] + 1 && remote[j] == remote[j - 1] + 1 {
                        j += 1;
                    }
                    let len = (j - i) as u64 * self.block_bytes;
                    l.push(Desc::new(*lr, self.offset(p, local[i]), len));
                    r.push(Desc::new(*rr, self.offset(p, remote[i]), len));
                    i = j;
                }
            }
        }
        (l, r)
    }
}

/// `engine`'s regions for our layers, in our layer order, found by layer name in the metadata
/// loaded from it (pipeline-parallel routing: region indexes may differ between the sides).
pub(crate) fn remote_regions(
    agent: &Agent,
    engine: &str,
    layout: &KvLayout,
) -> Result<Vec<RegionId>, String> {
    let meta = agent
        .remote_metadata(engine)
        .ok_or_else(|| format!("no metadata for {engine}"))?;
    layout
        .layers
        .iter()
        .map(|l| {
            meta.regions
                .iter()
                .find(|r| r.layers.contains(l))
                .map(|r| RegionId(r.id))
                .ok_or_else(|| format!("{engine} has no region for layer {l:?}"))
        })
        .collect()
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

    /// Like [`KvLayout::paired_descs`] for a request of `tokens` tokens whose last blocks are
    /// the last of both lists. With `chunk` (`chunk_mode`), the request's last block, when
    /// partly filled, moves only up to the end of the chunk holding its last token (one span
    /// per head); every other block moves whole.
    pub fn request_descs(
        &self,
        local_regions: &[RegionId],
        local: &[u64],
        remote_regions: &[RegionId],
        remote: &[u64],
        tokens: u64,
        chunk: Option<u64>,
    ) -> (Vec<Desc>, Vec<Desc>) {
        let g = self.geom();
        let n = local.len().min(remote.len());
        let in_last =
            tokens.saturating_sub((tokens.div_ceil(g.block_size).max(1) - 1) * g.block_size);
        let partial = chunk.filter(|_| n > 0 && in_last > 0 && in_last < g.block_size);
        let Some(c) = partial else {
            return self.paired_descs(local_regions, local, remote_regions, remote);
        };
        let (mut l, mut r) = self.paired_descs(
            local_regions,
            &local[..n - 1],
            remote_regions,
            &remote[..n - 1],
        );
        let to = (in_last.div_ceil(c.max(1)) * c.max(1)).min(g.block_size);
        let spans = g.token_spans(0, to);
        for (lr, rr) in local_regions.iter().zip(remote_regions) {
            for p in 0..self.planes {
                let (lb, rb) = (self.offset(p, local[n - 1]), self.offset(p, remote[n - 1]));
                for s in &spans {
                    l.push(Desc::new(*lr, lb + s.offset, s.len));
                    r.push(Desc::new(*rr, rb + s.offset, s.len));
                }
            }
        }
        (l, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_coalesce_runs_on_both_sides() {
        let l = KvLayout {
            layers: vec!["l0".into(), "l1".into()],
            num_blocks: 10,
            block_bytes: 100,
            planes: 2,
            block_size: 16,
            kv_heads: 1,
        };
        assert_eq!(l.layer_bytes(), 2000);
        let d = l.descs(&[RegionId(0)], &[1, 2, 3, 7]);
        assert_eq!(
            d,
            vec![
                Desc::new(RegionId(0), 100, 300),
                Desc::new(RegionId(0), 700, 100),
                Desc::new(RegionId(0), 1100, 300),
                Desc::new(RegionId(0), 1700, 100)
            ]
        );
        let (a, b) = l.paired_descs(
            &[RegionId(0), RegionId(1)],
            &[1, 2, 3],
            &[RegionId(5), RegionId(6)],
            &[4, 5, 9],
        );
        assert_eq!(
            a.len(),
            8,
            "runs cut where the remote side breaks: 2 per plane per layer"
        );
        assert_eq!(a[0], Desc::new(RegionId(0), 100, 200));
        assert_eq!(b[0], Desc::new(RegionId(5), 400, 200));
        assert_eq!(b[1], Desc::new(RegionId(5), 900, 100));
        assert!(a.iter().zip(&b).all(|(x, y)| x.len == y.len));
    }

    #[test]
    fn chunk_mode_cuts_only_a_partly_filled_last_block() {
        let l = KvLayout {
            layers: vec!["l0".into()],
            num_blocks: 10,
            block_bytes: 2 * 16 * 4, // 2 heads x 16 tokens x 4 bytes
            planes: 1,
            block_size: 16,
            kv_heads: 2,
        };
        let r = [RegionId(0)];
        // 35 tokens: blocks 0, 1 full; block 2 holds 3 tokens -> chunk 4 -> 4 tokens per head
        let (a, b) = l.request_descs(&r, &[1, 2, 3], &r, &[5, 6, 7], 35, Some(4));
        assert_eq!(
            a[0],
            Desc::new(RegionId(0), 128, 256),
            "the full blocks as one run"
        );
        assert_eq!(
            &a[1..],
            &[
                Desc::new(RegionId(0), 384, 16),
                Desc::new(RegionId(0), 448, 16)
            ]
        );
        assert_eq!(
            &b[1..],
            &[
                Desc::new(RegionId(0), 896, 16),
                Desc::new(RegionId(0), 960, 16)
            ]
        );
        // a full last block, or no chunk mode: whole blocks
        assert_eq!(
            l.request_descs(&r, &[1, 2], &r, &[5, 6], 32, Some(4))
                .0
                .len(),
            1
        );
        assert_eq!(
            l.request_descs(&r, &[1, 2, 3], &r, &[5, 6, 7], 35, None)
                .0
                .len(),
            1
        );
    }
}
