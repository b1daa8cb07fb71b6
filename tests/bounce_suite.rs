//! NPU memory through the agent's own API, on both backends: TCP on any host (`cargo test`:
//! device memory moves by copies through the runtime) and verbs inside the kvrail lab
//! (`tools/test.sh`: the agent's host-bounce path, staging slots and pipelined chunks),
//! where host A's agent uses rxeA* and host B's rxeB*. The NPU memory is kvrail's test
//! runtime (the public RBLN C API on host memory, compiled here from C and loaded through
//! rbln-sys), so every byte crosses `rbln_memcpy` device → host, the fabric, and
//! `rbln_memcpy` host → device; the test runtime refuses copies whose device side is not
//! its memory. Byte-exact both ways for NPU↔NPU, NPU↔host and host↔NPU; the notification
//! only after every byte is in the destination's memory; descriptor validation; device copy
//! failures on either side; a vanished peer; malformed bounce messages; and (on verbs) the
//! dma-buf probe saying "unsupported" on rxe with the fallback engaging.

mod lab;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::{
    Agent, AgentConfig, AgentError, Desc, Fault, MemRegion, RegionId, RemoteAccess, XferId, XferOp,
    XferStatus,
};
use kvrail::bounce::BounceConfig;
use kvrail::mem::{DeviceMemory, HostBuffer, KvBufferDevice, MemError, MemoryPath, NpuMemory};
use rbln_sys::RblnLib;

use lab::cache::runtime;

fn on_verbs() -> bool {
    lab::Topology::from_env().is_some()
}

fn agent_with(name: &str, host_a: bool, bounce: BounceConfig) -> Agent {
    let c = AgentConfig {
        bounce,
        ..lab::agent_config(host_a)
    };
    Agent::new(name, c).unwrap()
}

fn small_slots() -> BounceConfig {
    BounceConfig {
        slots: 3,
        slot_size: 256 << 10,
        ..BounceConfig::default()
    }
}

/// Prefill (host B) and decode (host A), each with the other loaded; (p, d, d's name for p).
fn pair(cfg: BounceConfig) -> (Agent, Agent, String) {
    let p = agent_with("prefill-0", false, cfg.clone());
    let d = agent_with("decode-0", true, cfg);
    let name = d.load_remote(p.side_channel_addr()).unwrap();
    assert_eq!(name, "prefill-0");
    relink(&p, &d);
    (p, d, name)
}

/// Each side reloads the other's metadata (after registering memory).
fn relink(p: &Agent, d: &Agent) {
    d.load_remote(p.side_channel_addr()).unwrap();
    p.load_remote(d.side_channel_addr()).unwrap();
}

/// Register device memory `m` (device `dev`) for peers to READ and WRITE.
fn dev(a: &Agent, m: Arc<dyn DeviceMemory>, dev: i32) -> RegionId {
    a.register_memory(MemRegion::device(m, dev).access(RemoteAccess::READ_WRITE))
        .unwrap()
}

/// Register host memory of `len` bytes holding `bytes` at 0.
fn host(a: &Agent, len: u64, bytes: &[u8]) -> (RegionId, Arc<HostBuffer>) {
    let b = HostBuffer::new(len as usize).unwrap();
    b.write(0, bytes).unwrap();
    let r = a
        .register_memory(MemRegion::host(b.clone()).access(RemoteAccess::READ_WRITE))
        .unwrap();
    (r, b)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| lab::pattern_byte(seed, i))
        .collect()
}

fn wait(b: &Agent, x: XferId) -> XferStatus {
    let s = b.wait(x, Duration::from_secs(120)).unwrap();
    assert_ne!(s, XferStatus::InProgress, "transfer {x:?} hung");
    s
}

fn npu(lib: &Arc<RblnLib>, dev: i32, len: u64) -> Arc<NpuMemory> {
    NpuMemory::new(lib, dev, len).unwrap()
}

fn read_dev(m: &dyn DeviceMemory, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    m.copy_to_host(off, &mut v).unwrap();
    v
}

