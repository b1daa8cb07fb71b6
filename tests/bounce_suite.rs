//! Host bounce between two agents' NPU memories, on both backends: TCP on any host (`cargo
//! test`), verbs inside the kvrail lab (`tools/test.sh`), where host A's agent uses rxeA*
//! and host B's rxeB*. The NPU memory is kvrail's test runtime (the public RBLN C API on host
//! memory, compiled here from C and loaded through rbln-sys), so every byte crosses
//! `rbln_memcpy` device → host, the fabric, and `rbln_memcpy` host → device; the test
//! runtime refuses copies whose device side is not its memory. Byte-exact both ways; the
//! notification only after every byte is in device memory; descriptor validation; device
//! copy failures on either side; a vanished peer; malformed bounce messages; and (on verbs)
//! the dma-buf probe saying "unsupported" on rxe with the fallback engaging.

mod lab;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, AgentError, XferId, XferOp, XferStatus};
use kvrail::bounce::{Bounce, BounceConfig, DevDesc, DevRegionId};
use kvrail::mem::{DeviceMemory, HostBuffer, KvBufferDevice, MemError, MemoryPath, NpuMemory};
use rbln_sys::RblnLib;

fn runtime() -> Arc<RblnLib> {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bounce-rbln");
    let p = rbln_sys::test_runtime::build(&dir, &[]).expect("building the RBLN test runtime");
    RblnLib::load_from(p.to_str().unwrap()).expect("loading the RBLN test runtime")
}

fn agent(name: &str, host_a: bool) -> Arc<Agent> {
    Arc::new(Agent::new(name, lab::agent_config(host_a)).unwrap())
}

fn small_slots() -> BounceConfig {
    BounceConfig {
        slots: 3,
        slot_size: 256 << 10,
        ..BounceConfig::default()
    }
}

/// Prefill (host B) and decode (host A), linked; returns (p, d, d's name for p).
fn pair(cfg: BounceConfig) -> (Bounce, Bounce, String) {
    let p = Bounce::new(agent("prefill-0", false), cfg.clone()).unwrap();
    let d = Bounce::new(agent("decode-0", true), cfg).unwrap();
    let name = d.connect(p.agent().side_channel_addr()).unwrap();
    assert_eq!(name, "prefill-0");
    (p, d, name)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| lab::pattern_byte(seed, i))
        .collect()
}

fn wait(b: &Bounce, x: XferId) -> XferStatus {
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
fn next_notif(b: &Bounce) -> (String, Vec<u8>) {
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

/// WRITE P → D and READ D ← P of `sizes`, each checked byte for byte in device memory, the
/// notification checked to come after every byte.
fn both_ways(cfg: BounceConfig, sizes: &[u64]) -> (Bounce, Bounce) {
    let lib = runtime();
    let (p, d, peer) = pair(cfg);
    let (descs, total) = layout(sizes);
    let src = npu(&lib, 0, total);
    let dst = npu(&lib, 1, total);
    let src_pat = pattern(1, total as usize);
    src.copy_from_host(0, &src_pat).unwrap();
    let ps = p.add_device_memory(src.clone());
    let ds = d.add_device_memory(dst.clone());
    // P learns D's regions from D's Hello: wait until the WRITE validates
    let ddesc: Vec<DevDesc> = descs.iter().map(|&(o, l)| DevDesc::new(ds, o, l)).collect();
    let pdesc: Vec<DevDesc> = descs.iter().map(|&(o, l)| DevDesc::new(ps, o, l)).collect();
    let w = retry(|| {
        p.create_xfer(
            XferOp::Write,
            pdesc.clone(),
            "decode-0",
            ddesc.clone(),
            Some(b"written".to_vec()),
        )
    });
    p.post(w).unwrap();
    // the notification first: when it is here, every byte must be in D's device memory
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
            "WRITE: bytes at {o}+{l} differ"
        );
    }
    assert_eq!(wait(&p, w), XferStatus::Done);
    p.release(w).unwrap();

    // READ the other way: D pulls a new pattern from P's device memory
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
        assert!(got[r.clone()] == pat2[r], "READ: bytes at {o}+{l} differ");
    }
    assert_eq!(next_notif(&p), ("decode-0".to_owned(), b"read".to_vec()));
    (p, d)
}

