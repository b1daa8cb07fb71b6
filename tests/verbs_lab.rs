//! The verbs suite on real queue pairs, run inside the kvrail lab (Soft-RoCE in a VM, see
//! tools/lab/README.md): this process is "host A" (rxeA<r>), a second process started from
//! this binary is "host B" (rxeB<r>); they exchange QP endpoints and region keys over a TCP
//! side channel. Every case runs on every rail and checks every byte that landed.
//! Outside the lab every case is reported SKIPPED (never silently passed).

mod lab;

use std::os::fd::AsRawFd;
use std::time::Duration;

use kvrail::transport::verbs::{
    Access, Completion, ConnectOptions, Context, Cq, Endpoint, Error, Mr, Mtu, OpKind, Pd,
    PortState, Qp, QpOptions, QpState, RemoteRegion, SendOp, SendWr, Sge,
};
use lab::peer::{wait_completions, Cmd, PeerConn, PeerProcess, Reply, PEER_ENV};
use lab::runner::Runner;
use lab::{layout, pattern, verify_region, Segment, Topology};

const WAIT: Duration = Duration::from_secs(120);

type R = Result<(), String>;
/// A lab case: topology, the peer process, the rail.
type Case = fn(&Topology, &PeerProcess, usize) -> R;

fn main() {
    if std::env::var_os(PEER_ENV).is_some() {
        lab::peer::serve();
    }
    let mut runner = Runner::new("verbs_lab");
    let cases: Vec<(&str, Case)> = vec![
        ("ports_and_gid_choice", ports_and_gid_choice),
        ("connect_validation", connect_validation),
        ("write_sizes_1b_to_8mib", write_sizes),
        ("read_sizes_1b_to_8mib", read_sizes),
        ("write_with_imm", write_with_imm),
        ("send_recv", send_recv),
        ("inline_sends_and_writes", inline_sends),
        ("thousands_of_wrs_in_flight", many_in_flight),
        ("remote_range_checked_before_posting", remote_range_checked),
        ("write_outside_remote_region_fails_naming_op", |t, p, r| {
            remote_access_error(t, p, r, OpKind::Write)
        }),
        ("read_outside_remote_region_fails_naming_op", |t, p, r| {
            remote_access_error(t, p, r, OpKind::Read)
        }),
        ("write_into_read_only_region_fails", write_into_read_only),
        ("deregister_busy_region_refused", deregister_busy),
        (
            "dropped_region_handle_stays_alive_in_flight",
            dropped_handle_in_flight,
        ),
        ("cq_channel_events_with_mio", cq_events_with_mio),
        ("path_mtu_is_the_smaller_of_both", path_mtu_min),
        ("outstanding_reads_follow_the_peer", outstanding_reads),
        ("notif_channel_burst_of_100k_ordered_no_rnr", notif_burst),
    ];
    let Some(topo) = Topology::from_env() else {
        println!("verbs_lab: not inside the kvrail lab (LAB_GUEST unset): every case SKIPPED");
        println!("verbs_lab: run it with `tools/lab/run.sh cargo test --test verbs_lab` or `tools/test.sh`");
        for (name, _) in &cases {
            runner.skip(&format!("rail*::{name}"));
        }
        runner.skip("two_rails::striped_write_and_read_into_one_buffer");
        runner.finish();
    };
    println!(
        "verbs_lab: {} rail(s), GID index {}, host A {:?}, host B {:?}",
        topo.rails, topo.gid_index, topo.a_devs, topo.b_devs
    );
    let peer = match PeerProcess::spawn() {
        Ok(p) => p,
        Err(e) => {
            runner.run("spawn_peer_process", || Err(e));
            runner.finish();
        }
    };
    for rail in 0..topo.rails {
        for (name, f) in &cases {
            runner.run(&format!("rail{rail}::{name}"), || f(&topo, &peer, rail));
        }
    }
    if topo.rails >= 2 {
        runner.run("two_rails::striped_write_and_read_into_one_buffer", || {
            striped_two_rails(&topo)
        });
    }
    drop(peer);
    runner.finish();
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Host A's side of a session.
struct Side {
    pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    peer: PeerConn,
    remote: RemoteRegion,
}

struct Opts {
    local_size: usize,
    local_access: Access,
    peer_size: usize,
    peer_access: &'static str,
    depth: u32,
    /// `max_inline_data` asked for host A's queue pair.
    inline: u32,
}

impl Opts {
    fn new(local_size: usize, peer_size: usize, peer_access: &'static str) -> Self {
        Self {
            local_size,
            local_access: Access::LOCAL_WRITE,
            peer_size,
            peer_access,
            depth: 256,
            inline: 0,
        }
    }
}

fn local_qp(t: &Topology, rail: usize, depth: u32) -> Result<(Context, Pd, Cq, Qp), String> {
    local_qp_inline(t, rail, depth, 0)
}

fn local_qp_inline(
    t: &Topology,
    rail: usize,
    depth: u32,
    inline: u32,
) -> Result<(Context, Pd, Cq, Qp), String> {
    let ctx = Context::open(&t.a_devs[rail]).map_err(s)?;
    let gid = ctx.choose_gid(1, Some(t.a_ips[rail])).map_err(s)?;
    let pd = Pd::new(&ctx).map_err(s)?;
    let cq = Cq::with_channel(&ctx, depth * 2 + 16).map_err(s)?;
    let mut o = QpOptions::new(1, gid.index);
    o.max_send_wr = depth;
    o.max_recv_wr = depth;
    o.max_inline_data = inline;
    let qp = Qp::new(&pd, &cq, &cq, &o).map_err(s)?;
    Ok((ctx, pd, cq, qp))
}

fn peer_setup(
    t: &Topology,
    peer: &PeerProcess,
    rail: usize,
    o: &Opts,
) -> Result<(PeerConn, Endpoint, RemoteRegion), String> {
    let mut conn = peer.connect()?;
    let cmd = Cmd::Setup {
        dev: t.b_devs[rail].clone(),
        port: 1,
        gid_index: t.gid_index,
        size: o.peer_size,
        access: o.peer_access.into(),
        depth: o.depth,
    };
    match conn.call(&cmd)? {
        Reply::Ready { endpoint, region } => Ok((conn, endpoint, region)),
        r => Err(format!("unexpected reply {r:?}")),
    }
}

fn setup(t: &Topology, peer: &PeerProcess, rail: usize, o: Opts) -> Result<Side, String> {
    let (mut conn, endpoint, remote) = peer_setup(t, peer, rail, &o)?;
    let (_ctx, pd, cq, qp) = local_qp_inline(t, rail, o.depth, o.inline)?;
    let mr = Mr::alloc(&pd, o.local_size, o.local_access).map_err(s)?;
    qp.connect(&endpoint, &ConnectOptions::default())
        .map_err(s)?;
    conn.ok(&Cmd::Connect {
        endpoint: qp.endpoint(),
    })?;
    Ok(Side {
        pd,
        cq,
        qp,
        mr,
        peer: conn,
        remote,
    })
}

/// The peer's next `count` receives (two minutes at most).
fn wait_recvs(peer: &mut PeerConn, count: usize) -> Result<Vec<lab::peer::RecvDone>, String> {
    match peer.call(&Cmd::WaitRecv {
        count,
        timeout_s: 120,
    })? {
        Reply::Recvs(recvs) => Ok(recvs),
        r => Err(format!("no receive list: {r:?}")),
    }
}

fn expect_ok(cs: &[Completion], want: &[u64]) -> R {
    let got: Vec<u64> = cs.iter().map(|c| c.wr_id).collect();
    if got != want {
        return Err(format!("completions for wr_ids {got:?}, expected {want:?}"));
    }
    for c in cs {
        if let Err(e) = &c.status {
            return Err(format!("completion failed: {e}"));
        }
    }
    Ok(())
}

fn fill(mr: &Mr, segs: &[Segment]) -> R {
    for g in segs {
        mr.write(g.offset, &pattern(g.seed.unwrap(), g.len))
            .map_err(s)?;
    }
    Ok(())
}

fn read_all(mr: &Mr) -> Vec<u8> {
    let mut v = vec![0u8; mr.len()];
    mr.read(0, &mut v).expect("whole region");
    v
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

const SIZES: [usize; 9] = [1, 3, 4095, 4096, 4097, 65536, 65537, 1 << 20, 8 << 20];

fn ports_and_gid_choice(t: &Topology, _: &PeerProcess, rail: usize) -> R {
    for (dev, ip) in [
        (&t.a_devs[rail], t.a_ips[rail]),
        (&t.b_devs[rail], t.b_ips[rail]),
    ] {
        let ctx = Context::open(dev).map_err(s)?;
        let port = ctx.query_port(1).map_err(s)?;
        ensure(port.state == PortState::Active, || {
            format!("{dev} port 1 is {}", port.state)
        })?;
        ensure(port.active_mtu == Some(Mtu::Mtu4096), || {
            format!("{dev} active MTU {:?}", port.active_mtu)
        })?;
        let dev_attr = ctx.query_device().map_err(s)?;
        ensure(dev_attr.phys_port_cnt == 1, || {
            format!("{dev}: {dev_attr:?}")
        })?;
        let table = ctx.gid_table(1).map_err(s)?;
        // entry-by-entry queries (the path for rdma-core < 32) see the same table
        for e in &table {
            let one = ctx
                .gid_entry(1, e.index)
                .map_err(s)?
                .ok_or("entry vanished")?;
            ensure(one.gid == e.gid && one.gid_type == e.gid_type, || {
                format!("{dev}: {one:?} vs {e:?}")
            })?;
        }
        ensure(ctx.gid_entry(1, 5).map_err(s)?.is_none(), || {
            format!("{dev}: GID[5] should be empty")
        })?;
        let g = ctx.choose_gid(1, None).map_err(s)?;
        println!("    {dev}: {} (table: {} entries)", g.reason, table.len());
        ensure(g.index == t.gid_index && g.gid.ipv4() == Some(ip), || {
            format!(
                "{dev}: chose {g:?}, lab says GID[{}] = {ip}; table {table:?}",
                t.gid_index
            )
        })?;
    }
    let bad = Context::open("no-such-rdma-dev")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure(
        bad.contains("not found") && bad.contains(&t.a_devs[rail]),
        || format!("open of a bad name: {bad:?}"),
    )
}

fn connect_validation(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let (mut conn, endpoint, remote) = peer_setup(t, peer, rail, &Opts::new(0, 4096, "w"))?;
    let (_ctx, pd, _cq, qp) = local_qp(t, rail, 16)?;
    let mr = Mr::alloc(&pd, 4096, Access::NONE).map_err(s)?;
    // posting before the QP is connected is refused by the layer, not the device
    let e = qp
        .post_send(&[SendWr::write(1, Sge::new(&mr, 0, 8), remote, 0)])
        .unwrap_err();
    ensure(
        matches!(
            e,
            Error::QpState {
                expected: "RTS",
                ..
            }
        ),
        || format!("post before connect: {e}"),
    )?;
    let e = qp
        .connect(&Endpoint { qpn: 0, ..endpoint }, &ConnectOptions::default())
        .unwrap_err();
    ensure(matches!(e, Error::BadEndpoint { .. }), || {
        format!("qpn 0: {e}")
    })?;
    let e = qp
        .connect(
            &Endpoint {
                gid: Default::default(),
                ..endpoint
            },
            &ConnectOptions::default(),
        )
        .unwrap_err();
    ensure(e.to_string().contains("GID is zero"), || {
        format!("zero gid: {e}")
    })?;
    qp.connect(&endpoint, &ConnectOptions::default())
        .map_err(s)?;
    ensure(qp.state().map_err(s)? == QpState::Rts, || {
        "not RTS after connect".into()
    })?;
    let e = qp
        .connect(&endpoint, &ConnectOptions::default())
        .unwrap_err();
    ensure(matches!(e, Error::QpState { state: "RTS", .. }), || {
        format!("second connect: {e}")
    })?;
    conn.ok(&Cmd::Connect {
        endpoint: qp.endpoint(),
    })
}

fn write_sizes(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let (segs, size) = layout(&SIZES, 100 + rail as u64);
    let mut side = setup(t, peer, rail, Opts::new(size, size, "w"))?;
    // a WRITE source needs no access rights beyond local read; registered with LOCAL_WRITE
    // only because fill() writes into it through the CPU (which needs none).
    fill(&side.mr, &segs)?;
    let wrs: Vec<SendWr<'_>> = segs
        .iter()
        .enumerate()
        .map(|(i, g)| {
            SendWr::write(
                i as u64,
                Sge::new(&side.mr, g.offset, g.len),
                side.remote,
                g.offset as u64,
            )
        })
        .collect();
    side.qp.post_send(&wrs).map_err(s)?;
    let cs = wait_completions(&side.cq, segs.len(), WAIT)?;
    expect_ok(&cs, &(0..segs.len() as u64).collect::<Vec<_>>())?;
    ensure(
        side.mr.in_flight() == 0 && side.qp.outstanding_sends() == 0,
        || "requests still tracked".into(),
    )?;
    side.peer.ok(&Cmd::Verify { segments: segs })
}

fn read_sizes(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let (segs, size) = layout(&SIZES, 200 + rail as u64);
    let mut side = setup(t, peer, rail, Opts::new(size, size, "r"))?;
    side.peer.ok(&Cmd::Fill {
        segments: segs.clone(),
    })?;
    side.qp
        .post_send(&reads(&side.mr, side.remote, &segs))
        .map_err(s)?;
    let cs = wait_completions(&side.cq, segs.len(), WAIT)?;
    expect_ok(&cs, &(0..segs.len() as u64).collect::<Vec<_>>())?;
    verify_region(&read_all(&side.mr), &segs)
}

/// One READ per segment, from the same offset of `remote` into `mr`, wr_id = its index.
fn reads<'a>(mr: &'a Mr, remote: RemoteRegion, segs: &[Segment]) -> Vec<SendWr<'a>> {
    segs.iter()
        .enumerate()
        .map(|(i, g)| {
            SendWr::read(
                i as u64,
                Sge::new(mr, g.offset, g.len),
                remote,
                g.offset as u64,
            )
        })
        .collect()
}

