//! Fencing of freed blocks through the connector (`fence_blocks`, on by default), on both
//! backends (TCP here, verbs in the lab). A real worker on one side; on the other a bare
//! agent that plays a late peer and keeps what it was given:
//! - pull: a D rank asks P for its grant, READs byte-exact; P's lease runs out (the D went
//!   silent longer than a lease) and P reuses the blocks; the late READ under the old grant
//!   fails as `GrantRevoked` and lands nothing; asking again is answered "given back";
//! - push: P receives D's grant in the `PUSH_REG` and WRITEs byte-exact; D withdraws the
//!   registration, P never confirms (partitioned), D takes the blocks back after
//!   `push_registration_timeout` and reuses them; P's late WRITE under the old grant fails
//!   and the blocks keep their new contents.
//!
//! Worker time is driven by the `now` each call takes, so a lease runs out at once.

mod lab;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, Desc, Grant, RemoteAccess, XferOp, XferStatus};
use kvrail::connector::config::KvTransferConfig;
use kvrail::connector::{
    agent_config, ConnectorMetadata, KvCaches, KvLayout, KvTransferParams, RecvReq, SendReq, Worker,
};
use kvrail::proto::kvmsg::{GrantReq, KvMsg};

const P: &str = "prefill-engine";
const D: &str = "decode-engine";

fn layout() -> KvLayout {
    lab::kv_layout(2, 16, 4096, 1)
}

fn cfg(dir: &str, role: &str) -> KvTransferConfig {
    KvTransferConfig::from_json(&format!(
        r#"{{"kv_connector":"Kvrail{dir}Connector","kv_role":"{role}",
            "kv_connector_extra_config":{{"kv_lease_duration":30,
            "push_registration_timeout":5}}}}"#
    ))
    .unwrap()
}

/// A worker (its agent named `name`) and the bare agent of the other side, which loads it.
fn sides(dir: &str, worker_role: &str, name: &str, other: &str) -> (Worker, Agent) {
    let wc = cfg(dir, worker_role);
    let other_role = if worker_role == "kv_producer" {
        "kv_consumer"
    } else {
        "kv_producer"
    };
    let oc = cfg(dir, other_role);
    let l = layout();
    let host_a = worker_role == "kv_consumer";
    let a = Agent::new(name, agent_config(&wc, &l, lab::agent_config(host_a))).unwrap();
    let w = Worker::with_caches(Arc::new(a), wc, l.clone(), (0, 1), KvCaches::Allocate).unwrap();
    let o = Agent::new(other, agent_config(&oc, &l, lab::agent_config(!host_a))).unwrap();
    assert_eq!(o.load_remote(w.agent().side_channel_addr()).unwrap(), name);
    (w, o)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| lab::pattern_byte(seed, i))
        .collect()
}

