//! The engine's own memory, on both backends (TCP here; verbs in the lab, where
//! `tools/test.sh` runs this suite): a `Vec`, a file mapping and a raw range the test owns
//! are registered in place, moved between two agents byte for byte both ways, and given
//! back holding what landed; on verbs the agents copy no payload byte. Registration
//! refusals name the problem; pooled layers reach the peer's metadata; NPU memory (the
//! engine's own allocation in kvrail's RBLN test runtime) moves on both (on verbs through
//! the agent's host bounce).

#![allow(unsafe_code)] // plays an engine handing kvrail raw addresses of memory it owns

mod lab;

use std::sync::Arc;

use kvrail::agent::metadata::MemKind;
use kvrail::agent::{
    Agent, AgentError, Desc, MemRegion, RegionId, RegisteredMemory, RemoteAccess, XferId, XferOp,
    XferStatus,
};
use kvrail::mem::{HostBuffer, NpuMemory};

fn on_verbs() -> bool {
    lab::Topology::from_env().is_some()
}

fn agents() -> (Agent, Agent, String) {
    let p = Agent::new("prefill-0", lab::agent_config(false)).unwrap();
    let d = Agent::new("decode-0", lab::agent_config(true)).unwrap();
    let peer = d.load_remote(p.side_channel_addr()).unwrap();
    (p, d, peer)
}

fn wait(a: &Agent, x: XferId) -> XferStatus {
    lab::wait_xfer(a, x)
}

fn run(a: &Agent, op: XferOp, l: Vec<Desc>, peer: &str, r: Vec<Desc>) {
    let x = a.create_xfer(op, l, peer, r, None).unwrap();
    a.post(x).unwrap();
    assert_eq!(wait(a, x), XferStatus::Done);
    a.release(x).unwrap();
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Three descriptors of odd sizes at odd offsets (the same offsets on both sides).
const SEGS: [(u64, u64); 3] = [(3, 4097), (8192, 65_537), (80_000, 1 << 20)];
const LEN: usize = 80_000 + (1 << 20) + 5;

#[test]
fn engine_vec_mmap_and_raw_memory_move_in_place_both_ways() {
    let (p, d, peer) = agents();
    // P: the engine's Vec, with its KV in it before registration
    let kv = lab::pattern(1, LEN);
    let pv = p
        .register_memory(
            MemRegion::vec(kv.clone())
                .unwrap()
                .access(RemoteAccess::READ_WRITE),
        )
        .unwrap();
    // D: a file mapping the test made, and a raw range of a box the test keeps
    let (file, path) = tempfile_in_target("agent-memory.map", LEN);
    // SAFETY: the test owns the file and nothing else maps it.
    let map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
    // removed once mapped (the lab's 9p target directory cannot map an unlinked file)
    std::fs::remove_file(path).unwrap();
    let dm = d.register_memory(MemRegion::mmap(map).unwrap()).unwrap();
    let mut raw = vec![0u8; LEN].into_boxed_slice();
    // SAFETY: `raw` outlives the registration (deregistered below, before it drops), and the
    // test reads it only while no transfer runs.
    let buf = unsafe { HostBuffer::from_raw(raw.as_mut_ptr() as usize, LEN) }.unwrap();
    let dr = d.register_memory(MemRegion::host(buf)).unwrap();
    d.load_remote(p.side_channel_addr()).unwrap();
    let descs = |r: RegionId| SEGS.iter().map(|&(o, l)| Desc::new(r, o, l)).collect();
    let moved: u64 = SEGS.iter().map(|s| s.1).sum();

    // READ P's Vec into D's mapping, then into D's raw range
    run(&d, XferOp::Read, descs(dm), &peer, descs(pv));
    run(&d, XferOp::Read, descs(dr), &peer, descs(pv));
    let mut want = vec![0u8; LEN];
    for &(o, l) in &SEGS {
        let r = o as usize..(o + l) as usize;
        want[r.clone()].copy_from_slice(&kv[r]);
    }
    // the raw range is the test's own memory: read it directly, no agent call in between
    assert_eq!(first_diff(&raw, &want), None, "READ into the raw range");
    assert_eq!(raw[..], want[..]);

    // WRITE new bytes from D's raw range into P's Vec
    let fresh = lab::pattern(2, LEN);
    raw.copy_from_slice(&fresh);
    run(&d, XferOp::Write, descs(dr), &peer, descs(pv));

    // every payload byte moved by the NIC in place on verbs; by socket copies on TCP
    let (pc, dc) = (p.payload_bytes_copied(), d.payload_bytes_copied());
    if on_verbs() {
        assert_eq!(
            (pc, dc),
            (0, 0),
            "kvrail copied payload of host regions on verbs"
        );
    } else {
        // the kernel sends from and receives into the memory itself; kvrail copies at most
        // the bytes it read ahead with a message's header, on the receiving side only (it
        // copied every byte once on each side before)
        println!("    TCP: {pc} + {dc} payload bytes copied for 3 x {moved} moved");
        assert!(pc + dc <= 3 * moved, "{pc} + {dc} for 3 x {moved}");
    }

    // the memory comes back to its owners holding what landed
    let back = p.deregister_memory(pv).unwrap().into_vec();
    let mut want_p = kv.clone();
    for &(o, l) in &SEGS {
        let r = o as usize..(o + l) as usize;
        want_p[r.clone()].copy_from_slice(&fresh[r]);
    }
    assert_eq!(back.len(), LEN);
    assert_eq!(first_diff(&back, &want_p), None, "WRITE into P's Vec");
    let map = d.deregister_memory(dm).unwrap().into_mmap().unwrap();
    assert_eq!(first_diff(&map, &want), None, "READ into D's mapping");
    d.deregister_memory(dr).unwrap();
    drop(raw);
}

fn tempfile_in_target(name: &str, len: usize) -> (std::fs::File, std::path::PathBuf) {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}-{name}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.set_len(len as u64).unwrap();
    (f, path)
}