/// Retry creation until the peer's device regions are known (its Hello may still travel).
fn retry(mut f: impl FnMut() -> Result<XferId, AgentError>) -> XferId {
    let t = Instant::now();
    loop {
        match f() {
            Ok(x) => return x,
            Err(AgentError::InvalidDesc { reason, .. })
                if reason.starts_with("no device region")
                    && t.elapsed() < Duration::from_secs(10) =>
            {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn npu_to_npu_both_ways_byte_exact_in_pipelined_chunks() {
    let sizes = [1, 4095, (1 << 20) + 3, 3 << 20, 65536, 7];
    let (p, d) = both_ways(small_slots(), &sizes);
    let total: u64 = sizes.iter().sum();
    let s = p.stats();
    // P sends for its WRITE and for D's READ: each byte once per transfer
    assert_eq!(s.bytes_sent, 2 * total, "{s:?}");
    assert!(s.chunks_sent >= 2 * total.div_ceil(256 << 10), "{s:?}");
    assert!(s.max_in_flight >= 2, "chunks overlapped: {s:?}");
    assert_eq!(d.stats().chunks_received, s.chunks_sent);
    assert_eq!(d.stats().bytes_sent, 0);
    assert_eq!(p.malformed() + d.malformed(), 0);
}

#[test]
fn a_thousand_small_descriptors() {
    let sizes: Vec<u64> = (0..1000).map(|i| 4096 + (i % 7) * 13).collect();
    both_ways(BounceConfig::default(), &sizes);
}

#[test]
fn an_empty_transfer_still_notifies() {
    let (p, d) = both_ways(small_slots(), &[]);
    assert_eq!(p.stats().bytes_sent + d.stats().bytes_sent, 0);
}

#[test]
fn bad_descriptors_are_rejected_naming_side_and_index() {
    let lib = runtime();
    let (p, d, _) = pair(small_slots());
    let ps = p.add_device_memory(npu(&lib, 0, 4096));
    let ds = d.add_device_memory(npu(&lib, 1, 4096));
    let ok = DevDesc::new(ps, 0, 100);
    let remote = DevDesc::new(ds, 0, 100);
    retry(|| p.create_xfer(XferOp::Write, vec![ok], "decode-0", vec![remote], None));
    let cases = [
        (
            vec![DevDesc::new(DevRegionId(99), 0, 1)],
            vec![remote],
            "local descriptor #0: no device region 99",
        ),
        (
            vec![ok, DevDesc::new(ps, 4000, 100)],
            vec![remote, remote],
            "local descriptor #1: range [4000, 4000+100) is outside device region",
        ),
        (
            vec![ok],
            vec![DevDesc::new(ds, 4090, 100)],
            "remote descriptor #0: range [4090, 4090+100)",
        ),
        (
            vec![ok],
            vec![DevDesc::new(ds, 0, 99)],
            "remote descriptor #0: 99 bytes, local has 100",
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
    assert!(Bounce::new(
        agent("x", true),
        BounceConfig {
            slots: 0,
            ..BounceConfig::default()
        }
    )
    .is_err());
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

#[test]
fn device_copy_failures_fail_the_transfer_and_withhold_the_notification() {
    let lib = runtime();
    let (p, d, peer) = pair(small_slots());
    let len = 2u64 << 20;
    let good = p.add_device_memory(npu(&lib, 0, len));
    let refusing = |bad_from| -> Arc<dyn DeviceMemory> {
        Arc::new(Refusing {
            mem: HostBuffer::new(len as usize).unwrap(),
            bad_from,
            on: true.into(),
        })
    };
    let d_bad = d.add_device_memory(refusing(1 << 20));
    let p_bad = p.add_device_memory(refusing(1 << 20));
    let d_good = d.add_device_memory(npu(&lib, 1, len));

    // the receiver cannot place the second MiB
    let x = retry(|| {
        p.create_xfer(
            XferOp::Write,
            vec![DevDesc::new(good, 0, len)],
            "decode-0",
            vec![DevDesc::new(d_bad, 0, len)],
            Some(b"must not arrive".to_vec()),
        )
    });
    p.post(x).unwrap();
    let XferStatus::Error(e) = wait(&p, x) else {
        panic!("a refused placement reported success")
    };
    assert!(
        e.contains("could not place a chunk") && e.contains("refuses H2D"),
        "{e}"
    );

    // the sender cannot read its second MiB
    let x = p
        .create_xfer(
            XferOp::Write,
            vec![DevDesc::new(p_bad, 0, len)],
            "decode-0",
            vec![DevDesc::new(d_good, 0, len)],
            Some(b"must not arrive either".to_vec()),
        )
        .unwrap();
    p.post(x).unwrap();
    let XferStatus::Error(e) = wait(&p, x) else {
        panic!("a refused device read reported success")
    };
    assert!(
        e.contains("copying from device memory") && e.contains("refuses D2H"),
        "{e}"
    );

    // a READ whose source (at the peer) cannot be read
    let r = d
        .create_xfer(
            XferOp::Read,
            vec![DevDesc::new(d_good, 0, len)],
            &peer,
            vec![DevDesc::new(p_bad, 0, len)],
            Some(b"no".to_vec()),
        )
        .unwrap();
    d.post(r).unwrap();
    let XferStatus::Error(e) = wait(&d, r) else {
        panic!("a READ of refused memory reported success")
    };
    assert!(
        e.contains("could not send") && e.contains("refuses D2H"),
        "{e}"
    );

    // no engine notification for the failed transfers, and the link still works
    std::thread::sleep(Duration::from_millis(300));
    assert!(d.get_new_notifs().is_empty());
    assert!(p.get_new_notifs().is_empty());
    let x = p
        .create_xfer(
            XferOp::Write,
            vec![DevDesc::new(good, 0, 1000)],
            "decode-0",
            vec![DevDesc::new(d_good, 0, 1000)],
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
    // garbage behind the bounce prefix, straight through the agent
    let mut bad = b"\xffKVRB1".to_vec();
    bad.extend_from_slice(&[0xc1, 0xff, 0x00, 0x13]);
    d.agent().send_notif(&peer, bad).unwrap();
    let t = Instant::now();
    while p.malformed() == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "malformed message not seen"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(p.malformed(), 1);
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
    let src = p.add_device_memory(npu(&lib, 0, 8 << 20));
    let dst = d.add_device_memory(npu(&lib, 1, 8 << 20));
    let mk = || {
        p.create_xfer(
            XferOp::Write,
            vec![DevDesc::new(src, 0, 8 << 20)],
            "decode-0",
            vec![DevDesc::new(dst, 0, 8 << 20)],
            None,
        )
    };
    let x = retry(mk);
    drop(d); // the decode side's bounce and agent go away
    let t = Instant::now();
    p.post(x).unwrap();
    let XferStatus::Error(e) = wait(&p, x) else {
        panic!("a transfer to a vanished peer reported success")
    };
    eprintln!("failed after {:?}: {e}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(60));
}

#[test]
fn dmabuf_probe_and_the_fallback_to_host_bounce() {
    let lib = runtime();
    let a = agent("probe", true);
    let rails = a.dmabuf_support();
    let exporter = lib.dmabuf_export().map_err(|e| e.to_string());
    let path = MemoryPath::choose(KvBufferDevice::Rbln, exporter, &rails);
    let MemoryPath::HostBounce { reason } = &path else {
        panic!("{path:?}")
    };
    assert!(reason.contains("rbln_rdma_export_dmabuf"), "{reason}");
    if lab::Topology::from_env().is_some() {
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
    let ps = p.add_device_memory(src);
    let target = Arc::new(Refusing {
        mem: HostBuffer::new(len as usize).unwrap(),
        bad_from: 0,
        on: true.into(),
    });
    let ds = d.add_device_memory(target.clone());
    let x = retry(|| {
        p.create_xfer(
            XferOp::Write,
            vec![DevDesc::new(ps, 0, len)],
            "decode-0",
            vec![DevDesc::new(ds, 0, len)],
            Some(b"second time".to_vec()),
        )
    });
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