fn write_with_imm(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let sizes: Vec<usize> = (0..64).map(|i| 1 + i * 997).chain([1 << 20]).collect();
    let (segs, size) = layout(&sizes, 300 + rail as u64);
    let mut side = setup(t, peer, rail, Opts::new(size, size, "w"))?;
    side.peer.ok(&Cmd::PostRecv {
        count: segs.len(),
        len: 0,
    })?;
    fill(&side.mr, &segs)?;
    let wrs: Vec<SendWr<'_>> = segs
        .iter()
        .enumerate()
        .map(|(i, g)| SendWr {
            wr_id: i as u64,
            op: SendOp::WriteWithImm {
                remote: side.remote,
                offset: g.offset as u64,
                imm: 0xC0DE_0000 | i as u32,
            },
            local: [Sge::new(&side.mr, g.offset, g.len)].into_iter().collect(),
            signaled: i + 1 == segs.len(),
            inline: false,
        })
        .collect();
    side.qp.post_send(&wrs).map_err(s)?;
    let cs = wait_completions(&side.cq, 1, WAIT)?;
    expect_ok(&cs, &[segs.len() as u64 - 1])?;
    let recvs = wait_recvs(&mut side.peer, segs.len())?;
    for (i, r) in recvs.iter().enumerate() {
        ensure(
            r.error.is_none()
                && r.wr_id == i as u64
                && r.op == OpKind::RecvRdmaWithImm.to_string()
                && r.imm == Some(0xC0DE_0000 | i as u32)
                && r.byte_len as usize == segs[i].len,
            || {
                format!(
                    "receive {i}: {r:?}, expected imm {:#x}, {} bytes",
                    0xC0DE_0000 | i as u32,
                    segs[i].len
                )
            },
        )?;
    }
    side.peer.ok(&Cmd::Verify { segments: segs })
}

