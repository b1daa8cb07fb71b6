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
        block_stride: 0,
        inner: BlockOrder::Hnd,
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
        let e = l.validate().unwrap_err().to_string();
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
        stride: 16 * 4,
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

/// Where byte `i` of head `h`'s token `t` lies in block `b` of plane `p`.
fn pos(l: &KvLayout, (p, b, h, t, i): (u64, u64, u64, u64, u64)) -> u64 {
    let g = l.geom();
    let inside = match l.inner {
        BlockOrder::Nhd => (t * g.kv_heads + h) * g.head_bytes + i,
        _ => (h * g.block_size + t) * g.head_bytes + i,
    };
    l.offset(p, b) + inside
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
                                let at = pos(l, (p, b, h, t, i));
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
    pull_as((BlockOrder::Hnd, 1), (dtp, ptp), toks, sel)
}

/// [`pull`] with blocks ordered `inner`, `pages` blocks (of this layer and others) per
/// block stride.
fn pull_as(
    (inner, pages): (BlockOrder, u64),
    (dtp, ptp): (u32, u32),
    toks: u64,
    sel: Select,
) -> u64 {
    let total = 8;
    let shaped = |heads: u64, n: u64| {
        let l = layout(heads, n);
        KvLayout {
            inner,
            block_stride: l.block_bytes * pages,
            ..l
        }
    };
    let (pl, dl) = (
        shaped(total / u64::from(ptp), 40),
        shaped(total / u64::from(dtp), 12),
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
                stride: pl.stride(),
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
                            let at = pos(&dl, (p, b, h, tok % 16, i));
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
        stride: 16 * 4,
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

/// vLLM's NHD block interiors (LBNHC; older FlashAttention) and block-outer layouts
/// (other layers' pages between a layer's blocks: BLHNC) give D every byte of its
/// heads, for whole blocks, chunks and windows, at every TP pairing they allow.
#[test]
fn nhd_blocks_and_block_outer_layouts_give_d_every_byte() {
    let base = Select {
        tokens: 70,
        ..Select::default()
    };
    let full = pull(1, 1, 70, base);
    for sel in [
        base,
        Select {
            chunk: Some(4),
            swa: true,
            ..base
        },
    ] {
        let want = pull(1, 1, 70, sel);
        for (dtp, ptp) in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8)] {
            let got = pull_as((BlockOrder::Nhd, 1), (dtp, ptp), 70, sel);
            assert_eq!(got, want, "NHD, D tp {dtp}, P tp {ptp}");
        }
        // three layers' pages a block stride: same TP on both sides
        assert_eq!(pull_as((BlockOrder::Hnd, 3), (1, 1), 70, sel), want);
        assert_eq!(pull_as((BlockOrder::Nhd, 3), (2, 2), 70, sel), want);
    }
    assert!(full > 0);
}

/// A packed block (K and V interleaved inside it, FlashInfer's) moves whole blocks of
/// every head only; a chunk or another TP size is refused, naming why.
#[test]
fn packed_blocks_move_whole_and_refuse_parts() {
    let base = Select {
        tokens: 70,
        ..Select::default()
    };
    assert_eq!(
        pull_as(
            (BlockOrder::Packed, 1),
            (1, 1),
            70,
            Select { tokens: 0, ..base }
        ),
        pull(1, 1, 70, Select { tokens: 0, ..base })
    );
    let l = KvLayout {
        inner: BlockOrder::Packed,
        ..layout(2, 10)
    };
    let peer = PeerKv {
        regions: at(&[5, 6]),
        num_blocks: 20,
        heads: 2,
        stride: 2 * 16 * 4,
    };
    let chunk = Select {
        chunk: Some(4),
        ..base
    };
    let ids: Vec<u64> = (0..5).collect();
    let e = l
        .transfer_descs(&at(&[0, 1]), &ids, &peer, &ids, &whole(2), chunk)
        .unwrap_err();
    assert!(e.contains("packed block layout moves whole blocks"), "{e}");
    let half = HeadSlice {
        count: 1,
        ..whole(2)
    };
    let e = l
        .transfer_descs(&at(&[0, 1]), &ids, &peer, &ids, &half, base)
        .unwrap_err();
    assert!(e.contains("1 of 2 heads"), "{e}");
    // heads outermost, tokens in the kernel's order: a share of the heads moves whole
    let heads = KvLayout {
        inner: BlockOrder::Heads,
        ..layout(2, 10)
    };
    let (a, b) = heads
        .transfer_descs(
            &at(&[0, 1]),
            &ids,
            &peer,
            &ids,
            &half,
            Select { tokens: 0, ..base },
        )
        .unwrap();
    assert!(
        a.iter()
            .zip(&b)
            .all(|(x, y)| x.len == 16 * 4 && y.len == 16 * 4),
        "{a:?}"
    );
    let e = heads
        .transfer_descs(&at(&[0, 1]), &ids, &peer, &ids, &whole(2), chunk)
        .unwrap_err();
    assert!(e.contains("order of its own"), "{e}");
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
        stride: 16 * 4,
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