/// Wait for one engine notification at `b`.
fn next_notif(b: &Agent) -> (String, Vec<u8>) {
    let t = Instant::now();
    loop {
        if let Some(n) = b.get_new_notifs().into_iter().next() {
            return n;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no notification");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Descriptors of `sizes` packed with 64-byte gaps from offset 5.
fn layout(sizes: &[u64]) -> (Vec<(u64, u64)>, u64) {
    let mut off = 5;
    let v = sizes
        .iter()
        .map(|&s| {
            let d = (off, s);
            off += s + 64;
            d
        })
        .collect();
    (v, off)
}

/// Which memory a side of a transfer uses.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Npu,
    Host,
}

/// A region of `kind` holding `total` bytes, filled with `fill`, with a handle to read it.
fn region(
    a: &Agent,
    kind: Kind,
    lib: &Arc<RblnLib>,
    n: i32,
    total: u64,
    fill: &[u8],
) -> (RegionId, Arc<dyn DeviceMemory>) {
    match kind {
        Kind::Npu => {
            let m = npu(lib, n, total);
            m.copy_from_host(0, fill).unwrap();
            (dev(a, m.clone(), n), m)
        }
        Kind::Host => {
            let (r, b) = host(a, total, fill);
            (r, b)
        }
    }
}

/// WRITE P → D and READ D ← P of `sizes`, P's memory `pk`, D's `dk`, each checked byte for
/// byte, the notification checked to come after every byte.
fn both_ways_kinds(cfg: BounceConfig, sizes: &[u64], pk: Kind, dk: Kind) -> (Agent, Agent) {
    let lib = runtime();
    let (p, d, peer) = pair(cfg);
    let (descs, total) = layout(sizes);
    let src_pat = pattern(1, total as usize);
    let (ps, src) = region(&p, pk, &lib, 0, total, &src_pat);
    let (ds, dst) = region(&d, dk, &lib, 1, total, &[]);
    relink(&p, &d);
    let ddesc: Vec<Desc> = descs.iter().map(|&(o, l)| Desc::new(ds, o, l)).collect();
    let pdesc: Vec<Desc> = descs.iter().map(|&(o, l)| Desc::new(ps, o, l)).collect();
    let w = p
        .create_xfer(
            XferOp::Write,
            pdesc.clone(),
            "decode-0",
            ddesc.clone(),
            Some(b"written".to_vec()),
        )
        .unwrap();
    p.post(w).unwrap();
    // the notification first: when it is here, every byte must be in D's memory
    let (from, n) = next_notif(&d);
    assert_eq!(
        (from.as_str(), n.as_slice()),
        ("prefill-0", &b"written"[..])
    );
    let got = read_dev(&*dst, 0, total as usize);
    for &(o, l) in &descs {
        let r = o as usize..(o + l) as usize;
        assert!(
            got[r.clone()] == src_pat[r],
            "{pk:?} → {dk:?} WRITE: bytes at {o}+{l} differ"
        );
    }
    assert_eq!(wait(&p, w), XferStatus::Done);
    p.release(w).unwrap();

    // READ the other way: D pulls a new pattern from P's memory
    let pat2 = pattern(2, total as usize);
    src.copy_from_host(0, &pat2).unwrap();
    let r = d
        .create_xfer(XferOp::Read, ddesc, &peer, pdesc, Some(b"read".to_vec()))
        .unwrap();
    d.post(r).unwrap();
    assert_eq!(wait(&d, r), XferStatus::Done);
    let got = read_dev(&*dst, 0, total as usize);
    for &(o, l) in &descs {
        let r = o as usize..(o + l) as usize;
        assert!(
            got[r.clone()] == pat2[r],
            "{pk:?} ← {dk:?} READ: bytes at {o}+{l} differ"
        );
    }
    assert_eq!(next_notif(&p), ("decode-0".to_owned(), b"read".to_vec()));
    (p, d)
}

fn both_ways(cfg: BounceConfig, sizes: &[u64]) -> (Agent, Agent) {
    both_ways_kinds(cfg, sizes, Kind::Npu, Kind::Npu)
}

#[test]
fn npu_to_npu_both_ways_byte_exact_in_pipelined_chunks() {
    let sizes = [1, 4095, (1 << 20) + 3, 3 << 20, 65536, 7];
    let (p, d) = both_ways(small_slots(), &sizes);
    let total: u64 = sizes.iter().sum();
    let (Some(s), Some(ds)) = (p.bounce_stats(), d.bounce_stats()) else {
        assert!(!on_verbs(), "no bounce engine on verbs");
        // TCP: the runtime's copies move device memory, every byte once per transfer
        assert_eq!(p.payload_bytes_copied(), 2 * total);
        return;
    };
    // P sends for its WRITE and for D's READ: each byte once per transfer
    assert_eq!(s.bytes_sent, 2 * total, "{s:?}");
    assert!(s.chunks_sent >= 2 * total.div_ceil(256 << 10), "{s:?}");
    assert!(s.max_in_flight >= 2, "chunks overlapped: {s:?}");
    assert_eq!(ds.chunks_received, s.chunks_sent);
    assert_eq!(ds.bytes_sent, 0);
    assert_eq!(s.malformed + ds.malformed, 0);
}

/// Host memory on one side, NPU memory on the other, both directions and both operations.
#[test]
fn npu_and_host_memory_mixed_both_ways() {
    let sizes = [3, (1 << 20) + 5, 4096];
    both_ways_kinds(small_slots(), &sizes, Kind::Npu, Kind::Host);
    both_ways_kinds(small_slots(), &sizes, Kind::Host, Kind::Npu);
}

#[test]
fn a_thousand_small_descriptors() {
    let sizes: Vec<u64> = (0..1000).map(|i| 4096 + (i % 7) * 13).collect();
    both_ways(BounceConfig::default(), &sizes);
}

#[test]
fn an_empty_transfer_still_notifies() {
    let (p, d) = both_ways(small_slots(), &[]);
    if let (Some(a), Some(b)) = (p.bounce_stats(), d.bounce_stats()) {
        assert_eq!(a.bytes_sent + b.bytes_sent, 0);
    }
}

#[test]
fn bad_descriptors_are_rejected_naming_side_and_index() {
    let lib = runtime();
    let (p, d, _) = pair(small_slots());
    let ps = dev(&p, npu(&lib, 0, 4096), 0);
    let ds = dev(&d, npu(&lib, 1, 4096), 1);
    relink(&p, &d);
    let ok = Desc::new(ps, 0, 100);
    let remote = Desc::new(ds, 0, 100);
    let cases = [
        (
            vec![Desc::new(RegionId(99), 0, 100)],
            vec![remote],
            "local descriptor #0: region 99 is not registered",
        ),
        (
            vec![ok, Desc::new(ps, 4000, 100)],
            vec![remote, remote],
            "local descriptor #1: [4000, 4000+100) is outside region",
        ),
        (
            vec![ok],
            vec![Desc::new(ds, 4090, 100)],
            "remote descriptor #0: [4090, 4090+100) is outside decode-0's region",
        ),
        (
            vec![ok],
            vec![Desc::new(ds, 0, 99)],
            "remote descriptor #0: 99 bytes, the local descriptor has 100",
        ),
    ];
    for (l, r, want) in cases {
        let e = p
            .create_xfer(XferOp::Write, l, "decode-0", r, None)
            .unwrap_err();
        assert!(e.to_string().contains(want), "{e} (wanted {want})");
    }
    let e = p
        .create_xfer(XferOp::Write, vec![ok, ok], "decode-0", vec![remote], None)
        .unwrap_err();
    assert!(
        matches!(
            e,
            AgentError::LengthMismatch {
                local: 2,
                remote: 1
            }
        ),
        "{e}"
    );
    let e = p
        .create_xfer(XferOp::Write, vec![ok], "nobody", vec![remote], None)
        .unwrap_err();
    assert!(matches!(e, AgentError::UnknownPeer(_)), "{e}");
    if on_verbs() {
        let c = AgentConfig {
            bounce: BounceConfig {
                slots: 0,
                ..BounceConfig::default()
            },
            ..lab::agent_config(true)
        };
        let e = Agent::new("x", c).unwrap_err();
        assert!(e.to_string().contains("staging slot"), "{e}");
    }
}

/// Device memory whose runtime refuses copies at or beyond `bad_from` (while `on`).
#[derive(Debug)]
struct Refusing {
    mem: Arc<HostBuffer>,
    bad_from: u64,
    on: std::sync::atomic::AtomicBool,
}

impl Refusing {
    fn refuses(&self, end: u64) -> bool {
        self.on.load(std::sync::atomic::Ordering::SeqCst) && end > self.bad_from
    }
}

impl DeviceMemory for Refusing {
    fn kind(&self) -> &'static str {
        "refusing"
    }
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn copy_to_host(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        if self.refuses(offset + out.len() as u64) {
            return Err(MemError::Device("test device refuses D2H here".into()));
        }
        self.mem.copy_to_host(offset, out)
    }
    fn copy_from_host(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        if self.refuses(offset + data.len() as u64) {
            return Err(MemError::Device("test device refuses H2D here".into()));
        }
        self.mem.copy_from_host(offset, data)
    }
}

/// The transfer's error, checked to be of `fault`; its text.
fn failed(a: &Agent, x: XferId, what: &str, fault: Fault) -> String {
    match wait(a, x) {
        XferStatus::Error(e) => {
            assert_eq!(e.fault(), fault, "{what}: {e}");
            e.to_string()
        }
        s => panic!("{what} reported {s:?}"),
    }
}

#[test]
fn device_copy_failures_fail_the_transfer_and_withhold_the_notification() {
    let lib = runtime();
    let (p, d, peer) = pair(small_slots());
    let len = 2u64 << 20;
    let good = dev(&p, npu(&lib, 0, len), 0);
    let refusing = |bad_from| -> Arc<dyn DeviceMemory> {
        Arc::new(Refusing {
            mem: HostBuffer::new(len as usize).unwrap(),
            bad_from,
            on: true.into(),
        })
    };
    let d_bad = dev(&d, refusing(1 << 20), 1);
    let p_bad = dev(&p, refusing(1 << 20), 0);
    let d_good = dev(&d, npu(&lib, 1, len), 1);
    relink(&p, &d);
    let write = |src, dst, n: &[u8]| {
        let x = p
            .create_xfer(
                XferOp::Write,
                vec![Desc::new(src, 0, len)],
                "decode-0",
                vec![Desc::new(dst, 0, len)],
                Some(n.to_vec()),
            )
            .unwrap();
        p.post(x).unwrap();
        x
    };

    // the receiver cannot place the second MiB
    let e = failed(
        &p,
        write(good, d_bad, b"must not arrive"),
        "a refused placement",
        Fault::Peer,
    );
    assert!(e.contains("refuses H2D"), "{e}");
    if on_verbs() {
        assert!(e.contains("could not place a chunk"), "{e}");
    }
    // the sender cannot read its second MiB
    let e = failed(
        &p,
        write(p_bad, d_good, b"nor this"),
        "a refused device read",
        Fault::Memory,
    );
    assert!(e.contains("refuses D2H"), "{e}");
    if on_verbs() {
        assert!(e.contains("copying out of local memory"), "{e}");
    }
    // a READ whose source (at the peer) cannot be read
    let r = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(d_good, 0, len)],
            &peer,
            vec![Desc::new(p_bad, 0, len)],
            Some(b"no".to_vec()),
        )
        .unwrap();
    d.post(r).unwrap();
    let e = failed(&d, r, "a READ of refused memory", Fault::Peer);
    assert!(e.contains("refuses D2H"), "{e}");
    if on_verbs() {
        assert!(e.contains("could not send"), "{e}");
    }

    // no engine notification for the failed transfers, and the link still works
    std::thread::sleep(Duration::from_millis(300));
    assert!(d.get_new_notifs().is_empty());
    assert!(p.get_new_notifs().is_empty());
    let x = p
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(good, 0, 1000)],
            "decode-0",
            vec![Desc::new(d_good, 0, 1000)],
            Some(b"fine".to_vec()),
        )
        .unwrap();
    p.post(x).unwrap();
    assert_eq!(wait(&p, x), XferStatus::Done);
    assert_eq!(next_notif(&d).1, b"fine");
}

