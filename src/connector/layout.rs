//! The paged KV cache as the connector sees it: one registered region per layer, each
//! `planes` planes (K and V) of `num_blocks` blocks of `block_bytes` bytes. Block `b` of a
//! layer is one descriptor per plane.

use crate::agent::{Agent, Desc, RegionId};

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
}