#[test]
fn registrations_that_cannot_be_made_say_why_and_register_nothing() {
    let (p, _d, _) = agents();
    assert!(matches!(
        MemRegion::vec(Vec::new()),
        Err(AgentError::InvalidMemory(m)) if m.contains("at least one byte")
    ));
    let buf = HostBuffer::from_vec(vec![7u8; 8192]).unwrap();
    let whole = p.register_memory(MemRegion::host(buf.clone())).unwrap();
    // SAFETY: the range lies inside `buf`, alive for the whole test; it is refused anyway.
    let inner = unsafe { HostBuffer::from_raw(buf.addr() as usize + 4096, 16) }.unwrap();
    let e = p.register_memory(MemRegion::host(inner)).unwrap_err();
    assert!(
        matches!(&e, AgentError::InvalidMemory(m) if m.contains("overlaps region")),
        "{e}"
    );
    // SAFETY: a null address is refused before anything touches it.
    let e = unsafe { HostBuffer::from_raw(0, 16) }.unwrap_err();
    assert!(e.to_string().contains("null"), "{e}");
    let e = p
        .register_memory(
            MemRegion::vec(vec![0; 4096])
                .unwrap()
                .pooled_layers(vec![("l0".into(), 0), ("l1".into(), 2048)], 4096),
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "memory: layer \"l1\" at offset 2048 (+4096 bytes) lies outside the 4096-byte region"
    );
    let ids: Vec<u32> = p.metadata().regions.iter().map(|r| r.id).collect();
    assert_eq!(ids, [whole.0], "refused registrations left nothing behind");
    // the test still shares the buffer: it comes back as shared, and the region is gone
    assert!(matches!(
        p.deregister_memory(whole),
        Ok(RegisteredMemory::HostShared(b)) if Arc::ptr_eq(&b, &buf)
    ));
    assert!(p.metadata().regions.is_empty());
}