#[test]
fn engine_notifications_pass_and_malformed_bounce_messages_are_dropped() {
    let (p, d, peer) = pair(small_slots());
    p.send_notif("decode-0", b"engine says hi".to_vec())
        .unwrap();
    assert_eq!(
        next_notif(&d),
        ("prefill-0".to_owned(), b"engine says hi".to_vec())
    );
    if !on_verbs() {
        eprintln!("SKIPPED on TCP: no host-bounce engine there to drop malformed messages");
        return;
    }
    // garbage behind the bounce prefix, straight through the agent
    let mut bad = b"\xffKVRB1".to_vec();
    bad.extend_from_slice(&[0xc1, 0xff, 0x00, 0x13]);
    d.send_notif(&peer, bad).unwrap();
    let t = Instant::now();
    while p.bounce_stats().unwrap().malformed == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "malformed message not seen"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.bounce_stats().unwrap().malformed, 1);
    assert!(p.get_new_notifs().is_empty(), "not passed to the engine");
    d.send_notif(&peer, b"still linked".to_vec()).unwrap();
    assert_eq!(next_notif(&p).1, b"still linked");
}

#[test]
fn a_vanished_peer_fails_transfers_in_bounded_time() {
    let lib = runtime();
    let cfg = BounceConfig {
        ack_timeout: Duration::from_secs(3),
        ..small_slots()
    };
    let (p, d, _) = pair(cfg);
    let src = dev(&p, npu(&lib, 0, 8 << 20), 0);
    let dst = dev(&d, npu(&lib, 1, 8 << 20), 1);
    relink(&p, &d);
    let x = p
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, 8 << 20)],
            "decode-0",
            vec![Desc::new(dst, 0, 8 << 20)],
            None,
        )
        .unwrap();
    drop(d); // the decode side's agent goes away
    let t = Instant::now();
    // the post itself may already see the closed connection
    if p.post(x).is_ok() {
        let e = match wait(&p, x) {
            XferStatus::Error(e) => e,
            s => panic!("a transfer to a vanished peer: {s:?}"),
        };
        eprintln!("failed after {:?}: {e}", t.elapsed());
    }
    assert!(t.elapsed() < Duration::from_secs(60));
}

