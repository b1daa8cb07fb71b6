//! The agent's core without a socket, a queue pair or a thread of its own: a fake data path
//! takes what the core hands out to post, and the tests play what a driver would report —
//! a READ's chunks in any order across its descriptors, a WRITE's Ack, a peer lost, a
//! driver's failure, numbered notifications arriving twice and out of order on two paths,
//! a grant revoked while a copy under it is in flight. After each step the core's answer is
//! checked: no transfer is done with a byte missing, the notification is handed out before
//! the transfer is done, a region is held exactly while its transfer moves, and nothing
//! ends twice.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use super::*;
use crate::agent::backend::{Backend, Posted};
use crate::agent::metadata::{AgentMetadata, MemKind};
use crate::agent::region::{Layers, RegionMemory, RemoteAccess};
use crate::agent::xfer::{XferId, XferOp, XferStatus};
use crate::mem::HostBuffer;

/// A data path that only records what it was handed (the test plays the driver).
#[derive(Default)]
struct Recorder(Mutex<Vec<u64>>);

impl Backend for Recorder {
    fn start(&self, x: Posted) -> Result<(), AgentError> {
        self.0.lock().unwrap().push(x.id);
        Ok(())
    }
}

fn region(core: &Core, id: u32, len: usize) -> Arc<Region> {
    let r = Arc::new(Region::new(
        RegionId(id),
        RegionMemory::Host(HostBuffer::new(len).unwrap()),
        MemKind::Host,
        -1,
        RemoteAccess::READ,
        Layers::default(),
    ));
    lock(&core.regions).insert(id, r.clone());
    r
}

fn peer_meta() -> Arc<AgentMetadata> {
    Arc::new(crate::agent::table::tests::meta(&[]))
}

/// Create and post a transfer the way the facade does (regions held busy, handed to the
/// data path with the table unlocked); its id.
fn post(
    core: &Core,
    path: &dyn Backend,
    op: XferOp,
    peer: &str,
    local: &[(Arc<Region>, u64, u64)],
    notif: Option<&[u8]>,
) -> u64 {
    let descs: Vec<Desc> = (local.iter())
        .map(|(r, o, l)| Desc::new(r.id, *o, *l))
        .collect();
    let remote = (local.iter())
        .map(|(_, o, l)| Desc::new(RegionId(77), *o, *l))
        .collect();
    let mut xfers = lock(&core.xfers);
    let id = xfers.create(
        op,
        (peer, 1),
        descs.clone(),
        remote,
        notif.map(<[u8]>::to_vec),
    );
    let held: Vec<Arc<Region>> = local.iter().map(|(r, _, _)| r.clone()).collect();
    for r in &held {
        r.acquire();
    }
    let x = xfers.begin(id, held).unwrap();
    let posted = Posted {
        id: id.0,
        op,
        peer: x.peer.clone(),
        local: local.iter().map(|(r, _, _)| r.clone()).zip(descs).collect(),
        remote: x.remote.clone(),
        notif: x.notif.clone(),
        meta: peer_meta(),
        grants: Vec::new(),
    };
    drop(xfers);
    path.start(posted).unwrap();
    id.0
}

fn status(core: &Core, id: u64) -> XferStatus {
    lock(&core.xfers).status(XferId(id)).unwrap().clone()
}

fn ended(core: &Core) -> u64 {
    core.ended.load(Ordering::Acquire)
}

