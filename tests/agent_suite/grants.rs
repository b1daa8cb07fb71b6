//! Fencing through grants, on both backends: fenced memory is reachable only through a
//! grant; after the owner revokes it (the blocks were given back and hold new contents), a
//! late READ and a late WRITE under the old grant fail as `GrantRevoked` and touch nothing;
//! a grant forged from the region's own keys gives nothing; deregistering revokes.

use kvrail::agent::{
    Agent, AgentError, Desc, Grant, GrantRange, MemRegion, RegionId, RemoteAccess, XferOp,
    XferStatus,
};
use kvrail::mem::HostBuffer;

use super::{load, pair, pattern};

const LEN: u64 = 64 << 10;
const SPAN: u64 = 32 << 10;

fn read_local(a: &Agent, r: RegionId, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    a.read_region(r, 0, &mut out).unwrap();
    out
}

#[test]
fn a_late_read_and_a_late_write_under_a_revoked_grant_touch_nothing() {
    let (p, d, peer) = pair();
    let blocks = MemRegion::host(HostBuffer::new(LEN as usize).unwrap())
        .access(RemoteAccess::READ_WRITE)
        .fenced();
    let fenced = p.register_memory(blocks).unwrap();
    let open = p.register(4096, RemoteAccess::READ, vec![]).unwrap();
    let old = pattern(1, LEN as usize);
    p.write_region(fenced, 0, &old).unwrap();
    let dst = d
        .register(LEN as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let src = d
        .register(LEN as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let wbytes = pattern(2, LEN as usize);
    d.write_region(src, 0, &wbytes).unwrap();
    let peer = {
        assert_eq!(load(&d, &p), peer);
        peer
    };
    let meta = d.remote_metadata(&peer).unwrap();
    let m = meta.regions.iter().find(|m| m.id == fenced.0).unwrap();
    assert!(m.fenced, "metadata says the region is fenced");
    assert!(!meta.regions.iter().find(|m| m.id == open.0).unwrap().fenced);

    // no grant: the descriptor is refused before anything moves, naming it
    let e = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 4096)],
            &peer,
            vec![Desc::new(fenced, 0, 4096)],
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            AgentError::InvalidDesc {
                side: "remote",
                index: 0,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("fenced"), "{e}");

    // grants: refused on an open region, without rights, outside the region
    for (descs, access) in [
        (vec![Desc::new(open, 0, 16)], RemoteAccess::READ),
        (vec![Desc::new(fenced, 0, 16)], RemoteAccess::NONE),
        (vec![Desc::new(fenced, LEN - 8, 16)], RemoteAccess::READ),
    ] {
        assert!(p.grant(&descs, access).is_err());
    }
    // two touching descriptors become one range
    let g = p
        .grant(
            &[
                Desc::new(fenced, SPAN / 2, SPAN / 2),
                Desc::new(fenced, 0, SPAN / 2),
            ],
            RemoteAccess::READ_WRITE,
        )
        .unwrap();
    assert_eq!(g.ranges.len(), 1);
    assert_eq!((g.ranges[0].offset, g.ranges[0].len), (0, SPAN));
    assert_eq!(p.grants_live(), 1);
    // the token travels as bytes; a grant naming another owner is refused
    let token = g.encode();
    let wrong = Grant {
        owner: "someone-else".into(),
        ..g.clone()
    };
    assert!(matches!(
        d.accept_grant(&peer, wrong),
        Err(AgentError::InvalidGrant(_))
    ));
    assert!(matches!(
        d.accept_grant("nobody", g.clone()),
        Err(AgentError::UnknownPeer(_))
    ));
    d.accept_grant(&peer, Grant::decode(&token).unwrap())
        .unwrap();

    // under the grant: READ and WRITE, byte-exact; outside it: refused by name
    let (l, r) = (Desc::new(dst, 0, SPAN), Desc::new(fenced, 0, SPAN));
    assert_eq!(
        super::lab::xfer_retrying(&d, &peer, XferOp::Read, l, r),
        XferStatus::Done
    );
    assert!(
        read_local(&d, dst, SPAN) == old[..SPAN as usize],
        "READ under the grant"
    );
    let e = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 16)],
            &peer,
            vec![Desc::new(fenced, SPAN - 8, 16)],
            None,
        )
        .unwrap_err();
    assert!(matches!(e, AgentError::InvalidDesc { .. }), "{e}");
    let w = (Desc::new(src, 0, 4096), Desc::new(fenced, 4096, 4096));
    assert_eq!(
        super::lab::xfer_retrying(&d, &peer, XferOp::Write, w.0, w.1),
        XferStatus::Done
    );
    let mut want = old.clone();
    want[4096..8192].copy_from_slice(&wbytes[..4096]);
    assert!(read_local(&p, fenced, LEN) == want, "WRITE under the grant");

    // P gives the blocks back (revoke) and they are reused with new contents
    p.revoke(g.id).unwrap();
    assert!(matches!(p.revoke(g.id), Err(AgentError::NoGrant(_))));
    assert_eq!(p.grants_live(), 0);
    let new = pattern(3, LEN as usize);
    p.write_region(fenced, 0, &new).unwrap();
    // D still holds the old grant: its late READ and WRITE fail and touch nothing
    let fresh = d
        .register(LEN as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    // a late READ and a late WRITE fail as GrantRevoked: nothing lands, nothing changes
    let late_ops_touch_nothing = || {
        let (read, write) = (Desc::new(fresh, 0, SPAN), w);
        super::lab::assert_revoked(&super::lab::xfer_retrying(&d, &peer, XferOp::Read, read, r));
        assert!(
            read_local(&d, fresh, LEN).iter().all(|&b| b == 0),
            "a late READ landed bytes"
        );
        super::lab::assert_revoked(&super::lab::xfer_retrying(
            &d,
            &peer,
            XferOp::Write,
            write.0,
            write.1,
        ));
        assert!(
            read_local(&p, fenced, LEN) == new,
            "a late WRITE changed the reused blocks"
        );
    };
    late_ops_touch_nothing();

    // a grant forged from the region's own keys (what the metadata shows) gives nothing
    let forged = Grant {
        id: 0x0bad,
        owner: peer.clone(),
        read: true,
        write: true,
        ranges: vec![GrantRange {
            region: fenced.0,
            offset: 0,
            len: LEN,
            rkeys: m.rkeys.clone(),
        }],
    };
    d.accept_grant(&peer, forged).unwrap();
    late_ops_touch_nothing();
    assert!(d.forget_grant(&peer, 0x0bad));
    assert!(d.forget_grant(&peer, g.id));

    // a new grant over the same blocks works again (the failed queue pairs were rebuilt)
    let g2 = p
        .grant(&[Desc::new(fenced, 0, SPAN)], RemoteAccess::READ)
        .unwrap();
    d.accept_grant(&peer, g2.clone()).unwrap();
    assert_eq!(
        super::lab::xfer_retrying(&d, &peer, XferOp::Read, Desc::new(fresh, 0, SPAN), r),
        XferStatus::Done
    );
    assert!(read_local(&d, fresh, SPAN) == new[..SPAN as usize]);
    // READ-only: a WRITE through it is refused before anything moves
    assert!(d
        .create_xfer(XferOp::Write, vec![w.0], &peer, vec![w.1], None)
        .is_err());
    // deregistering the memory revokes what was granted over it
    p.deregister_memory(fenced).unwrap();
    assert_eq!(p.grants_live(), 0);
}
