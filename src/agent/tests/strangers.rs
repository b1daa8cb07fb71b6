//! Strangers and forgers on the wire, speaking kvrail's own messages (crate-internal, so a
//! fake peer can send what a real one never would): forged answers about another peer's
//! transfers, attach floods that must not leak descriptors, names that cannot be names.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::agent::control::msg::{send, Msg, Reader};
use crate::agent::metadata::AgentMetadata;
use crate::agent::{
    config::AgentConfig, config::BackendChoice, error::AgentError, region::RemoteAccess,
    xfer::Desc, Agent,
};
use crate::agent::{xfer::XferOp, xfer::XferStatus};

pub(super) fn tcp() -> AgentConfig {
    AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend: BackendChoice::Tcp,
        ..AgentConfig::default()
    }
}

/// A fake peer called `name`: metadata copied from a real agent's (so its regions and
/// handshake are valid) with its data address pointing at a listener of the test's.
pub(super) fn fake_peer(name: &str, regions: usize) -> (Vec<u8>, TcpListener, Agent) {
    let tmpl = Agent::new("template", tcp()).unwrap();
    for _ in 0..regions {
        tmpl.register(1 << 20, RemoteAccess::READ_WRITE, vec![])
            .unwrap();
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut m: AgentMetadata = tmpl.metadata();
    m.handshake.agent = name.to_owned();
    m.tcp_data = Some(l.local_addr().unwrap().to_string());
    (m.encode().unwrap(), l, tmpl)
}

/// Accept the agent's data connection on `l` and answer its Attach.
pub(super) fn accept_attach(l: &TcpListener) -> (TcpStream, Reader<TcpStream>) {
    let (s, _) = l.accept().unwrap();
    let mut r = Reader::new(s.try_clone().unwrap());
    assert!(matches!(r.next(), Ok(Some(Msg::Attach { .. }))));
    let mut w = s.try_clone().unwrap();
    send(&mut w, &Msg::Attached).unwrap();
    (s, r)
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// Defect: transfer ids were checked per agent, so a second loaded peer could answer for
/// another peer's transfer — a READ reported done with no byte landed.
#[test]
fn another_peers_answers_do_not_touch_a_transfer() {
    let a = Agent::new("victim", tcp()).unwrap();
    let dst = a.register(1 << 20, RemoteAccess::NONE, vec![]).unwrap();
    let (meta_b, lb, _tb) = fake_peer("silent-b", 1);
    let (b, (sb, mut rb)) = std::thread::scope(|s| {
        let fb = s.spawn(|| accept_attach(&lb));
        (
            a.load_remote_metadata(&meta_b, None).unwrap(),
            fb.join().unwrap(),
        )
    });
    let src = crate::agent::region::RegionId(a.remote_metadata(&b).unwrap().regions[0].id);
    let x = a
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 1 << 20)],
            &b,
            vec![Desc::new(src, 0, 1 << 20)],
            None,
        )
        .unwrap();
    a.post(x).unwrap();
    // B got the request and stays silent; forgers answer for it (one message each)
    assert!(matches!(rb.next(), Ok(Some(Msg::ReadReq { .. }))));
    let forged = [
        Msg::Ack { xfer: x.0 },
        Msg::Fail {
            xfer: x.0,
            message: "forged".into(),
        },
        Msg::ReadData {
            xfer: x.0,
            idx: 0,
            at: 0,
            len: 8,
        },
    ];
    for (i, m) in forged.iter().enumerate() {
        let (meta_c, lc, _tc) = fake_peer(&format!("forger-{i}"), 1);
        let (c, (sc, _rc)) = std::thread::scope(|s| {
            let fc = s.spawn(|| accept_attach(&lc));
            (
                a.load_remote_metadata(&meta_c, None).unwrap(),
                fc.join().unwrap(),
            )
        });
        let mut w = sc.try_clone().unwrap();
        send(&mut w, m).unwrap();
        if matches!(m, Msg::ReadData { .. }) {
            use std::io::Write;
            let _ = w.write_all(&[0xEE; 8]);
        }
        // the forger's connection is dropped as a protocol error; the transfer is untouched
        assert!(
            wait_until(Duration::from_secs(5), || !a.peer_connected(&c)),
            "{m:?}: the forger's connection stays up"
        );
        assert_eq!(a.status(x).unwrap(), XferStatus::InProgress, "{m:?}");
        let mut got = vec![0u8; 8];
        a.read_region(dst, 0, &mut got).unwrap();
        assert_eq!(got, [0u8; 8], "forged bytes landed");
    }
    // the real peer's death fails it, as it should
    drop((sb, rb));
    assert!(wait_until(Duration::from_secs(5), || matches!(
        a.status(x),
        Ok(XferStatus::Error(_))
    )));
}

/// The sockets of `port` (local) in CLOSE_WAIT: closed by the peer, never by us.
fn close_wait(port: u16) -> usize {
    let t = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    t.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1].rsplit(':').next() == Some(&format!("{port:04X}")) && f[3] == "08"
        })
        .count()
}

fn attach_raw(addr: SocketAddr, info: &crate::proto::handshake::HandshakeInfo) -> Option<Msg> {
    let s = TcpStream::connect(addr).unwrap();
    let mut w = s.try_clone().unwrap();
    send(&mut w, &Msg::Attach { info: info.clone() }).unwrap();
    Reader::new(s).next().ok().flatten()
}

/// Defect: every attached data connection (refused ones too) kept a descriptor open for
/// the agent's lifetime — 2,000 attaches left 2,000 sockets in CLOSE_WAIT.
#[test]
fn attached_and_refused_connections_do_not_leak() {
    let a = Agent::new("target", tcp()).unwrap();
    let addr = a.side_channel_addr();
    let good = Agent::new("client", tcp())
        .unwrap()
        .shared
        .handshake
        .clone();
    let mut bad = good.clone();
    bad.block_size += 1;
    for i in 0..300 {
        let want_refusal = i % 2 == 1;
        let got = attach_raw(addr, if want_refusal { &bad } else { &good });
        assert_eq!(
            matches!(got, Some(Msg::Refused { .. })),
            want_refusal,
            "{got:?}"
        );
    }
    let n = || close_wait(addr.port());
    assert!(
        wait_until(Duration::from_secs(10), || n() == 0),
        "{} sockets left in CLOSE_WAIT after 300 attaches",
        n()
    );
}

/// Defect: a peer name with a NUL byte panicked the loading side (a thread name).
#[test]
fn names_with_control_characters_are_refused_everywhere() {
    for name in ["a\0b", "tab\there", "nl\n"] {
        let e = Agent::new(name, tcp()).unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
    }
    let a = Agent::new("loader", tcp()).unwrap();
    let (meta, _l, _t) = fake_peer("evil\0peer", 1);
    match a.load_remote_metadata(&meta, None) {
        Err(AgentError::Metadata(e)) => assert!(e.to_string().contains("control"), "{e}"),
        other => panic!("{other:?}"),
    }
    // an Attach in such a name is refused, and the target keeps serving
    let mut info = a.shared.handshake.clone();
    info.agent = "x\0y".into();
    let got = attach_raw(a.side_channel_addr(), &info);
    assert!(
        matches!(&got, Some(Msg::Refused { message }) if message.contains("control")),
        "{got:?}"
    );
    let b = Agent::new("fine", tcp()).unwrap();
    b.load_remote(a.side_channel_addr()).unwrap();
}