#[test]
fn a_read_is_done_only_with_every_byte_and_its_notification_is_out_first() {
    let core = Core::new("decode-0");
    let path = Recorder::default();
    let (a, b) = (region(&core, 1, 4096), region(&core, 2, 4096));
    let id = post(
        &core,
        &path,
        XferOp::Read,
        "prefill-0",
        &[(a.clone(), 0, 100), (b.clone(), 1000, 60)],
        Some(b"kv ready"),
    );
    assert_eq!(
        *path.0.lock().unwrap(),
        [id],
        "handed to the data path once"
    );
    assert_eq!((a.in_use(), b.in_use()), (1, 1), "held while it moves");
    // chunks come in order per descriptor, the descriptors interleaved: the second's
    // first, then the first's, then the rest of the second
    assert_eq!(core.read_arrival(id, (1, 0), 30), table::Arrival::More);
    assert_eq!(core.read_arrival(id, (0, 0), 100), table::Arrival::More);
    // a chunk repeated, one skipping ahead, one past the descriptor's end: the peer's error
    assert_eq!(core.read_arrival(id, (1, 0), 30), table::Arrival::Unasked);
    assert_eq!(core.read_arrival(id, (1, 40), 20), table::Arrival::Unasked);
    assert_eq!(core.read_arrival(id, (1, 30), 31), table::Arrival::Unasked);
    assert_eq!(
        status(&core, id),
        XferStatus::InProgress,
        "30 bytes missing"
    );
    assert_eq!(core.read_arrival(id, (1, 30), 30), table::Arrival::Complete);
    // notify after data: the notification is handed out before the transfer is done
    let (to, n) = core
        .xfer_notif(id)
        .expect("the notification of a complete READ");
    assert_eq!((&*to, n.as_slice()), ("prefill-0", &b"kv ready"[..]));
    assert_eq!(status(&core, id), XferStatus::InProgress);
    core.finish(id, Ok(()));
    assert_eq!(status(&core, id), XferStatus::Done);
    assert_eq!((a.in_use(), b.in_use(), ended(&core)), (0, 0, 1));
    // a driver reporting it again (a late completion) changes nothing
    core.finish(id, Err(XferError::Closed));
    assert_eq!((status(&core, id), ended(&core)), (XferStatus::Done, 1));
    assert_eq!(core.read_arrival(id, (0, 0), 1), table::Arrival::Stale);
}