#[test]
fn dmabuf_probe_and_the_fallback_to_host_bounce() {
    let lib = runtime();
    let a = agent_with("probe", true, BounceConfig::default());
    let rails = a.dmabuf_support();
    let exporter = lib.dmabuf_export().map_err(|e| e.to_string());
    let path = MemoryPath::choose(KvBufferDevice::Rbln, exporter, &rails);
    let MemoryPath::HostBounce { reason } = &path else {
        panic!("{path:?}")
    };
    assert!(reason.contains("rbln_rdma_export_dmabuf"), "{reason}");
    if on_verbs() {
        // rxe has no dma-buf support: the probe says so on every rail
        assert_eq!(rails.len(), 2, "{rails:?}");
        for r in &rails {
            assert!(!r.supported && r.reason.contains("EOPNOTSUPP"), "{r:?}");
        }
        eprintln!("dma-buf probe on the lab's rails: {rails:?}");
        // even with an exporter, rxe forces host bounce, saying why
        let p = MemoryPath::choose(KvBufferDevice::Rbln, Ok(()), &rails);
        assert!(
            matches!(&p, MemoryPath::HostBounce { reason } if reason.contains("EOPNOTSUPP")),
            "{p:?}"
        );
    } else {
        assert!(rails.is_empty(), "TCP registers no device memory");
        eprintln!("SKIPPED (outside the lab): the dma-buf probe on real queue pairs");
    }
}

