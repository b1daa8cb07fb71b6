//! What fencing costs on verbs: making and revoking grants (a registration per range and
//! rail, `RangeKey`) for request-sized sets of blocks, next to the time the same bytes take
//! to READ on one rail, all in one run. Fails only when a grant cannot be made or revoked,
//! or a READ through a grant does not land byte-exact.

use std::time::Instant;

use kvrail::agent::{Desc, MemRegion, RemoteAccess, XferOp, XferStatus};
use kvrail::mem::HostBuffer;

use super::{agent, ensure, pattern, s, wait, Topology, R};

/// Blocks of 64 KiB: a request's KV in one layer, contiguous and scattered (a gap between
/// every two blocks, so nothing joins).
const BLOCK: u64 = 64 << 10;

pub(super) fn grant_cost(t: &Topology) -> R {
    let p = agent("prefill", &t.b_devs, None)?;
    let d = agent("decode", &t.a_devs, None)?;
    let len = 64 << 20;
    let fenced = p
        .register_memory(
            MemRegion::host(HostBuffer::new(len).map_err(s)?)
                .access(RemoteAccess::READ)
                .fenced(),
        )
        .map_err(s)?;
    let data = pattern(7, len);
    p.write_region(fenced, 0, &data).map_err(s)?;
    let dst = d.register(len, RemoteAccess::NONE, vec![]).map_err(s)?;
    let peer = d.load_remote(p.side_channel_addr()).map_err(s)?;
    let rails = p.metadata().rails.len();
    println!("    {rails} rails; one key per range and rail");
    for (what, n, gap) in [
        ("16 blocks contiguous (1 range)", 16u64, 0u64),
        ("16 blocks scattered", 16, 1),
        ("256 blocks scattered", 256, 1),
    ] {
        let descs: Vec<Desc> = (0..n)
            .map(|i| Desc::new(fenced, i * (1 + gap) * BLOCK, BLOCK))
            .collect();
        let t0 = Instant::now();
        let g = p.grant(&descs, RemoteAccess::READ).map_err(s)?;
        let made = t0.elapsed();
        let keys = g.ranges.len() * rails;
        d.accept_grant(&peer, g.clone()).map_err(s)?;
        let local: Vec<Desc> = descs
            .iter()
            .map(|r| Desc::new(dst, r.offset, BLOCK))
            .collect();
        let t1 = Instant::now();
        let x = d
            .create_xfer(XferOp::Read, local, &peer, descs.clone(), None)
            .map_err(s)?;
        d.post(x).map_err(s)?;
        let st = wait(&d, x)?;
        let read = t1.elapsed();
        ensure(st == XferStatus::Done, || format!("{what}: READ {st:?}"))?;
        d.release(x).map_err(s)?;
        let mut got = vec![0u8; BLOCK as usize];
        for r in &descs {
            d.read_region(dst, r.offset, &mut got).map_err(s)?;
            let want = &data[r.offset as usize..(r.offset + BLOCK) as usize];
            ensure(got == want, || {
                format!("{what}: bytes differ at {}", r.offset)
            })?;
        }
        let t2 = Instant::now();
        p.revoke(g.id).map_err(s)?;
        let revoked = t2.elapsed();
        d.forget_grant(&peer, g.id);
        ensure(p.grants_live() == 0, || {
            "a grant outlived its revocation".into()
        })?;
        println!(
            "    {what}, {} MiB: grant {:.0} µs, revoke {:.0} µs ({keys} keys, {:.1} µs per key \
             made); READ of the same bytes {:.0} µs",
            (n * BLOCK) >> 20,
            made.as_secs_f64() * 1e6,
            revoked.as_secs_f64() * 1e6,
            made.as_secs_f64() * 1e6 / keys as f64,
            read.as_secs_f64() * 1e6
        );
    }
    Ok(())
}