fn send_recv(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    const SLOT: usize = 65536;
    let sizes = [1usize, 2, 100, 4095, 4096, 4097, 9000, 65535, SLOT];
    let (segs, size) = layout(&sizes, 400 + rail as u64);
    let mut side = setup(t, peer, rail, Opts::new(size, SLOT * sizes.len(), ""))?;
    side.peer.ok(&Cmd::PostRecv {
        count: sizes.len(),
        len: SLOT,
    })?;
    fill(&side.mr, &segs)?;
    let wrs: Vec<SendWr<'_>> = segs
        .iter()
        .enumerate()
        .map(|(i, g)| SendWr::send(i as u64, Sge::new(&side.mr, g.offset, g.len)))
        .collect();
    side.qp.post_send(&wrs).map_err(s)?;
    expect_ok(
        &wait_completions(&side.cq, segs.len(), WAIT)?,
        &(0..segs.len() as u64).collect::<Vec<_>>(),
    )?;
    let recvs = wait_recvs(&mut side.peer, sizes.len())?;
    for (i, r) in recvs.iter().enumerate() {
        ensure(
            r.error.is_none()
                && r.wr_id == i as u64
                && r.op == "RECV"
                && r.byte_len as usize == sizes[i]
                && r.imm.is_none(),
            || format!("receive {i}: {r:?}, expected {} bytes", sizes[i]),
        )?;
    }
    // receive i landed at slot i
    let landed: Vec<Segment> = segs
        .iter()
        .enumerate()
        .map(|(i, g)| Segment {
            offset: i * SLOT,
            len: g.len,
            seed: g.seed,
        })
        .collect();
    side.peer.ok(&Cmd::Verify { segments: landed })
}