/// A repost right after a failure: acknowledgements (with errors) of the failed post that
/// arrive late must not count toward the new one, which must move every byte.
#[test]
fn a_repost_after_a_failure_is_judged_on_its_own_chunks() {
    let lib = runtime();
    let (p, d, _) = pair(small_slots());
    let len = 4u64 << 20;
    let src = npu(&lib, 0, len);
    let pat = pattern(9, len as usize);
    src.copy_from_host(0, &pat).unwrap();
    let ps = dev(&p, src, 0);
    let target = Arc::new(Refusing {
        mem: HostBuffer::new(len as usize).unwrap(),
        bad_from: 0,
        on: true.into(),
    });
    let ds = dev(&d, target.clone(), 1);
    relink(&p, &d);
    let x = p
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(ps, 0, len)],
            "decode-0",
            vec![Desc::new(ds, 0, len)],
            Some(b"second time".to_vec()),
        )
        .unwrap();
    for _ in 0..5 {
        target.on.store(true, std::sync::atomic::Ordering::SeqCst);
        p.post(x).unwrap();
        assert!(matches!(wait(&p, x), XferStatus::Error(_)));
        // the device recovers; repost at once, with the first post's chunks still around
        target.on.store(false, std::sync::atomic::Ordering::SeqCst);
        p.post(x).unwrap();
        let s = wait(&p, x);
        assert_eq!(
            s,
            XferStatus::Done,
            "the repost was judged by the failed post's chunks"
        );
        let mut got = vec![0u8; len as usize];
        target.mem.copy_to_host(0, &mut got).unwrap();
        assert!(got == pat, "repost: bytes differ");
        assert_eq!(next_notif(&d).1, b"second time");
    }
}
