//! Tensor parallelism across the pair (SPEC §3, heterogeneous TP): each worker holds a
//! contiguous share of the KV heads (rank `r` of `tp` holds heads `[r·h, (r+1)·h)`), so a
//! worker exchanges with every peer rank whose share overlaps its own, one head slice each.
//! With P TP 2 and D TP 4, D rank 1 reads the second half of P rank 0's heads; with P TP 4
//! and D TP 2, D rank 1 reads P ranks 2 and 3 whole, into the two halves of its blocks.
//!
//! Each rank is its own agent: rank 0 carries the engine id, rank `k` is `<engine>#tp<k>`
//! (see [`rank_agent_name`]), listening on the side-channel port the engine advertises for
//! it.

/// The agent name of rank `rank` of engine `engine`: the engine id for rank 0 (a TP-1
/// engine is addressed by its engine id alone), `<engine>#tp<rank>` otherwise.
pub fn rank_agent_name(engine: &str, rank: u32) -> String {
    if rank == 0 {
        engine.to_owned()
    } else {
        format!("{engine}#tp{rank}")
    }
}

/// The heads one worker shares with one peer rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSlice {
    /// The peer's rank.
    pub peer_rank: u32,
    /// First shared head, as an index into this worker's blocks.
    pub local: u64,
    /// First shared head, as an index into the peer's blocks.
    pub remote: u64,
    /// Shared heads.
    pub count: u64,
}

/// A TP rank whose heads cannot be paired with a peer's ranks ([`head_slices`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TpSplitError {
    /// The rank is not below the TP size.
    #[error("tp rank {rank} is not below tp size {tp}")]
    Rank {
        /// The rank.
        rank: u32,
        /// The TP size.
        tp: u64,
    },
    /// The engine's KV heads do not split evenly over the peer's TP.
    #[error(
        "{} KV heads ({heads} per rank × TP {tp}) do not split over the peer's TP {peer_tp}",
        heads * tp
    )]
    Uneven {
        /// KV heads per rank here.
        heads: u64,
        /// TP here.
        tp: u64,
        /// The peer's TP.
        peer_tp: u64,
    },
}

/// The peer ranks a worker of rank `rank` of `tp` (holding `heads` KV heads per block)
/// exchanges with when the peer runs TP `peer_tp`, and the head slice of each; and the
/// peer's heads per block.
///
/// # Errors
/// [`TpSplitError`]: the rank is out of range, or the engine's KV heads do not split evenly
/// over the peer's TP.
pub fn head_slices(
    heads: u64,
    rank: u32,
    tp: u32,
    peer_tp: u32,
) -> Result<(Vec<HeadSlice>, u64), TpSplitError> {
    let (tp, peer_tp) = (u64::from(tp.max(1)), u64::from(peer_tp.max(1)));
    if u64::from(rank) >= tp {
        return Err(TpSplitError::Rank { rank, tp });
    }
    let total = heads * tp;
    if heads == 0 || !total.is_multiple_of(peer_tp) {
        return Err(TpSplitError::Uneven { heads, tp, peer_tp });
    }
    let peer_heads = total / peer_tp;
    let (lo, hi) = (u64::from(rank) * heads, (u64::from(rank) + 1) * heads);
    let slices = (0..peer_tp)
        .filter_map(|p| {
            let (plo, phi) = (p * peer_heads, (p + 1) * peer_heads);
            let (a, b) = (lo.max(plo), hi.min(phi));
            (a < b).then(|| HeadSlice {
                peer_rank: p as u32,
                local: a - lo,
                remote: a - plo,
                count: b - a,
            })
        })
        .collect();
    Ok((slices, peer_heads))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(peer_rank: u32, local: u64, remote: u64, count: u64) -> HeadSlice {
        HeadSlice {
            peer_rank,
            local,
            remote,
            count,
        }
    }

    #[test]
    fn slices_cover_every_head_exactly_once_both_ways() {
        // 8 heads in all; D TP 4 (2 heads each) reading from P TP 2 (4 heads each)
        assert_eq!(head_slices(2, 1, 4, 2).unwrap(), (vec![s(0, 0, 2, 2)], 4));
        assert_eq!(head_slices(2, 2, 4, 2).unwrap(), (vec![s(1, 0, 0, 2)], 4));
        // D TP 2 (4 heads each) reading from P TP 4 (2 heads each)
        assert_eq!(
            head_slices(4, 1, 2, 4).unwrap(),
            (vec![s(2, 0, 0, 2), s(3, 2, 0, 2)], 2)
        );
        // equal TP: rank to rank, whole blocks
        assert_eq!(head_slices(8, 0, 1, 1).unwrap(), (vec![s(0, 0, 0, 8)], 8));
        // every (rank, head) of either side is covered once, for all power-of-two pairs
        for (tp, ptp) in [(1u32, 2u32), (2, 1), (1, 8), (8, 1), (2, 4), (4, 2), (2, 2)] {
            let heads = 8 / u64::from(tp);
            let mut seen = vec![0; 8];
            for r in 0..tp {
                let (v, ph) = head_slices(heads, r, tp, ptp).unwrap();
                for x in v {
                    for h in 0..x.count {
                        let global = u64::from(r) * heads + x.local + h;
                        assert_eq!(global, u64::from(x.peer_rank) * ph + x.remote + h);
                        seen[global as usize] += 1;
                    }
                }
            }
            assert_eq!(seen, vec![1; 8], "tp {tp} peer {ptp}");
        }
    }

    #[test]
    fn uneven_splits_and_bad_ranks_are_errors() {
        assert!(head_slices(3, 0, 1, 2)
            .unwrap_err()
            .to_string()
            .contains("3 KV heads"));
        assert_eq!(
            head_slices(2, 2, 2, 1).unwrap_err(),
            TpSplitError::Rank { rank: 2, tp: 2 }
        );
        assert_eq!(rank_agent_name("p", 0), "p");
        assert_eq!(rank_agent_name("p", 3), "p#tp3");
    }
}