#[test]
fn pooled_layers_reach_the_peer_and_address_the_right_bytes() {
    let (p, d, peer) = agents();
    // one allocation, three layers of 4 KiB at 0, 4 KiB and 8 KiB
    let kv = lab::pattern(3, 3 * 4096);
    let layers = vec![
        ("l0".to_string(), 0),
        ("l1".to_string(), 4096),
        ("l2".to_string(), 8192),
    ];
    let pool = p
        .register_memory(
            MemRegion::vec(kv.clone())
                .unwrap()
                .access(RemoteAccess::READ)
                .pooled_layers(layers, 4096),
        )
        .unwrap();
    d.load_remote(p.side_channel_addr()).unwrap();
    let meta = d.remote_metadata(&peer).unwrap();
    let r = meta.regions.iter().find(|r| r.id == pool.0).unwrap();
    assert_eq!(r.kind, MemKind::Host);
    assert_eq!(r.device, -1);
    assert_eq!(r.layer_span("l1"), Some((4096, 4096)));
    assert_eq!(r.layer_span("l9"), None);
    // READ layer l2 by its advertised span
    let (off, len) = r.layer_span("l2").unwrap();
    let dst = d
        .register_memory(MemRegion::vec(vec![0; 4096]).unwrap())
        .unwrap();
    run(
        &d,
        XferOp::Read,
        vec![Desc::new(dst, 0, len)],
        &peer,
        vec![Desc::new(pool, off, len)],
    );
    let got = d.deregister_memory(dst).unwrap().into_vec();
    assert_eq!(got[..], kv[8192..]);
}

use lab::cache::runtime;

#[test]
fn engine_npu_memory_registers_in_place_and_moves() {
    let lib = runtime();
    let (p, d, peer) = agents();
    // the engine allocated its cache itself; kvrail borrows it by address
    let owned = NpuMemory::new(&lib, 1, 1 << 20).unwrap();
    let addr = owned.addr();
    // SAFETY: `owned` stays allocated until the end of the test, after deregistration.
    let engine = unsafe { NpuMemory::from_raw(&lib, 1, addr, 1 << 20) }.unwrap();
    // an address outside every allocation is refused by name
    // SAFETY: refused by the runtime's check before any use.
    let e = unsafe { NpuMemory::from_raw(&lib, 1, addr + (1 << 20), 64) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("outside every allocation of device 1"),
        "{e}"
    );
    let kv = lab::pattern(4, 1 << 20);
    use kvrail::mem::DeviceMemory;
    engine.copy_from_host(0, &kv).unwrap();
    let reg = p.register_memory(MemRegion::device(engine, 1).access(RemoteAccess::READ));
    let src = reg.unwrap();
    d.load_remote(p.side_channel_addr()).unwrap();
    let meta = d.remote_metadata(&peer).unwrap();
    let r = meta.regions.iter().find(|r| r.id == src.0).unwrap();
    assert_eq!((r.kind, r.device), (MemKind::Npu, 1));
    // NPU → host (READ), then host → the engine's NPU memory on D
    let dst_npu = NpuMemory::new(&lib, 0, 1 << 20).unwrap();
    let dst = d
        .register_memory(MemRegion::device(dst_npu.clone(), 0))
        .unwrap();
    run(
        &d,
        XferOp::Read,
        vec![Desc::new(dst, 5, 700_000)],
        &peer,
        vec![Desc::new(src, 11, 700_000)],
    );
    let mut got = vec![0u8; 700_000];
    dst_npu.copy_to_host(5, &mut got).unwrap();
    assert_eq!(first_diff(&got, &kv[11..700_011]), None);
    // on verbs the agent staged it (host bounce); on TCP the runtime's copies fed the socket
    match (p.bounce_stats(), on_verbs()) {
        (Some(s), true) => assert_eq!(s.bytes_sent, 700_000, "{s:?}"),
        (None, false) => assert_eq!(p.payload_bytes_copied(), 700_000),
        (s, v) => panic!("bounce stats {s:?} on verbs={v}"),
    }
    d.deregister_memory(dst).unwrap();
    p.deregister_memory(src).unwrap();
    drop(owned);
}
