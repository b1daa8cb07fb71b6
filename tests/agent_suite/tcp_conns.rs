//! Large transfers spread over a peer's TCP connections (`AgentConfig::tcp_conns`): WRITEs
//! and READs of 2 MiB, all in flight at once, land byte-exact whichever connection carried
//! them, and the counters show every connection carried some; a large transfer with a
//! notification stays on the first, and its notification still follows its bytes; with
//! `tcp_conns` 1 everything goes on one connection; every connection proves the cluster
//! secret, and a peer that dies with large transfers in flight on all of them fails each
//! one (none hangs, none reports done). On verbs the data goes over queue pairs:
//! the bytes are checked there, the connection counters are not (no TCP transfer).

use std::time::Duration;

use kvrail::agent::{Agent, AgentConfig, Desc, RegionId, RemoteAccess, XferId, XferOp, XferStatus};

use super::{cfg, collect_notifs, load, on_verbs, pattern, wait, with_secret, Host};

const N: u64 = 12;

/// Bytes per transfer: 2 MiB on TCP (at least `LANE_MIN`, 1 MiB, to spread); on verbs, where
/// no lanes exist and rxe is slow under emulation, 256 KiB.
fn len() -> u64 {
    if on_verbs() {
        256 << 10
    } else {
        2 << 20
    }
}

/// Transfers `a` sent on its peers' connection `conn` so far.
fn sent_on(a: &Agent, conn: usize) -> f64 {
    let k = conn.to_string();
    let l = [("agent", a.name()), ("conn", k.as_str())];
    (a.metrics().value("kvrail_tcp_conn_transfers_total", &l)).unwrap_or(0.0)
}

fn with_conns(host: Host, n: u32) -> AgentConfig {
    AgentConfig {
        tcp_conns: n,
        ..cfg(host)
    }
}

/// Post `op` of N descriptors' worth (one transfer each, all in flight), wait for all.
fn all_at_once(d: &Agent, peer: &str, op: XferOp, (local, remote): (RegionId, RegionId)) {
    let xs: Vec<XferId> = (0..N)
        .map(|k| {
            let (l, r) = (
                Desc::new(local, k * len(), len()),
                Desc::new(remote, k * len(), len()),
            );
            let x = d.create_xfer(op, vec![l], peer, vec![r], None).unwrap();
            d.post(x).unwrap();
            x
        })
        .collect();
    for x in xs {
        assert_eq!(wait(d, x), XferStatus::Done);
    }
}

/// Register N * len() bytes on both (the peer's open to READ and WRITE), load `p` at `d`, and
/// WRITE a pattern from `d` into `p` with all N transfers in flight, checked byte for byte:
/// the peer's name, `d`'s source region and `p`'s region.
fn write_all_checked(p: &Agent, d: &Agent, seed: u64) -> (String, RegionId, RegionId) {
    let total = (N * len()) as usize;
    let remote = p.register(total, RemoteAccess::READ_WRITE, vec![]).unwrap();
    let src = d.register(total, RemoteAccess::NONE, vec![]).unwrap();
    let peer = load(d, p);
    let bytes = pattern(seed, total);
    d.write_region(src, 0, &bytes).unwrap();
    all_at_once(d, &peer, XferOp::Write, (src, remote));
    let mut got = vec![0u8; total];
    p.read_region(remote, 0, &mut got).unwrap();
    assert!(got == bytes, "WRITE bytes differ");
    (peer, src, remote)
}

