//! Memory given back is never touched again (issue 46), on TCP with a fake peer speaking
//! kvrail's messages: a peer's READ stops at the deregistration, a WRITE chunk in flight
//! makes it wait and nothing lands after it, an early Ack fails the WRITE (and the writer
//! stops reading the source), an Ack or a repeated chunk never completes a READ.

use std::io::Write as _;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::strangers::{accept_attach, fake_peer, tcp};
use crate::agent::control::msg::{send, Msg, Reader};
use crate::agent::{
    config::AgentConfig, error::AgentError, error::XferError, region::RegionId,
    region::RemoteAccess, register::MemRegion, xfer::Desc, xfer::XferOp, xfer::XferStatus, Agent,
};
use crate::mem::HostBuffer;

const MIB: usize = 1 << 20;

/// Byte `i` of the test pattern (never 0xEE, the fill of memory given back).
fn pat(i: usize) -> u8 {
    match (i * 7 + i / 4099) as u8 {
        0xEE => 0x11,
        b => b,
    }
}

/// `len` bytes of the pattern in a buffer the test keeps a handle on.
fn patterned(len: usize) -> Arc<HostBuffer> {
    let b = HostBuffer::new(len).unwrap();
    let bytes: Vec<u8> = (0..len).map(pat).collect();
    b.write(0, &bytes).unwrap();
    b
}

/// A fake initiator attached to `to`'s side channel as `name`.
fn attach_to(to: &Agent, name: &str) -> (TcpStream, Reader<TcpStream>) {
    let s = TcpStream::connect(to.side_channel_addr()).unwrap();
    let mut info = to.metadata().handshake;
    info.agent = name.to_owned();
    let mut w = s.try_clone().unwrap();
    send(&mut w, &Msg::Attach { info }).unwrap();
    let mut r = Reader::new(s.try_clone().unwrap());
    assert!(matches!(r.next(), Ok(Some(Msg::Attached))));
    (w, r)
}