/// SENDs and a WRITE posted inline (`IBV_SEND_INLINE`) land byte for byte although their
/// source is overwritten right after posting; inline requests beyond the granted size, and
/// READs, are refused before posting.
fn inline_sends(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    const SLOT: usize = 4096;
    let mut o = Opts::new(8192, 4 * SLOT, "w");
    o.inline = 128;
    let mut side = setup(t, peer, rail, o)?;
    let max = side.qp.max_inline() as usize;
    ensure(max >= 128, || format!("max_inline {max} < the 128 asked"))?;
    let sizes = [1usize, 64, max, 100];
    let (segs, _) = layout(&sizes, 450 + rail as u64);
    side.peer.ok(&Cmd::PostRecv {
        count: 3,
        len: SLOT,
    })?;
    fill(&side.mr, &segs)?;
    let mut wrs: Vec<SendWr<'_>> = segs[..3]
        .iter()
        .enumerate()
        .map(|(i, g)| SendWr::send(i as u64, Sge::new(&side.mr, g.offset, g.len)).inlined())
        .collect();
    let w = &segs[3];
    let dst = 3 * SLOT as u64 + 5;
    wrs.push(SendWr::write(3, Sge::new(&side.mr, w.offset, w.len), side.remote, dst).inlined());
    side.qp.post_send(&wrs).map_err(s)?;
    // inline: the bytes were taken at post time
    side.mr.write(0, &vec![0u8; side.mr.len()]).map_err(s)?;
    expect_ok(&wait_completions(&side.cq, 4, WAIT)?, &[0, 1, 2, 3])?;
    let recvs = wait_recvs(&mut side.peer, 3)?;
    for (i, r) in recvs.iter().enumerate() {
        ensure(
            r.error.is_none() && r.wr_id == i as u64 && r.byte_len as usize == sizes[i],
            || format!("receive {i}: {r:?}, expected {} bytes", sizes[i]),
        )?;
    }
    let mut landed: Vec<Segment> = (segs[..3].iter().enumerate())
        .map(|(i, g)| Segment {
            offset: i * SLOT,
            len: g.len,
            seed: g.seed,
        })
        .collect();
    landed.push(Segment {
        offset: dst as usize,
        len: w.len,
        seed: w.seed,
    });
    side.peer.ok(&Cmd::Verify { segments: landed })?;
    // refused before posting, naming why
    let too_long = SendWr::send(9, Sge::new(&side.mr, 0, max + 1)).inlined();
    match side.qp.post_send(&[too_long]) {
        Err(e) if e.to_string().contains("inline") => {}
        other => {
            return Err(format!(
                "{} B inline > max_inline {max}: {other:?}",
                max + 1
            ))
        }
    }
    let read = SendWr::read(10, Sge::new(&side.mr, 0, 8), side.remote, 0).inlined();
    let posted = side.qp.post_send(&[read]);
    match posted {
        Err(e) if e.to_string().contains("cannot be posted inline") => Ok(()),
        other => Err(format!("an inline READ: {other:?}")),
    }
}

fn many_in_flight(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let max_wr = Context::open(&t.a_devs[rail])
        .map_err(s)?
        .query_device()
        .map_err(s)?
        .max_qp_wr;
    let depth = max_wr.min(4096);
    let n = depth as usize - 16;
    const LEN: usize = 1024;
    let segs: Vec<Segment> = (0..n)
        .map(|i| Segment {
            offset: i * LEN,
            len: LEN,
            seed: Some(5000 + i as u64),
        })
        .collect();
    let mut o = Opts::new(n * LEN, n * LEN, "w");
    o.depth = depth;
    let mut side = setup(t, peer, rail, o)?;
    fill(&side.mr, &segs)?;
    // one ibv_post_send for the whole list; only every 256th and the last are signaled
    let wrs: Vec<SendWr<'_>> = segs
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let wr = SendWr::write(
                i as u64,
                Sge::new(&side.mr, g.offset, g.len),
                side.remote,
                g.offset as u64,
            );
            if i % 256 == 255 || i + 1 == n {
                wr
            } else {
                wr.unsignaled()
            }
        })
        .collect();
    side.qp.post_send(&wrs).map_err(s)?;
    ensure(side.qp.outstanding_sends() == n, || {
        format!("{} tracked, posted {n}", side.qp.outstanding_sends())
    })?;
    ensure(side.mr.in_flight() == n, || {
        format!("region in-flight count {}", side.mr.in_flight())
    })?;
    let want: Vec<u64> = (0..n as u64)
        .filter(|i| i % 256 == 255 || *i + 1 == n as u64)
        .collect();
    expect_ok(&wait_completions(&side.cq, want.len(), WAIT)?, &want)?;
    ensure(
        side.qp.outstanding_sends() == 0 && side.mr.in_flight() == 0,
        || "requests still tracked".into(),
    )?;
    println!("    {n} WRITEs of {LEN} B posted in one list (send queue depth {depth})");
    side.peer.ok(&Cmd::Verify { segments: segs })
}