#[test]
fn a_lost_peer_fails_its_transfers_only_and_gives_their_regions_back() {
    let core = Core::new("decode-0");
    let path = Recorder::default();
    let r = region(&core, 1, 1 << 16);
    let to_p0 = post(
        &core,
        &path,
        XferOp::Read,
        "prefill-0",
        &[(r.clone(), 0, 4096)],
        None,
    );
    let to_p1 = post(
        &core,
        &path,
        XferOp::Write,
        "prefill-1",
        &[(r.clone(), 4096, 4096)],
        None,
    );
    let done = post(
        &core,
        &path,
        XferOp::Write,
        "prefill-0",
        &[(r.clone(), 8192, 16)],
        None,
    );
    core.xfer_end_sent(done);
    core.finish(done, Ok(()));
    assert_eq!(r.in_use(), 2);
    core.fail_peer("prefill-0", "connection reset");
    match status(&core, to_p0) {
        XferStatus::Error(XferError::ConnectionLost { peer, why }) => {
            assert_eq!(
                (peer.as_str(), why.as_str()),
                ("prefill-0", "connection reset")
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        status(&core, to_p1),
        XferStatus::InProgress,
        "another peer's"
    );
    assert_eq!(status(&core, done), XferStatus::Done, "an ended one stays");
    assert_eq!(r.in_use(), 1, "the failed transfer let its region go");
    // the failed READ's late bytes are dropped, and its notification never goes
    assert_eq!(
        core.read_arrival(to_p0, (0, 0), 4096),
        table::Arrival::Stale
    );
    assert!(core.xfer_notif(to_p0).is_none());
    // a driver's own failure ends the other
    core.finish(to_p1, Err(XferError::Rdma("IBV_WC_RETRY_EXC_ERR".into())));
    assert!(matches!(
        status(&core, to_p1),
        XferStatus::Error(XferError::Rdma(_))
    ));
    assert_eq!((r.in_use(), ended(&core)), (0, 3));
}

#[test]
fn numbered_notifications_from_two_paths_arrive_once_each_in_order() {
    let core = Core::new("decode-0");
    // a failed channel's messages resent over TCP: 2 and 0 twice, 1 late, 3 on the new one
    for (conn, seq, b) in [
        (7, 2, "c"),
        (7, 0, "a"),
        (7, 0, "a"),
        (7, 2, "c"),
        (7, 1, "b"),
    ] {
        core.deliver_seq_notif(conn, "prefill-0", seq, b.as_bytes().to_vec());
    }
    core.deliver_seq_notif(7, "prefill-0", 3, b"d".to_vec());
    // another connection counts from 0 on its own
    core.deliver_seq_notif(8, "prefill-1", 0, b"x".to_vec());
    let got: Vec<(String, Vec<u8>)> = lock(&core.notifs).drain(..).collect();
    let want: Vec<(String, Vec<u8>)> = [("prefill-0", "a"), ("prefill-0", "b"), ("prefill-0", "c")]
        .into_iter()
        .chain([("prefill-0", "d"), ("prefill-1", "x")])
        .map(|(f, b)| (f.to_owned(), b.as_bytes().to_vec()))
        .collect();
    assert_eq!(got, want);
    // a connection that ended forgets its numbering: a new one starts at 0 again
    core.forget_conn(7);
    core.deliver_seq_notif(7, "prefill-0", 0, b"again".to_vec());
    assert_eq!(lock(&core.notifs).len(), 1);
}

/// A driver's tap taking the messages that start with its magic.
struct Tap(Mutex<Vec<Vec<u8>>>);

impl NotifTap for Tap {
    fn take(&self, _from: &str, bytes: Vec<u8>) -> Option<Vec<u8>> {
        if !bytes.starts_with(b"BNC") {
            return Some(bytes);
        }
        self.0.lock().unwrap().push(bytes);
        None
    }
}

#[test]
fn a_drivers_tap_takes_its_own_a_route_its_kind_and_the_engine_the_rest() {
    let core = Core::new("decode-0");
    let tap = Arc::new(Tap(Mutex::default()));
    core.set_tap(tap.clone());
    let route = Arc::new(RouteQueue {
        prefix: b"PUSH_REG:".to_vec(),
        q: Mutex::default(),
        cv: Wake::default(),
    });
    lock(&core.routes).push(route.clone());
    for m in ["BNC chunk", "PUSH_REG:7", "done:req-1", "BNC ack"] {
        core.deliver_notif("prefill-0", m.as_bytes().to_vec());
    }
    assert_eq!(
        *tap.0.lock().unwrap(),
        [b"BNC chunk".to_vec(), b"BNC ack".to_vec()]
    );
    let routed: Vec<_> = lock(&route.q).drain(..).map(|(_, b)| b).collect();
    assert_eq!(routed, [b"PUSH_REG:7".to_vec()]);
    let engine: Vec<_> = lock(&core.notifs).drain(..).map(|(_, b)| b).collect();
    assert_eq!(engine, [b"done:req-1".to_vec()]);
}

/// A grant over region 1's bytes [0, 4096) that READs may use.
fn grant(core: &Core, id: u64) -> Arc<RwLock<bool>> {
    let gate = Arc::new(RwLock::new(true));
    lock(&core.grants).made.insert(
        id,
        Held {
            read: true,
            write: false,
            ranges: vec![(1, 0, 4096)],
            gate: gate.clone(),
            #[cfg(feature = "verbs")]
            _keys: Vec::new(),
        },
    );
    gate
}

#[test]
fn a_revocation_waits_for_the_copy_under_the_grant_and_no_copy_runs_after_it() {
    let core = Arc::new(Core::new("prefill-0"));
    grant(&core, 5);
    // outside what the grant gives: refused, nothing copied
    let write = core.under_grant(5, (1, 0, 16), true, || unreachable!());
    assert!(write.unwrap_err().starts_with(REVOKED));
    let beyond = core.under_grant(5, (1, 4000, 200), false, || unreachable!());
    assert!(beyond.unwrap_err().starts_with(REVOKED));
    // a peer's READ in flight: a copy under the grant while the owner revokes it
    let copying = Arc::new(std::sync::Barrier::new(2));
    let (c, k) = (core.clone(), copying.clone());
    let reader = std::thread::spawn(move || {
        c.under_grant(5, (1, 0, 4096), false, || {
            k.wait();
            std::thread::sleep(Duration::from_millis(50));
            std::time::Instant::now()
        })
    });
    copying.wait();
    core.revoke_region_grants(1);
    let revoked = std::time::Instant::now();
    let copied = reader
        .join()
        .unwrap()
        .expect("the copy began before the revocation");
    assert!(
        copied <= revoked,
        "the revocation returned while the copy ran"
    );
    // from then on nothing is copied under it
    let late = core.under_grant(5, (1, 0, 16), false, || unreachable!());
    assert!(late.unwrap_err().starts_with(REVOKED));
    assert!(lock(&core.grants).made.is_empty());
}