#[test]
fn large_transfers_spread_over_the_connections_land_whole() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", with_conns(Host::A, 3)).unwrap();
    let total = (N * len()) as usize;
    let (peer, src, remote) = write_all_checked(&p, &d, 31);
    let back = d.register(total, RemoteAccess::NONE, vec![]).unwrap();
    let mut got = vec![0u8; total];
    // read back what another pattern put there
    let other = pattern(32, total);
    p.write_region(remote, 0, &other).unwrap();
    all_at_once(&d, &peer, XferOp::Read, (back, remote));
    d.read_region(back, 0, &mut got).unwrap();
    assert!(got == other, "READ bytes differ");
    if !on_verbs() {
        let used: Vec<f64> = (0..3).map(|k| sent_on(&d, k)).collect();
        assert_eq!(used.iter().sum::<f64>(), (2 * N) as f64, "{used:?}");
        assert!(
            used.iter().all(|&n| n >= 1.0),
            "a connection idle: {used:?}"
        );
    }
    // a large transfer with a notification goes on the first; the notification follows
    // its bytes
    let again = pattern(33, total);
    d.write_region(src, 0, &again).unwrap();
    let first = sent_on(&d, 0);
    let x = d
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, N * len())],
            &peer,
            vec![Desc::new(remote, 0, N * len())],
            Some(b"landed".to_vec()),
        )
        .unwrap();
    d.post(x).unwrap();
    assert_eq!(
        collect_notifs(&p, 1, Duration::from_secs(120)),
        [b"landed".to_vec()]
    );
    p.read_region(remote, 0, &mut got).unwrap();
    assert!(got == again, "the notification came before the bytes");
    assert_eq!(wait(&d, x), XferStatus::Done);
    if !on_verbs() {
        assert_eq!(sent_on(&d, 0) - first, 1.0);
    }
}

#[test]
fn one_connection_when_asked() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new("decode-0", with_conns(Host::A, 1)).unwrap();
    write_all_checked(&p, &d, 34);
    if !on_verbs() {
        assert_eq!(sent_on(&d, 0), N as f64);
        assert_eq!(sent_on(&d, 1), 0.0, "a second connection with tcp_conns 1");
    }
    let Err(e) = Agent::new("decode-1", with_conns(Host::A, 0)) else {
        panic!("tcp_conns 0 accepted");
    };
    assert!(e.to_string().contains("tcp_conns 0"), "{e}");
}

#[test]
fn every_connection_proves_the_secret_and_a_dying_peer_fails_them_all() {
    const K: &str = "a cluster secret of more than sixteen bytes";
    let p = Agent::new("prefill-0", with_secret(Host::B, Some(K))).unwrap();
    let d = Agent::new(
        "decode-0",
        AgentConfig {
            tcp_conns: 3,
            ..with_secret(Host::A, Some(K))
        },
    )
    .unwrap();
    let (peer, src, remote) = write_all_checked(&p, &d, 35);
    if !on_verbs() {
        let used: Vec<f64> = (0..3).map(|k| sent_on(&d, k)).collect();
        assert!(
            used.iter().all(|&n| n >= 1.0),
            "a connection idle: {used:?}"
        );
    }
    // the peer goes away with large transfers in flight on every connection
    let xs: Vec<XferId> = (0..4 * N)
        .map(|k| {
            let o = (k % N) * len();
            let x = d
                .create_xfer(
                    XferOp::Write,
                    vec![Desc::new(src, o, len())],
                    &peer,
                    vec![Desc::new(remote, o, len())],
                    None,
                )
                .unwrap();
            d.post(x).unwrap();
            x
        })
        .collect();
    drop(p);
    let mut failed = 0;
    for x in xs {
        match d.wait(x, Duration::from_secs(60)).unwrap() {
            XferStatus::Done => {}
            XferStatus::Error(_) => failed += 1,
            s => panic!("a transfer still {s:?} 60 s after its peer went away"),
        }
    }
    // whatever landed before the drop is done; a peer dropped this early leaves some undone
    // (none may hang, and a later post fails)
    let x = d
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, len())],
            &peer,
            vec![Desc::new(remote, 0, len())],
            None,
        )
        .unwrap();
    let late = match d.post(x) {
        Err(_) => true,
        Ok(()) => matches!(
            d.wait(x, Duration::from_secs(60)).unwrap(),
            XferStatus::Error(_)
        ),
    };
    assert!(late, "a post after the peer went away did not fail");
    assert!(!d.peer_connected(&peer), "the peer's connections left open");
    eprintln!("{failed} of {} in flight failed with the peer", 4 * N);
}