fn remote_range_checked(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let mut side = setup(t, peer, rail, Opts::new(8192, 4096, "rw"))?;
    let len = side.remote.len;
    for op in [OpKind::Write, OpKind::Read] {
        let sge = Sge::new(&side.mr, 0, 100);
        let bad = match op {
            OpKind::Write => SendWr::write(9, sge, side.remote, len - 10),
            _ => SendWr::read(9, sge, side.remote, len - 10),
        };
        let good = SendWr::write(8, Sge::new(&side.mr, 0, 8), side.remote, 0);
        // the bad request is second: nothing of the list may be posted
        let e = side.qp.post_send(&[good, bad]).unwrap_err().to_string();
        ensure(
            e.starts_with(&format!("{op} work request #1 (wr_id 9)"))
                && e.contains("outside the peer's 4096-byte region"),
            || format!("error was: {e}"),
        )?;
        ensure(
            side.qp.outstanding_sends() == 0 && side.mr.in_flight() == 0,
            || "something was posted".into(),
        )?;
    }
    // a local range outside the local region is refused too
    let e = side
        .qp
        .post_send(&[SendWr::write(
            3,
            Sge::new(&side.mr, 8000, 500),
            side.remote,
            0,
        )])
        .unwrap_err();
    ensure(
        e.to_string()
            .contains("local element 0: [8000, 8000+500) is outside the 8192-byte region"),
        || e.to_string(),
    )?;
    // and the QP is untouched: a valid WRITE still lands
    let segs = [Segment {
        offset: 0,
        len: 4096,
        seed: Some(77),
    }];
    fill(&side.mr, &segs)?;
    side.qp
        .post_send(&[SendWr::write(
            1,
            Sge::new(&side.mr, 0, 4096),
            side.remote,
            0,
        )])
        .map_err(s)?;
    expect_ok(&wait_completions(&side.cq, 1, WAIT)?, &[1])?;
    side.peer.ok(&Cmd::Verify {
        segments: segs.to_vec(),
    })
}

fn remote_access_error(t: &Topology, peer: &PeerProcess, rail: usize, op: OpKind) -> R {
    let mut side = setup(t, peer, rail, Opts::new(8192, 4096, "rw"))?;
    // A peer that advertised a region larger than it registered: the layer's own range
    // check passes, the device rejects the access.
    let lying = RemoteRegion {
        len: side.remote.len + (1 << 20),
        ..side.remote
    };
    let sge = Sge::new(&side.mr, 0, 4096);
    let wr = match op {
        OpKind::Write => SendWr::write(42, sge, lying, 64 << 10),
        _ => SendWr::read(42, sge, lying, 64 << 10),
    };
    side.qp.post_send(&[wr]).map_err(s)?;
    let cs = wait_completions(&side.cq, 1, WAIT)?;
    let err = cs[0]
        .status
        .clone()
        .err()
        .ok_or("out-of-region access completed successfully")?;
    println!("    {err}");
    ensure(
        err.op == op && err.wr_id == 42 && err.to_string().starts_with(&format!("{op} (wr_id 42)")),
        || format!("error does not name the operation: {err}"),
    )?;
    ensure(!err.is_flush(), || format!("first error is a flush: {err}"))?;
    ensure(side.mr.in_flight() == 0, || {
        "region still busy after the failed completion".into()
    })?;
    let e = side.qp.check().unwrap_err().to_string();
    ensure(
        e.contains("error state") && e.contains(&op.to_string()),
        || format!("check(): {e}"),
    )?;
    let e = side
        .qp
        .post_send(&[SendWr::write(43, Sge::new(&side.mr, 0, 8), side.remote, 0)])
        .unwrap_err();
    ensure(matches!(e, Error::QpInError { .. }), || {
        format!("post after error: {e}")
    })?;
    // the peer's memory is untouched
    side.peer.ok(&Cmd::Verify { segments: vec![] })
}

fn write_into_read_only(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    // least access: a pull producer registers REMOTE_READ only; WRITEs must bounce
    let mut side = setup(t, peer, rail, Opts::new(4096, 4096, "r"))?;
    fill(
        &side.mr,
        &[Segment {
            offset: 0,
            len: 4096,
            seed: Some(9),
        }],
    )?;
    side.qp
        .post_send(&[SendWr::write(
            5,
            Sge::new(&side.mr, 0, 4096),
            side.remote,
            0,
        )])
        .map_err(s)?;
    let cs = wait_completions(&side.cq, 1, WAIT)?;
    let err = cs[0]
        .status
        .clone()
        .err()
        .ok_or("WRITE into a read-only region succeeded")?;
    ensure(err.op == OpKind::Write, || err.to_string())?;
    side.peer.ok(&Cmd::Verify { segments: vec![] })
}

fn deregister_busy(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    const LEN: usize = 8 << 20;
    let mut side = setup(t, peer, rail, Opts::new(4096, LEN, "w"))?;
    let big = Mr::alloc(&side.pd, LEN, Access::NONE).map_err(s)?;
    let segs = vec![Segment {
        offset: 0,
        len: LEN,
        seed: Some(31),
    }];
    fill(&big, &segs)?;
    side.qp
        .post_send(&[SendWr::write(1, Sge::new(&big, 0, LEN), side.remote, 0)])
        .map_err(s)?;
    // the completion has not been polled, whatever the device did meanwhile
    let refused = big.deregister().unwrap_err();
    ensure(
        matches!(refused.error, Error::RegionBusy { in_flight: 1 }),
        || refused.error.to_string(),
    )?;
    let big = refused
        .region
        .ok_or("refused deregistration did not return the region")?;
    expect_ok(&wait_completions(&side.cq, 1, WAIT)?, &[1])?;
    big.deregister().map_err(s)?;
    side.peer.ok(&Cmd::Verify { segments: segs })
}