/// The next connector message `a` receives, while `step` drives the worker.
fn next_msg(a: &Agent, mut step: impl FnMut()) -> KvMsg {
    let t = Instant::now();
    loop {
        step();
        if let Some((_, m)) = a.get_new_notifs().into_iter().next() {
            return KvMsg::decode(&m).unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no message");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pull_a_read_after_the_lease_ran_out_fails_and_lands_nothing() {
    let (mut p, d) = sides("Pull", "kv_producer", P, D);
    let l = layout();
    let span = 3 * l.block_bytes; // blocks 3, 4, 5 of plane 0
    let region = p.regions()[0];
    let (kv, reused) = (pattern(1, span as usize), pattern(2, span as usize));
    p.agent().write_region(region, l.offset(0, 3), &kv).unwrap();
    let t0 = Instant::now();
    let send = SendReq {
        request_id: "cmpl-1-p".into(),
        block_ids: vec![3, 4, 5],
        tokens: 48,
        keep_s: None,
    };
    let meta = ConnectorMetadata {
        reqs_to_send: vec![send],
        ..ConnectorMetadata::default()
    };
    p.start_load_kv(&meta, t0);
    assert_eq!(p.grants_live(), 1, "P granted the leased blocks");
    // P's regions are fenced: without the grant D cannot even name them
    let dst = d
        .register(span as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let remote = Desc::new(region, l.offset(0, 3), span);
    assert!(d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, span)],
            P,
            vec![remote],
            None
        )
        .is_err());
    // D asks (P connects back to answer), accepts, READs byte-exact
    let at = d.side_channel_addr();
    let ask = GrantReq {
        request_id: "cmpl-1-p".into(),
        host: at.ip().to_string(),
        port: at.port(),
    }
    .encode();
    d.send_notif(P, ask.clone()).unwrap();
    let KvMsg::Grant(g) = next_msg(&d, || drop(p.get_finished(t0))) else {
        panic!("no grant")
    };
    d.accept_grant(P, Grant::decode(&g.token).unwrap()).unwrap();
    let local = Desc::new(dst, 0, span);
    assert_eq!(
        lab::xfer_retrying(&d, P, XferOp::Read, local, remote),
        XferStatus::Done
    );
    let mut got = vec![0u8; span as usize];
    d.read_region(dst, 0, &mut got).unwrap();
    assert!(got == kv, "the READ under the grant");
    // D goes silent past the lease: P frees the blocks (revoking first) and reuses them
    let f = p.get_finished(t0 + Duration::from_secs(31));
    assert_eq!(f.sending, ["cmpl-1-p"], "the lease ran out");
    assert_eq!(p.grants_live(), 0);
    assert_eq!(p.agent().grants_live(), 0);
    p.agent()
        .write_region(region, l.offset(0, 3), &reused)
        .unwrap();
    // the late READ under the old grant: refused by P's side, nothing lands
    let late = d
        .register(span as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let s = lab::xfer_retrying(&d, P, XferOp::Read, Desc::new(late, 0, span), remote);
    lab::assert_revoked(&s);
    d.read_region(late, 0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "a late READ landed bytes");
    // asking again: the blocks were given back
    d.send_notif(P, ask).unwrap();
    let later = t0 + Duration::from_secs(32);
    let KvMsg::GrantNone(n) = next_msg(&d, || drop(p.get_finished(later))) else {
        panic!("expected GRANT_NONE")
    };
    assert!(n.reason.contains("given back"), "{}", n.reason);
}

#[test]
fn push_a_write_after_d_took_its_blocks_back_fails_and_touches_nothing() {
    let (mut d, p) = sides("Push", "kv_consumer", D, P);
    let l = layout();
    let t0 = Instant::now();
    let at = p.side_channel_addr();
    let recv = RecvReq {
        request_id: "cmpl-2-d".into(),
        local_block_ids: vec![7, 8],
        params: KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: P.into(),
            remote_host: at.ip().to_string(),
            remote_port: at.port(),
            remote_block_ids: vec![1, 2],
            remote_request_id: "cmpl-2-p".into(),
            tp_size: 1,
            ..KvTransferParams::default()
        },
        tokens: 32,
        read_back: false,
        computed: 0,
    };
    let meta = ConnectorMetadata {
        reqs_to_recv: vec![recv],
        ..ConnectorMetadata::default()
    };
    d.start_load_kv(&meta, t0);
    assert_eq!(
        d.grants_live(),
        1,
        "D granted its blocks for the registration"
    );
    // P gets the registration with D's grant, loads D, WRITEs byte-exact
    let KvMsg::PushReg(reg) = next_msg(&p, || drop(d.get_finished(t0))) else {
        panic!("no PUSH_REG")
    };
    let token = reg.grant.expect("a fenced D sends its grant");
    assert_eq!(
        p.load_remote(format!("{}:{}", reg.host, reg.port).parse().unwrap())
            .unwrap(),
        D
    );
    p.accept_grant(D, Grant::decode(&token).unwrap()).unwrap();
    let span = 2 * l.block_bytes;
    let region = d.regions()[1];
    let remote = Desc::new(region, l.offset(1, 7), span);
    let src = p
        .register(span as usize, RemoteAccess::NONE, vec![])
        .unwrap();
    let kv = pattern(3, span as usize);
    p.write_region(src, 0, &kv).unwrap();
    let local = Desc::new(src, 0, span);
    assert_eq!(
        lab::xfer_retrying(&p, D, XferOp::Write, local, remote),
        XferStatus::Done
    );
    let mut got = vec![0u8; span as usize];
    d.agent()
        .read_region(region, l.offset(1, 7), &mut got)
        .unwrap();
    assert!(got == kv, "the WRITE under the grant");
    // outside the granted blocks: refused before anything moves
    let other = Desc::new(region, l.offset(1, 9), l.block_bytes);
    assert!(p
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, l.block_bytes)],
            D,
            vec![other],
            None
        )
        .is_err());
    // D aborts; P never confirms the withdrawal (partitioned): after the timeout D takes
    // the blocks back (revoking first) and reuses them
    let cancel = ConnectorMetadata {
        cancel_registrations: vec!["cmpl-2-d".into()],
        ..ConnectorMetadata::default()
    };
    d.start_load_kv(&cancel, t0);
    let f = d.get_finished(t0 + Duration::from_secs(6));
    assert_eq!(f.sending, ["cmpl-2-d"], "blocks given back unconfirmed");
    assert_eq!(d.grants_live(), 0);
    let reused = pattern(4, span as usize);
    d.agent()
        .write_region(region, l.offset(1, 7), &reused)
        .unwrap();
    // P's late WRITE under the old grant fails and the blocks keep their new contents
    lab::assert_revoked(&lab::xfer_retrying(&p, D, XferOp::Write, local, remote));
    d.agent()
        .read_region(region, l.offset(1, 7), &mut got)
        .unwrap();
    assert!(got == reused, "a late WRITE changed blocks D reused");
}