/// Defect 1: P's deregister returned at once while a peer's READ of the region was being
/// served, and the rest of the READ was sent from the memory P had reused (all 0xEE).
#[test]
fn a_peers_read_stops_at_the_deregistration_and_never_sends_reused_memory() {
    let p = Agent::new("p-read", tcp()).unwrap();
    let buf = patterned(64 * MIB);
    let region =
        (p.register_memory(MemRegion::host(buf.clone()).access(RemoteAccess::READ))).unwrap();
    let (mut w, mut r) = attach_to(&p, "d-read");
    let req = Msg::ReadReq {
        xfer: 1,
        idx: 0,
        region: region.0,
        offset: 0,
        len: 64 * MIB as u64,
        grant: 0,
    };
    send(&mut w, &req).unwrap();
    // the peer reads slowly: 4 MiB a chunk, 40 ms apart
    let got = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reader = {
        let got = got.clone();
        std::thread::spawn(move || {
            let (mut bytes, mut fail) = (Vec::new(), None);
            while bytes.len() < 64 * MIB {
                match r.next() {
                    Ok(Some(Msg::ReadData { at, len, .. })) => {
                        assert_eq!(at as usize, bytes.len(), "chunks in order");
                        bytes.extend_from_slice(r.payload(len).unwrap());
                        got.store(bytes.len(), std::sync::atomic::Ordering::Release);
                        std::thread::sleep(Duration::from_millis(40));
                    }
                    Ok(Some(Msg::Fail { message, .. })) => {
                        fail = Some(message);
                        break;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            (bytes, fail)
        })
    };
    let t = Instant::now();
    while got.load(std::sync::atomic::Ordering::Acquire) < 8 * MIB {
        assert!(t.elapsed() < Duration::from_secs(30), "no 8 MiB in 30 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    p.deregister(region).unwrap();
    // given back: the engine reuses the memory
    buf.write(0, &vec![0xEE; 64 * MIB]).unwrap();
    let (bytes, fail) = reader.join().unwrap();
    let wrong = (bytes.iter().enumerate())
        .filter(|&(i, &b)| b != pat(i))
        .count();
    assert_eq!(wrong, 0, "bytes of memory given back reached the peer");
    assert!(
        bytes.len() < 64 * MIB,
        "the READ went on after deregistration"
    );
    let fail = fail.expect("the peer is told");
    assert!(fail.contains("deregistered"), "{fail}");
    drop(w);
}

/// Defect 2: a WRITE chunk being received in place kept landing after deregister returned
/// 0 (and the peer got an Ack). Now the deregistration waits for the chunk, nothing lands
/// after it returned, and the WRITE fails.
#[test]
fn a_write_chunk_in_flight_holds_the_deregistration_and_nothing_lands_after_it() {
    let p = Agent::new("p-write", tcp()).unwrap();
    let buf = patterned(8 * MIB);
    let region =
        (p.register_memory(MemRegion::host(buf.clone()).access(RemoteAccess::WRITE))).unwrap();
    let (mut w, mut r) = attach_to(&p, "d-write");
    let chunk = |offset: usize| Msg::WriteData {
        xfer: 9,
        region: region.0,
        offset: offset as u64,
        len: 4 * MIB as u32,
        grant: 0,
    };
    send(&mut w, &chunk(0)).unwrap();
    w.write_all(&vec![0x22; MIB]).unwrap();
    std::thread::sleep(Duration::from_millis(100)); // the first MiB lands
    let dereg = {
        let p = p.clone();
        std::thread::spawn(move || p.deregister(region))
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !dereg.is_finished(),
        "deregister returned with a chunk of a peer's WRITE landing in the region"
    );
    w.write_all(&vec![0x22; 3 * MIB]).unwrap();
    dereg.join().unwrap().unwrap();
    let mut first = vec![0u8; 4 * MIB];
    buf.read(0, &mut first).unwrap();
    assert!(
        first.iter().all(|&b| b == 0x22),
        "the chunk landed whole first"
    );
    buf.write(0, &vec![0xEE; 8 * MIB]).unwrap();
    // after it: a second chunk and the end
    send(&mut w, &chunk(4 * MIB)).unwrap();
    w.write_all(&vec![0x33; 4 * MIB]).unwrap();
    send(
        &mut w,
        &Msg::WriteEnd {
            xfer: 9,
            notif: Some(b"landed".to_vec()),
        },
    )
    .unwrap();
    match r.next() {
        Ok(Some(Msg::Fail { xfer: 9, message })) => {
            assert!(message.contains(&region.0.to_string()), "{message}");
        }
        other => panic!("expected the WRITE's failure, got {other:?}"),
    }
    let mut all = vec![0u8; 8 * MIB];
    buf.read(0, &mut all).unwrap();
    assert!(
        all.iter().all(|&b| b == 0xEE),
        "bytes landed in memory given back"
    );
    assert!(
        p.get_new_notifs().is_empty(),
        "no notification for a failed WRITE"
    );
}

/// Defect 3: an Ack right after a WRITE's first chunk completed it; the engine reused its
/// source and the writer went on sending it. Now that Ack fails the transfer as a protocol
/// error naming the peer, the connection ends, and no byte of the reused source leaves.
#[test]
fn an_early_ack_fails_the_write_and_the_reused_source_is_never_sent() {
    let d = Agent::new("d-early", tcp()).unwrap();
    let src = patterned(64 * MIB);
    let local = (d.register_memory(MemRegion::host(src.clone()))).unwrap();
    let (meta, l, _tmpl) = fake_peer("p-early", 1);
    let peer = std::thread::scope(|s| {
        let f = s.spawn(|| accept_attach(&l));
        let peer = d.load_remote_metadata(&meta, None).unwrap();
        let (sock, r) = f.join().unwrap();
        // the fake target: Ack after the first header, then read everything until the end
        let target = std::thread::spawn(move || {
            let (mut r, mut w) = (r, sock);
            let (mut bytes, mut acked) = (Vec::new(), false);
            loop {
                match r.next() {
                    Ok(Some(Msg::WriteData {
                        xfer, offset, len, ..
                    })) => {
                        if !acked {
                            send(&mut w, &Msg::Ack { xfer }).unwrap();
                            acked = true;
                        }
                        let Ok(b) = r.payload(len) else { break };
                        bytes.push((offset as usize, b.to_vec()));
                    }
                    Ok(Some(_)) => {}
                    _ => break,
                }
            }
            bytes
        });
        (peer, target)
    });
    let (peer, target) = peer;
    let remote = RegionId(d.remote_metadata(&peer).unwrap().regions[0].id);
    // the template's region is 1 MiB: WRITE 1 MiB slices of the 64 MiB source, one
    // descriptor each, so the transfer is 64 MiB
    let locals: Vec<Desc> = (0..64)
        .map(|i| Desc::new(local, (i * MIB) as u64, MIB as u64))
        .collect();
    let remotes: Vec<Desc> = (0..64).map(|_| Desc::new(remote, 0, MIB as u64)).collect();
    let x = d
        .create_xfer(XferOp::Write, locals, &peer, remotes, None)
        .unwrap();
    d.post(x).unwrap();
    let st = d.wait(x, Duration::from_secs(30)).unwrap();
    match &st {
        XferStatus::Error(XferError::Protocol(why)) => {
            assert!(why.contains("p-early") && why.contains("Ack"), "{why}");
        }
        other => panic!("an early Ack must fail the WRITE, got {other:?}"),
    }
    // given back and reused
    let mut back = Err(AgentError::NoRegion(0));
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(15) {
        back = d.deregister(local);
        if back.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    back.unwrap();
    src.write(0, &vec![0xEE; 64 * MIB]).unwrap();
    let got = target.join().unwrap();
    let sent: usize = got.iter().map(|(_, b)| b.len()).sum();
    assert!(
        sent < 64 * MIB,
        "the writer sent the whole source after the transfer ended"
    );
    assert!(
        got.iter().all(|(_, b)| b.iter().all(|&x| x != 0xEE)),
        "bytes of the reused source reached the peer"
    );
}

/// A fake target that `d` READs 8 KiB from: `answer` gets the READ's requests and answers.
fn read_from_fake(
    name: &str,
    answer: impl FnOnce(&mut TcpStream, Vec<Msg>) + Send + 'static,
) -> (XferStatus, Vec<u8>) {
    let d = Agent::new(&format!("d-{name}"), tcp()).unwrap();
    let dst = d.register(8192, RemoteAccess::NONE, vec![]).unwrap();
    d.write_region(dst, 0, &[0x5A; 8192]).unwrap();
    let (meta, l, _tmpl) = fake_peer(name, 1);
    let (peer, f) = std::thread::scope(|s| {
        let f = s.spawn(|| accept_attach(&l));
        (
            d.load_remote_metadata(&meta, None).unwrap(),
            f.join().unwrap(),
        )
    });
    let remote = RegionId(d.remote_metadata(&peer).unwrap().regions[0].id);
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, 4096), Desc::new(dst, 4096, 4096)],
            &peer,
            vec![Desc::new(remote, 0, 4096), Desc::new(remote, 4096, 4096)],
            None,
        )
        .unwrap();
    d.post(x).unwrap();
    let (mut sock, mut r) = f;
    let reqs: Vec<Msg> = (0..2).map(|_| r.next().unwrap().unwrap()).collect();
    let t = std::thread::spawn(move || answer(&mut sock, reqs));
    let st = d.wait(x, Duration::from_secs(10)).unwrap();
    t.join().unwrap();
    let mut out = vec![0u8; 8192];
    d.read_region(dst, 0, &mut out).unwrap();
    (st, out)
}

/// Defect 4: an Ack completed a READ with none of its bytes.
#[test]
fn an_ack_never_completes_a_read() {
    let (st, out) = read_from_fake("acker", |w, reqs| {
        let Msg::ReadReq { xfer, .. } = reqs[0] else {
            panic!("{:?}", reqs[0])
        };
        send(w, &Msg::Ack { xfer }).unwrap();
    });
    match st {
        XferStatus::Error(XferError::Protocol(why)) => {
            assert!(why.contains("acker") && why.contains("READ"), "{why}")
        }
        other => panic!("an Ack must fail a READ, got {other:?}"),
    }
    assert!(out.iter().all(|&b| b == 0x5A), "destination untouched");
}

/// A READ counted bytes only: one descriptor's chunk sent twice completed it with the other
/// descriptor's bytes missing.
#[test]
fn a_repeated_chunk_never_completes_a_read() {
    let (st, out) = read_from_fake("repeater", |w, reqs| {
        let Msg::ReadReq { xfer, .. } = reqs[0] else {
            panic!("{:?}", reqs[0])
        };
        for _ in 0..2 {
            let h = Msg::ReadData {
                xfer,
                idx: 0,
                at: 0,
                len: 4096,
            };
            send(w, &h).unwrap();
            w.write_all(&[0x77; 4096]).unwrap();
        }
    });
    match st {
        XferStatus::Error(XferError::Protocol(why)) => {
            assert!(
                why.contains("repeater") && why.contains("did not ask"),
                "{why}"
            )
        }
        other => panic!("a repeated chunk must fail the READ, got {other:?}"),
    }
    assert!(
        out[4096..].iter().all(|&b| b == 0x5A),
        "nothing landed for #1"
    );
}

/// A peer that stops in the middle of a WRITE chunk cannot make deregistration hang: it
/// gives up after `deregister_wait`, says what held it, and the region stays usable.
#[test]
fn a_stalled_chunk_times_the_deregistration_out_and_the_region_stays() {
    let p = Agent::new(
        "p-stall",
        AgentConfig {
            deregister_wait: Duration::from_millis(300),
            ..tcp()
        },
    )
    .unwrap();
    let region = p.register(4 * MIB, RemoteAccess::WRITE, vec![]).unwrap();
    let (mut w, _r) = attach_to(&p, "d-stall");
    let h = Msg::WriteData {
        xfer: 3,
        region: region.0,
        offset: 0,
        len: 4 * MIB as u32,
        grant: 0,
    };
    send(&mut w, &h).unwrap();
    w.write_all(&[1; 1000]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let e = p.deregister(region).unwrap_err();
    assert!(
        matches!(e, AgentError::DeregisterTimeout { region: r, .. } if r == region.0),
        "{e}"
    );
    assert!(e.to_string().contains("chunk"), "{e}");
    assert_eq!(
        p.region_len(region).unwrap(),
        4 * MIB as u64,
        "still registered"
    );
    // the peer goes: the chunk ends, and the region can go
    w.shutdown(std::net::Shutdown::Both).unwrap();
    let t = Instant::now();
    while p.deregister(region).is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "never deregistered");
        std::thread::sleep(Duration::from_millis(20));
    }
}