fn dropped_handle_in_flight(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    const LEN: usize = 4 << 20;
    let mut side = setup(t, peer, rail, Opts::new(4096, LEN, "w"))?;
    let segs = vec![Segment {
        offset: 0,
        len: LEN,
        seed: Some(57),
    }];
    {
        let tmp = Mr::alloc(&side.pd, LEN, Access::NONE).map_err(s)?;
        fill(&tmp, &segs)?;
        side.qp
            .post_send(&[SendWr::write(1, Sge::new(&tmp, 0, LEN), side.remote, 0)])
            .map_err(s)?;
        // `tmp` is dropped here, before its WRITE completed: the memory must stay mapped
    }
    // overwrite freshly mapped memory, which would reuse the pages if they had been freed
    let scratch = Mr::alloc(&side.pd, LEN, Access::NONE).map_err(s)?;
    scratch.write(0, &vec![0xEE; LEN]).map_err(s)?;
    expect_ok(&wait_completions(&side.cq, 1, WAIT)?, &[1])?;
    side.peer.ok(&Cmd::Verify { segments: segs })
}

fn cq_events_with_mio(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    use mio::unix::SourceFd;
    use mio::{Events, Interest, Poll, Token};
    let mut side = setup(t, peer, rail, Opts::new(65536, 65536, "w"))?;
    let mut poll = Poll::new().map_err(s)?;
    let fd = side.cq.as_raw_fd();
    poll.registry()
        .register(&mut SourceFd(&fd), Token(7), Interest::READABLE)
        .map_err(s)?;
    let mut events = Events::with_capacity(4);
    poll.poll(&mut events, Some(Duration::from_millis(50)))
        .map_err(s)?;
    ensure(events.is_empty(), || {
        "CQ channel readable while idle".into()
    })?;
    let segs = vec![Segment {
        offset: 0,
        len: 65536,
        seed: Some(71),
    }];
    fill(&side.mr, &segs)?;
    side.qp
        .post_send(&[SendWr::write(
            11,
            Sge::new(&side.mr, 0, 65536),
            side.remote,
            0,
        )])
        .map_err(s)?;
    poll.poll(&mut events, Some(WAIT)).map_err(s)?;
    ensure(
        events
            .iter()
            .any(|e| e.token() == Token(7) && e.is_readable()),
        || "no CQ event".into(),
    )?;
    ensure(side.cq.consume_event().map_err(s)?, || {
        "readable but no event to read".into()
    })?;
    let mut cs = Vec::new();
    side.cq.poll(&mut cs).map_err(s)?;
    expect_ok(&cs, &[11])?;
    // re-armed, nothing new: quiet again
    poll.poll(&mut events, Some(Duration::from_millis(50)))
        .map_err(s)?;
    ensure(events.is_empty(), || {
        "CQ channel readable with nothing completed".into()
    })?;
    side.peer.ok(&Cmd::Verify { segments: segs })
}

fn path_mtu_min(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    // Both ports run 4096; pretend the peer's port is at 1024: the QP must use 1024 and
    // still move a multi-packet message intact.
    let o = Opts::new(1 << 20, 1 << 20, "w");
    let (mut conn, endpoint, remote) = peer_setup(t, peer, rail, &o)?;
    let (_ctx, pd, cq, qp) = local_qp(t, rail, 16)?;
    ensure(qp.endpoint().mtu == Mtu::Mtu4096, || {
        format!("local endpoint {:?}", qp.endpoint())
    })?;
    qp.connect(
        &Endpoint {
            mtu: Mtu::Mtu1024,
            ..endpoint
        },
        &ConnectOptions::default(),
    )
    .map_err(s)?;
    ensure(qp.path_mtu().map_err(s)? == Mtu::Mtu1024, || {
        format!("path MTU {:?}", qp.path_mtu())
    })?;
    conn.ok(&Cmd::Connect {
        endpoint: Endpoint {
            mtu: Mtu::Mtu1024,
            ..qp.endpoint()
        },
    })?;
    let mr = Mr::alloc(&pd, 1 << 20, Access::NONE).map_err(s)?;
    let segs = vec![Segment {
        offset: 0,
        len: 1 << 20,
        seed: Some(91),
    }];
    fill(&mr, &segs)?;
    qp.post_send(&[SendWr::write(1, Sge::new(&mr, 0, 1 << 20), remote, 0)])
        .map_err(s)?;
    expect_ok(&wait_completions(&cq, 1, WAIT)?, &[1])?;
    conn.ok(&Cmd::Verify { segments: segs })
}

