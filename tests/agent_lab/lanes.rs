//! Two queue pairs per rail (`qps_per_rail = 2`, four lanes over the lab's two rails): a
//! region is registered once per port, so a port's two lanes publish the same key (the
//! other port's lanes another), and transfers spread over all four lanes move every byte
//! exactly, WRITE and READ.

use kvrail::agent::{Desc, RemoteAccess, XferOp, XferStatus};

use super::{ensure, pattern, s, verbs_agent, wait, Topology, R};

pub(super) fn lanes_share_one_registration(t: &Topology) -> R {
    const N: u64 = 16;
    const LEN: u64 = 1 << 20;
    let p = verbs_agent("prefill", &t.b_devs, |c| c.qps_per_rail = 2)?;
    let d = verbs_agent("decode", &t.a_devs, |c| c.qps_per_rail = 2)?;
    let src = p
        .register((N * LEN) as usize, RemoteAccess::NONE, vec![])
        .map_err(s)?;
    let dst = d
        .register((N * LEN) as usize, RemoteAccess::READ_WRITE, vec![])
        .map_err(s)?;
    let back = p
        .register((N * LEN) as usize, RemoteAccess::NONE, vec![])
        .map_err(s)?;
    let meta = d.metadata();
    let keys = &(meta.regions.iter())
        .find(|r| r.id == dst.0)
        .ok_or("the region is not in the metadata")?
        .rkeys;
    ensure(
        keys.len() == 4 && keys[0] == keys[1] && keys[2] == keys[3] && keys[0] != keys[2],
        || format!("keys per lane {keys:?}: want one per port, shared by its two lanes"),
    )?;
    let want = pattern(77, (N * LEN) as usize);
    p.write_region(src, 0, &want).map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    let lanes = p.peer_rails(&peer_d);
    ensure(lanes.len() == 4, || format!("lanes to decode: {lanes:?}"))?;
    // N transfers in flight at once, spread over the lanes: WRITE src into decode's
    // region, then READ that region back into `back`
    for (op, local) in [(XferOp::Write, src), (XferOp::Read, back)] {
        let xs = (0..N)
            .map(|k| {
                let x = p
                    .create_xfer(
                        op,
                        vec![Desc::new(local, k * LEN, LEN)],
                        &peer_d,
                        vec![Desc::new(dst, k * LEN, LEN)],
                        None,
                    )
                    .map_err(s)?;
                p.post(x).map_err(s)?;
                Ok(x)
            })
            .collect::<Result<Vec<_>, String>>()?;
        for x in xs {
            let st = wait(&p, x)?;
            ensure(st == XferStatus::Done, || format!("{op:?}: {st:?}"))?;
        }
    }
    let mut got = vec![0u8; (N * LEN) as usize];
    d.read_region(dst, 0, &mut got).map_err(s)?;
    ensure(got == want, || "WRITE: bytes differ".into())?;
    p.read_region(back, 0, &mut got).map_err(s)?;
    ensure(got == want, || "READ back: bytes differ".into())?;
    let rb = p.rail_bytes();
    println!("    bytes per lane (prefill): {rb:?}");
    ensure(rb.len() == 4 && rb.iter().all(|(_, b)| *b > 0), || {
        format!("a lane carried nothing: {rb:?}")
    })
}