/// Outstanding READs: the device's own limit (perftest's default), never more than the
/// peer's endpoint says its responder serves (16 when it does not say: an older kvrail);
/// 64 READs posted at once on a queue pair that may keep 4 outstanding all land intact.
fn outstanding_reads(t: &Topology, peer: &PeerProcess, rail: usize) -> R {
    let dev = Context::open(&t.a_devs[rail])
        .map_err(s)?
        .query_device()
        .map_err(s)?;
    let init = dev.max_qp_init_rd_atom.clamp(1, 255) as u8;
    let serves = dev.max_qp_rd_atom.clamp(1, 255) as u8;
    const N: usize = 64;
    const LEN: usize = 16 << 10;
    for (says, want) in [
        (None, init.min(serves)),
        (Some(4u8), init.min(4)),
        (Some(0), init.min(16)),
    ] {
        let mut o = Opts::new(N * LEN, N * LEN, "r");
        o.depth = 2 * N as u32;
        let (mut conn, endpoint, remote) = peer_setup(t, peer, rail, &o)?;
        ensure(endpoint.rd_atomic == serves, || {
            format!(
                "the peer's endpoint says {} (device: {serves})",
                endpoint.rd_atomic
            )
        })?;
        let (_ctx, pd, cq, qp) = local_qp(t, rail, o.depth)?;
        ensure(qp.endpoint().rd_atomic == serves, || {
            format!("local endpoint {:?}", qp.endpoint())
        })?;
        let ep = match says {
            Some(n) => Endpoint {
                rd_atomic: n,
                ..endpoint
            },
            None => endpoint,
        };
        qp.connect(&ep, &ConnectOptions::default()).map_err(s)?;
        let got = qp.outstanding_reads().map_err(s)?;
        ensure(got == want, || {
            format!("peer says {says:?}: {got} outstanding READs, expected {want}")
        })?;
        conn.ok(&Cmd::Connect {
            endpoint: qp.endpoint(),
        })?;
        let segs: Vec<Segment> = (0..N)
            .map(|i| Segment {
                offset: i * LEN,
                len: LEN,
                seed: Some(7000 + i as u64 + u64::from(want) * 100),
            })
            .collect();
        conn.ok(&Cmd::Fill {
            segments: segs.clone(),
        })?;
        let mr = Mr::alloc(&pd, N * LEN, Access::LOCAL_WRITE).map_err(s)?;
        qp.post_send(&reads(&mr, remote, &segs)).map_err(s)?;
        let cs = wait_completions(&cq, N, WAIT)?;
        expect_ok(&cs, &(0..N as u64).collect::<Vec<_>>())?;
        verify_region(&read_all(&mr), &segs)?;
        println!("    peer says {says:?}: {got} outstanding READs, {N} READs of {LEN} B intact");
    }
    Ok(())
}

/// Message `i` of a notification stream: its index, then position-dependent bytes; every
/// 10,007th one is 20 KiB (many frames), the rest 8..104 bytes.
fn notif_msg(stream: u64, i: u64) -> Vec<u8> {
    let len = if i % 10_007 == 5 {
        20 << 10
    } else {
        (i % 97) as usize
    };
    let mut m = i.to_le_bytes().to_vec();
    m.extend(pattern(stream * 1_000_003 + i, len));
    m
}

fn notif_burst(t: &Topology, _: &PeerProcess, rail: usize) -> R {
    use kvrail::transport::notif::rdma::MsgChannel;
    const N: u64 = 100_000;
    const BACK: u64 = 1_000;
    const SLOTS: u32 = 64;
    // both ends in this process, one per device of the rail: the frames cross the wire
    let end = |dev: &str| -> Result<(Cq, Qp, MsgChannel), String> {
        let ctx = Context::open(dev).map_err(s)?;
        let gid = ctx.choose_gid(1, None).map_err(s)?;
        let pd = Pd::new(&ctx).map_err(s)?;
        let cq = Cq::new(&ctx, 4 * SLOTS + 64).map_err(s)?;
        let mut o = QpOptions::new(1, gid.index);
        o.max_send_wr = SLOTS + 16;
        o.max_recv_wr = SLOTS + 16;
        let qp = Qp::new(&pd, &cq, &cq, &o).map_err(s)?;
        let ch = MsgChannel::new(&pd, qp.clone(), SLOTS, 512).map_err(s)?;
        Ok((cq, qp, ch))
    };
    let (cq_a, qp_a, mut a) = end(&t.a_devs[rail])?;
    let (cq_b, qp_b, mut b) = end(&t.b_devs[rail])?;
    // rnr_retry 0: a frame that found no receive posted fails at once instead of retrying
    let opts = ConnectOptions {
        rnr_retry: 0,
        ..ConnectOptions::default()
    };
    qp_a.connect(&qp_b.endpoint(), &opts).map_err(s)?;
    qp_b.connect(&qp_a.endpoint(), &opts).map_err(s)?;
    for i in 0..N {
        a.send(notif_msg(1, i)).map_err(s)?;
    }
    for i in 0..BACK {
        b.send(notif_msg(2, i)).map_err(s)?;
    }
    let (mut got_b, mut got_a) = (0u64, 0u64);
    let start = std::time::Instant::now();
    let mut cs = Vec::new();
    // feed each channel its queue pair's completions
    let mut progress = |a: &mut MsgChannel, b: &mut MsgChannel| -> R {
        for (cq, ch) in [(&cq_a, a), (&cq_b, b)] {
            cs.clear();
            cq.poll(&mut cs).map_err(s)?;
            for c in &cs {
                ch.handle(c).map_err(s)?;
            }
        }
        Ok(())
    };
    while got_b < N || got_a < BACK {
        ensure(start.elapsed() < Duration::from_secs(240), || {
            format!(
                "stalled: B has {got_b} of {N}, A has {got_a} of {BACK}; backlogs {} / {}",
                a.backlog(),
                b.backlog()
            )
        })?;
        progress(&mut a, &mut b)?;
        while let Some(m) = b.recv() {
            ensure(m == notif_msg(1, got_b), || {
                format!(
                    "B: message {got_b} wrong or out of order ({} bytes)",
                    m.len()
                )
            })?;
            got_b += 1;
        }
        while let Some(m) = a.recv() {
            ensure(m == notif_msg(2, got_a), || {
                format!("A: message {got_a} wrong or out of order")
            })?;
            got_a += 1;
        }
    }
    // every message's last SEND completes at its sender: both count all of theirs delivered
    while a.delivered() < N || b.delivered() < BACK {
        ensure(start.elapsed() < Duration::from_secs(240), || {
            format!(
                "delivered {} of {N} / {} of {BACK}",
                a.delivered(),
                b.delivered()
            )
        })?;
        progress(&mut a, &mut b)?;
    }
    ensure(a.delivered() == N && b.delivered() == BACK, || {
        format!("delivered {} / {}", a.delivered(), b.delivered())
    })?;
    let (fa, ca) = a.frames_sent();
    let (fb, cb) = b.frames_sent();
    println!(
        "    {N} messages A->B and {BACK} B->A in {:.1} s; frames A {fa} ({ca} credit-only), B {fb} ({cb} credit-only)",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One buffer registered on both rails' devices on each side; a transfer planned by the
/// stripe planner goes half over rail 0 and half over rail 1 (WRITE), then comes back the
/// same way (READ); every byte is checked.
fn striped_two_rails(t: &Topology) -> R {
    use kvrail::transport::stripe::{DescPair, Planner, Progress, StripeMode, XferState};
    use kvrail::transport::verbs::HostBuffer;
    const LEN: usize = 4 << 20;
    let descs: Vec<DescPair> = (0..8u64)
        .map(|k| DescPair {
            local_region: 0,
            local_off: k * (512 << 10),
            remote_region: 0,
            remote_off: k * (512 << 10),
            len: 512 << 10,
        })
        .collect();
    let src = HostBuffer::new(LEN).map_err(s)?;
    let dst = HostBuffer::new(LEN).map_err(s)?;
    let back = HostBuffer::new(LEN).map_err(s)?;
    let bytes = pattern(4242, LEN);
    src.write(0, &bytes).map_err(s)?;
    struct RailEnd {
        cq: Cq,
        qp: Qp,
        src: Mr,
        back: Mr,
        remote: RemoteRegion,
        _peer: (Qp, Mr, Cq),
    }
    let mut rails = Vec::new();
    for r in 0..2 {
        let (_ctx, pd, cq, qp) = local_qp(t, r, 64)?;
        let ctx_b = Context::open(&t.b_devs[r]).map_err(s)?;
        let gid_b = ctx_b.choose_gid(1, None).map_err(s)?;
        let pd_b = Pd::new(&ctx_b).map_err(s)?;
        let cq_b = Cq::new(&ctx_b, 64).map_err(s)?;
        let qp_b = Qp::new(&pd_b, &cq_b, &cq_b, &QpOptions::new(1, gid_b.index)).map_err(s)?;
        // the same target buffer, registered on this rail's device
        let dst_mr =
            Mr::register(&pd_b, &dst, Access::REMOTE_WRITE | Access::REMOTE_READ).map_err(s)?;
        qp.connect(&qp_b.endpoint(), &ConnectOptions::default())
            .map_err(s)?;
        qp_b.connect(&qp.endpoint(), &ConnectOptions::default())
            .map_err(s)?;
        rails.push(RailEnd {
            cq,
            src: Mr::register(&pd, &src, Access::NONE).map_err(s)?,
            back: Mr::register(&pd, &back, Access::LOCAL_WRITE).map_err(s)?,
            qp,
            remote: dst_mr.remote(),
            _peer: (qp_b, dst_mr, cq_b),
        });
    }
    let mut planner = Planner::new(2);
    for write in [true, false] {
        let plan = planner
            .plan(&descs, StripeMode::Striped)
            .map_err(|e| e.to_string())?;
        ensure(plan.rails_used() == [0, 1], || {
            format!("plan uses rails {:?}", plan.rails_used())
        })?;
        let mut prog = Progress::new(&plan);
        for (r, slices) in plan.per_rail.iter().enumerate() {
            let e = &rails[r];
            let wrs: Vec<SendWr<'_>> = slices
                .iter()
                .enumerate()
                .map(|(i, sl)| {
                    let (mr, off) = if write {
                        (&e.src, sl.local_off)
                    } else {
                        (&e.back, sl.local_off)
                    };
                    let sge = Sge::new(mr, off as usize, sl.len as usize);
                    if write {
                        SendWr::write(i as u64, sge, e.remote, sl.remote_off)
                    } else {
                        SendWr::read(i as u64, sge, e.remote, sl.remote_off)
                    }
                })
                .collect();
            e.qp.post_send(&wrs).map_err(s)?;
        }
        for (r, slices) in plan.per_rail.iter().enumerate() {
            let cs = wait_completions(&rails[r].cq, slices.len(), WAIT)?;
            expect_ok(&cs, &(0..slices.len() as u64).collect::<Vec<_>>())?;
            let done = prog.complete(r, cs.len());
            planner.release(r, done);
        }
        ensure(prog.state() == XferState::Done, || {
            format!("{}", prog.state())
        })?;
        let mut got = vec![0u8; LEN];
        if write {
            dst.read(0, &mut got)
        } else {
            back.read(0, &mut got)
        }
        .map_err(s)?;
        let bad = got.iter().zip(&bytes).filter(|(a, b)| a != b).count();
        ensure(bad == 0, || {
            format!(
                "{} striped over 2 rails: {bad} wrong bytes",
                if write { "WRITE" } else { "READ" }
            )
        })?;
        println!(
            "    {}: {} bytes over rail 0, {} over rail 1, all checked",
            if write { "WRITE" } else { "READ" },
            plan.per_rail[0].iter().map(|x| x.len).sum::<u64>(),
            plan.per_rail[1].iter().map(|x| x.len).sum::<u64>()
        );
    }
    Ok(())
}
