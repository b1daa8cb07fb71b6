//! The agent on the verbs backend inside the kvrail lab: host A's agent (rxeA*) and host B's
//! agent (rxeB*), byte-exact READ and WRITE of descriptor lists over both rails, one rail per
//! transfer and striped, notifications after the data, and two agents in two processes.
//! Outside the lab every case is SKIPPED.

#[path = "agent_lab/bad_frame.rs"]
mod bad_frame;
#[path = "agent_lab/grant_cost.rs"]
mod grant_cost;
mod lab;
#[path = "agent_lab/lanes.rs"]
mod lanes;
#[path = "agent_lab/polling.rs"]
mod polling;
#[path = "agent_lab/stalled_drop.rs"]
mod stalled_drop;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvrail::agent::metadata::BackendKind;
use kvrail::agent::{
    Agent, AgentConfig, BackendChoice, Desc, RegionId, RemoteAccess, XferId, XferOp, XferStatus,
};
use lab::runner::Runner;
use lab::{pattern, wait_port, LinkSwitch, Topology};

type R = Result<(), String>;

fn ensure(c: bool, msg: impl FnOnce() -> String) -> R {
    if c {
        Ok(())
    } else {
        Err(msg())
    }
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// A verbs agent on `devs`, configured further by `more`.
fn verbs_agent(
    name: &str,
    devs: &[String],
    more: impl FnOnce(&mut AgentConfig),
) -> Result<Agent, String> {
    let mut cfg = AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend: BackendChoice::Verbs,
        devices: devs.to_vec(),
        ..AgentConfig::default()
    };
    more(&mut cfg);
    Agent::new(name, cfg).map_err(s)
}

fn agent(name: &str, devs: &[String], stripe: Option<i64>) -> Result<Agent, String> {
    verbs_agent(name, devs, |c| c.stripe_width = stripe)
}

/// An agent whose waiting callers poll the completion queues for `spin_us`
/// (`progress_spin_us`).
fn polling_agent(name: &str, devs: &[String], spin_us: u32) -> Result<Agent, String> {
    verbs_agent(name, devs, |c| c.progress_spin_us = spin_us)
}

fn wait(a: &Agent, x: XferId) -> Result<XferStatus, String> {
    let t = Instant::now();
    loop {
        let st = a.status(x).map_err(s)?;
        if st != XferStatus::InProgress {
            return Ok(st);
        }
        if t.elapsed() > Duration::from_secs(180) {
            return Err(format!("transfer {x:?} still in progress after 180 s"));
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

fn main() {
    if std::env::var_os("KVRAIL_AGENT_LAB_CHILD").is_some() {
        child();
        return;
    }
    let mut r = Runner::new("agent_lab");
    let cases = [
        "verbs_backend_and_rails_in_metadata",
        "one_rail_per_transfer_sizes_and_lists",
        "striped_over_two_rails_with_notification_after_data",
        "read_of_1000_descriptors_striped",
        "two_processes",
        "rail_down_mid_striped_transfer_completes_on_the_survivor",
        "notif_channel_rail_down_resends_over_tcp_once_in_order_then_is_rebuilt",
        "idle_connected_agents_use_no_cpu",
        "lossy_slow_rail_single_and_striped_byte_exact",
        "grant_cost_next_to_the_read_it_fences",
        "callers_that_poll_move_every_byte_and_notification_in_order",
        "a_reader_that_only_reads_notifications_polls",
        "a_sender_dropped_with_its_channel_stalled_sends_the_rest_over_tcp",
        "messages_in_the_receivers_queue_when_the_sender_drops_still_arrive",
        "a_malformed_frame_closes_the_channel_and_nothing_after_it_is_lost",
        "two_lanes_a_port_share_one_registration_byte_exact",
    ];
    let Some(t) = Topology::from_env() else {
        println!("agent_lab: not inside the kvrail lab (LAB_GUEST unset): every case SKIPPED");
        for c in cases {
            r.skip(c);
        }
        r.finish();
    };
    r.run(cases[0], || metadata_case(&t));
    r.run(cases[1], || transfers(&t, None));
    r.run(cases[2], || striped_notif(&t));
    r.run(cases[3], || read_many(&t));
    r.run(cases[4], || two_processes(&t));
    r.run(cases[5], || rail_down(&t));
    r.run(cases[6], || notif_rail_down(&t));
    r.run(cases[7], || idle_cpu(&t));
    r.run(cases[8], || lossy_rail(&t));
    r.run(cases[9], || grant_cost::grant_cost(&t));
    r.run(cases[10], || polling::callers_poll(&t));
    r.run(cases[11], || polling::readers_poll(&t));
    r.run(cases[12], || stalled_drop::stalled_channel_drop(&t));
    r.run(cases[13], || stalled_drop::queued_at_the_receiver(&t));
    r.run(cases[14], || bad_frame::bad_frame_closes_the_channel(&t));
    r.run(cases[15], || lanes::lanes_share_one_registration(&t));
    r.finish();
}

fn metadata_case(t: &Topology) -> R {
    let a = agent("host-a", &t.a_devs, None)?;
    let m = a.metadata();
    ensure(m.backend == BackendKind::Verbs, || {
        format!("backend {:?}", m.backend)
    })?;
    let names: Vec<&str> = m.rails.iter().map(|r| r.name.as_str()).collect();
    println!("    host A rails: {names:?}");
    ensure(names == ["rxeA0:1", "rxeA1:1"], || {
        format!("rails {names:?}")
    })?;
    let reg = a.register(4096, RemoteAccess::READ, vec![]).map_err(s)?;
    let m = a.metadata();
    let rm = m
        .regions
        .iter()
        .find(|r| r.id == reg.0)
        .ok_or("region missing")?;
    ensure(
        rm.rkeys.len() == 2 && rm.addr != 0 && rm.remote_read && !rm.remote_write,
        || format!("{rm:?}"),
    )
}

/// (region offset, length) of each descriptor, one after another with gaps.
fn layout(sizes: &[u64]) -> (Vec<(u64, u64)>, u64) {
    let mut off = 5;
    let v = sizes
        .iter()
        .map(|&l| {
            let d = (off, l);
            off += l + 64;
            d
        })
        .collect();
    (v, off)
}

fn round_trip(p: &Agent, d: &Agent, sizes: &[u64], seed: u64) -> R {
    let (segs, total) = layout(sizes);
    let src = p
        .register(total as usize, RemoteAccess::READ, vec![])
        .map_err(s)?;
    let dst = d
        .register(total as usize, RemoteAccess::NONE, vec![])
        .map_err(s)?;
    let back = d
        .register(total as usize, RemoteAccess::WRITE, vec![])
        .map_err(s)?;
    let peer_p = d.load_remote(p.side_channel_addr()).map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    // the data goes over queue pairs, not the TCP fallback
    let rails = d.peer_rails(&peer_p);
    ensure(rails == ["rxeA0:1", "rxeA1:1"], || {
        format!("decode reaches prefill over {rails:?}")
    })?;
    ensure(p.peer_rails(&peer_d).len() == 2, || {
        "prefill has no queue pairs to decode".into()
    })?;
    let mut want = vec![0u8; total as usize];
    for (k, &(o, l)) in segs.iter().enumerate() {
        let b = pattern(seed + k as u64, l as usize);
        p.write_region(src, o, &b).map_err(s)?;
        want[o as usize..(o + l) as usize].copy_from_slice(&b);
    }
    let descs = |r: RegionId| {
        segs.iter()
            .map(|&(o, l)| Desc::new(r, o, l))
            .collect::<Vec<_>>()
    };
    // D READs P's descriptors
    let x = d
        .create_xfer(XferOp::Read, descs(dst), &peer_p, descs(src), None)
        .map_err(s)?;
    d.post(x).map_err(s)?;
    ensure(wait(d, x)? == XferStatus::Done, || {
        format!("READ: {:?}", d.status(x))
    })?;
    let mut got = vec![0u8; total as usize];
    d.read_region(dst, 0, &mut got).map_err(s)?;
    ensure(got == want, || {
        format!(
            "READ: {} wrong bytes",
            got.iter().zip(&want).filter(|(a, b)| a != b).count()
        )
    })?;
    // P WRITEs them into D's other region
    let x = p
        .create_xfer(XferOp::Write, descs(src), &peer_d, descs(back), None)
        .map_err(s)?;
    p.post(x).map_err(s)?;
    ensure(wait(p, x)? == XferStatus::Done, || {
        format!("WRITE: {:?}", p.status(x))
    })?;
    d.read_region(back, 0, &mut got).map_err(s)?;
    ensure(got == want, || {
        format!(
            "WRITE: {} wrong bytes",
            got.iter().zip(&want).filter(|(a, b)| a != b).count()
        )
    })
}

fn transfers(t: &Topology, stripe: Option<i64>) -> R {
    let p = agent("prefill", &t.b_devs, stripe)?;
    let d = agent("decode", &t.a_devs, stripe)?;
    for sz in [1u64, 4097, 1 << 20, 8 << 20] {
        round_trip(&p, &d, &[sz], sz)?;
    }
    round_trip(
        &p,
        &d,
        &(0..100).map(|i| 1 + i * 311).collect::<Vec<_>>(),
        7,
    )?;
    round_trip(&p, &d, &[4096; 1000], 9)?;
    // one rail per transfer, spread by load: both rails carried transfers
    let rb = d.rail_bytes();
    println!("    bytes per rail (decode's READs): {rb:?}");
    ensure(rb.iter().all(|(_, b)| *b > 0), || {
        format!("a rail carried nothing: {rb:?}")
    })
}

fn striped_notif(t: &Topology) -> R {
    let p = agent("prefill", &t.b_devs, Some(0))?;
    let d = agent("decode", &t.a_devs, Some(0))?;
    const LEN: u64 = 8 << 20;
    let src = p
        .register(LEN as usize, RemoteAccess::NONE, vec![])
        .map_err(s)?;
    let dst = d
        .register(LEN as usize, RemoteAccess::WRITE, vec![])
        .map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    ensure(p.notif_rail(&peer_d).is_some(), || {
        "notifications do not go over verbs".into()
    })?;
    for round in 0..3u64 {
        let bytes = pattern(500 + round, LEN as usize);
        p.write_region(src, 0, &bytes).map_err(s)?;
        let descs: Vec<(u64, u64)> = (0..8).map(|k| (k << 20, 1 << 20)).collect();
        let x = p
            .create_xfer(
                XferOp::Write,
                descs.iter().map(|&(o, l)| Desc::new(src, o, l)).collect(),
                &peer_d,
                descs.iter().map(|&(o, l)| Desc::new(dst, o, l)).collect(),
                Some(format!("done-{round}").into_bytes()),
            )
            .map_err(s)?;
        p.post(x).map_err(s)?;
        let t0 = Instant::now();
        let n = loop {
            let n = d.get_new_notifs();
            if !n.is_empty() {
                break n;
            }
            ensure(t0.elapsed() < Duration::from_secs(120), || {
                "no notification".into()
            })?;
            std::thread::sleep(Duration::from_micros(200));
        };
        // the bytes must all be there the moment the notification is
        let mut got = vec![0u8; LEN as usize];
        d.read_region(dst, 0, &mut got).map_err(s)?;
        let bad = got.iter().zip(&bytes).filter(|(a, b)| a != b).count();
        ensure(bad == 0, || {
            format!("round {round}: notification before {bad} bytes landed")
        })?;
        ensure(
            n == vec![("prefill".to_string(), format!("done-{round}").into_bytes())],
            || format!("{n:?}"),
        )?;
        ensure(wait(&p, x)? == XferStatus::Done, || "not done".into())?;
        p.release(x).map_err(s)?;
    }
    // striped: every transfer went half over each rail
    let rb = p.rail_bytes();
    println!("    bytes per rail (3 striped 8 MiB WRITEs): {rb:?}");
    ensure(
        rb.iter().map(|(_, b)| *b).collect::<Vec<_>>() == [12 << 20, 12 << 20],
        || format!("{rb:?}"),
    )
}

fn read_many(t: &Topology) -> R {
    let p = agent("prefill", &t.b_devs, Some(0))?;
    let d = agent("decode", &t.a_devs, Some(0))?;
    round_trip(
        &p,
        &d,
        &(0..1000).map(|i| 1 + (i % 50) * 97).collect::<Vec<_>>(),
        77,
    )
}

/// The child process: host B's agent; prints its address, serves until told "bye".
fn child() {
    let t = Topology::from_env().expect("lab");
    let p = agent("child-b", &t.b_devs, None).expect("agent");
    let src = p
        .register(4 << 20, RemoteAccess::READ_WRITE, vec![])
        .expect("register");
    p.write_region(src, 0, &pattern(31337, 4 << 20))
        .expect("fill");
    println!("ADDR {}", p.side_channel_addr());
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(120) {
        if p.get_new_notifs().iter().any(|(_, b)| b == b"bye") {
            // the parent WROTE its pattern into [2 MiB, 4 MiB): check it here
            let mut got = vec![0u8; 2 << 20];
            p.read_region(src, 2 << 20, &mut got).expect("read");
            std::process::exit(if got == pattern(4242, 2 << 20) { 0 } else { 3 });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::process::exit(4);
}

fn two_processes(t: &Topology) -> R {
    let exe = std::env::current_exe().map_err(s)?;
    let mut c = Command::new(exe)
        .env("KVRAIL_AGENT_LAB_CHILD", "1")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(s)?;
    let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).map_err(s)?;
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("ADDR ")
        .ok_or(format!("child said {line:?}"))?
        .parse()
        .map_err(s)?;
    let d = agent("parent-a", &t.a_devs, Some(0))?;
    let peer = d.load_remote(addr).map_err(s)?;
    let buf = d.register(4 << 20, RemoteAccess::NONE, vec![]).map_err(s)?;
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(buf, 0, 2 << 20)],
            &peer,
            vec![Desc::new(RegionId(1), 0, 2 << 20)],
            None,
        )
        .map_err(s)?;
    d.post(x).map_err(s)?;
    ensure(wait(&d, x)? == XferStatus::Done, || "READ not done".into())?;
    let mut got = vec![0u8; 2 << 20];
    d.read_region(buf, 0, &mut got).map_err(s)?;
    ensure(got == pattern(31337, 4 << 20)[..2 << 20], || {
        "READ from the other process: wrong bytes".into()
    })?;
    d.write_region(buf, 2 << 20, &pattern(4242, 2 << 20))
        .map_err(s)?;
    let x = d
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(buf, 2 << 20, 2 << 20)],
            &peer,
            vec![Desc::new(RegionId(1), 2 << 20, 2 << 20)],
            Some(b"bye".to_vec()),
        )
        .map_err(s)?;
    d.post(x).map_err(s)?;
    ensure(wait(&d, x)? == XferStatus::Done, || "WRITE not done".into())?;
    let t0 = Instant::now();
    loop {
        if let Some(st) = c.try_wait().map_err(s)? {
            return ensure(st.success(), || {
                format!("the other process found wrong bytes or no notification ({st})")
            });
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = c.kill();
            return Err("the other process did not finish".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Take rail 1's link down while a striped 64 MiB WRITE is moving: the transfer must
/// complete on rail 0 with every byte in place (or fail — never done with holes), the
/// notification must come after it, and a later transfer must use the surviving rail.
/// Once the link is back, the rail's queue pair is rebuilt and striping uses both again.
fn rail_down(t: &Topology) -> R {
    const LEN: u64 = 256 << 20;
    let p = agent("target", &t.b_devs, Some(0))?;
    let d = agent("initiator", &t.a_devs, Some(0))?;
    let src = d
        .register(LEN as usize, RemoteAccess::NONE, vec![])
        .map_err(s)?;
    let dst = p
        .register(LEN as usize, RemoteAccess::WRITE, vec![])
        .map_err(s)?;
    let peer = d.load_remote(p.side_channel_addr()).map_err(s)?;
    // 256 blocks of 1 MiB, each the same pattern stamped with its index (cheap to make)
    let block = pattern(9001, 1 << 20);
    let mut bytes = Vec::with_capacity(LEN as usize);
    for k in 0..256u64 {
        let mut b = block.clone();
        b[..8].copy_from_slice(&k.to_le_bytes());
        bytes.extend_from_slice(&b);
    }
    d.write_region(src, 0, &bytes).map_err(s)?;
    let descs: Vec<(u64, u64)> = (0..256).map(|k| (k << 20, 1 << 20)).collect();
    let x = d
        .create_xfer(
            XferOp::Write,
            descs.iter().map(|&(o, l)| Desc::new(src, o, l)).collect(),
            &peer,
            descs.iter().map(|&(o, l)| Desc::new(dst, o, l)).collect(),
            Some(b"after-failover".to_vec()),
        )
        .map_err(s)?;
    let netdev = &t.a_netdevs[1];
    let mut link = LinkSwitch::new(netdev)?;
    let t0 = Instant::now();
    d.post(x).map_err(s)?;
    // take the link down while both rails have slices in flight (striped, 128 MiB each; the
    // whole transfer takes over a second here, and completions come in large batches)
    std::thread::sleep(Duration::from_millis(50));
    let moved: u64 = d.rail_bytes().iter().map(|(_, b)| b).sum();
    link.set("down")?;
    let t_down = t0.elapsed();
    let early = d.status(x).map_err(s)?;
    let st = wait(&d, x);
    println!("    link down after {:.2} s with {moved} bytes moved (status then {early:?}); finished after {:.2} s", t_down.as_secs_f64(), t0.elapsed().as_secs_f64());
    let res = after_failover(t, &d, &p, &peer, (src, dst), &bytes, st);
    link.set("up")?;
    res?;
    // the link is back: rail 1's queue pair is rebuilt and striped transfers use it again
    wait_port(&t.a_devs[1], "ACTIVE")?;
    let t0 = Instant::now();
    while d.peer_rails(&peer).len() < 2 {
        ensure(t0.elapsed() < Duration::from_secs(60), || {
            format!(
                "rail 1 not rebuilt 60 s after its link came back: {:?}",
                d.peer_rails(&peer)
            )
        })?;
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "    rail 1 rebuilt {:.2} s after its port was ACTIVE again",
        t0.elapsed().as_secs_f64()
    );
    let before = d.rail_bytes();
    let bytes3 = pattern(9003, 8 << 20);
    d.write_region(src, 0, &bytes3).map_err(s)?;
    let x3 = d
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, 8 << 20)],
            &peer,
            vec![Desc::new(dst, 0, 8 << 20)],
            None,
        )
        .map_err(s)?;
    d.post(x3).map_err(s)?;
    ensure(wait(&d, x3)? == XferStatus::Done, || {
        format!("transfer after the rebuild: {:?}", d.status(x3))
    })?;
    let after = d.rail_bytes();
    ensure(
        after[0].1 - before[0].1 == 4 << 20 && after[1].1 - before[1].1 == 4 << 20,
        || format!("not striped over both rails after the rebuild: {before:?} -> {after:?}"),
    )?;
    let mut got = vec![0u8; 8 << 20];
    p.read_region(dst, 0, &mut got).map_err(s)?;
    ensure(got == bytes3, || {
        "transfer after the rebuild: wrong bytes".into()
    })
}

/// The checks of `rail_down` made while rail 1's link is still down.
fn after_failover(
    t: &Topology,
    d: &Agent,
    p: &Agent,
    peer: &str,
    (src, dst): (RegionId, RegionId),
    bytes: &[u8],
    st: Result<XferStatus, String>,
) -> R {
    const LEN: u64 = 256 << 20;
    let st = st?;
    let rb = d.rail_bytes();
    println!(
        "    status {st:?}; bytes per rail {rb:?}; rails still up to the peer: {:?}",
        d.peer_rails(peer)
    );
    let mut got = vec![0u8; LEN as usize];
    p.read_region(dst, 0, &mut got).map_err(s)?;
    // memcmp first; count the damage only when there is some
    let bad = if got == *bytes {
        0
    } else {
        got.iter().zip(bytes).filter(|(a, b)| a != b).count()
    };
    match st {
        XferStatus::Done => ensure(bad == 0, || format!("done with {bad} wrong bytes"))?,
        XferStatus::Error(e) => {
            return Err(format!(
                "failed instead of completing on the surviving rail: {e}"
            ))
        }
        other => return Err(format!("{other:?}")),
    }
    ensure(d.peer_rails(peer) == [t.a_devs[0].clone() + ":1"], || {
        "rail 1 was never retired".into()
    })?;
    // rail 0 carried more than its striped half: rail 1's outstanding slices were redone there
    ensure(rb[0].1 > LEN / 2 && rb[0].1 + rb[1].1 == LEN, || {
        format!("no failover visible in {rb:?}")
    })?;
    let t0 = Instant::now();
    loop {
        let n = p.get_new_notifs();
        if !n.is_empty() {
            ensure(
                n == vec![("initiator".to_string(), b"after-failover".to_vec())],
                || format!("{n:?}"),
            )?;
            break;
        }
        ensure(t0.elapsed() < Duration::from_secs(30), || {
            "no notification".into()
        })?;
        std::thread::sleep(Duration::from_millis(5));
    }
    // a later transfer goes over the surviving rail only
    let before = d.rail_bytes();
    let bytes2 = pattern(9002, 4 << 20);
    d.write_region(src, 0, &bytes2).map_err(s)?;
    let x2 = d
        .create_xfer(
            XferOp::Write,
            vec![Desc::new(src, 0, 4 << 20)],
            peer,
            vec![Desc::new(dst, 0, 4 << 20)],
            None,
        )
        .map_err(s)?;
    d.post(x2).map_err(s)?;
    ensure(wait(d, x2)? == XferStatus::Done, || {
        "later transfer not done".into()
    })?;
    let after = d.rail_bytes();
    ensure(
        after[0].1 - before[0].1 == 4 << 20 && after[1].1 == before[1].1,
        || format!("{before:?} -> {after:?}"),
    )?;
    let mut got = vec![0u8; 4 << 20];
    p.read_region(dst, 0, &mut got).map_err(s)?;
    ensure(got == bytes2, || "later transfer: wrong bytes".into())
}

fn notif_msg(i: u64) -> Vec<u8> {
    let mut m = i.to_le_bytes().to_vec();
    m.extend(pattern(i, (i % 97) as usize));
    if i.is_multiple_of(5000) {
        m.extend(pattern(i + 1, 3000)); // a few longer than one slot: several frames
    }
    m
}

/// Receive notifications `first..n` from `from` at `d`, checking each in order.
fn expect_notifs(d: &Agent, from: &str, (first, n): (u64, u64), limit: Duration) -> R {
    let t0 = Instant::now();
    let mut got = first;
    while got < n {
        for (who, m) in d.get_new_notifs() {
            ensure(who == from, || format!("notification from {who}"))?;
            ensure(m == notif_msg(got), || {
                format!(
                    "notification {got} wrong, missing or out of order ({} bytes)",
                    m.len()
                )
            })?;
            got += 1;
        }
        ensure(t0.elapsed() < limit, || {
            format!("{got} of {n} notifications arrived")
        })?;
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(200));
    let extra = d.get_new_notifs();
    ensure(extra.is_empty(), || {
        format!("{} notifications too many", extra.len())
    })
}

/// Rail 0 (the channel's) goes down while notifications are in flight: the undelivered ones
/// go again over TCP; the receiver gets every one exactly once, in order.
fn notif_rail_down(t: &Topology) -> R {
    const N: u64 = 20_000;
    let p = agent("sender", &t.a_devs, None)?;
    let d = agent("receiver", &t.b_devs, None)?;
    let peer = p.load_remote(d.side_channel_addr()).map_err(s)?;
    let mut link = LinkSwitch::new(&t.a_netdevs[0])?;
    for i in 0..N / 2 {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    link.set("down")?;
    for i in N / 2..N {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    let res = expect_notifs(&d, "sender", (0, N), Duration::from_secs(120));
    let rail = p.notif_rail(&peer);
    link.set("up")?;
    wait_port(&t.a_devs[0], "ACTIVE")?;
    res?;
    ensure(rail.is_none(), || {
        format!("channel still on {rail:?} with its link down")
    })?;
    // the rail is back: the channel is rebuilt on it, and the numbering goes on there
    let up = Instant::now();
    wait_chan_rebuilt(&p, &peer)?;
    println!(
        "    channel rebuilt on {:?} {:.2} s after its port was ACTIVE again",
        p.notif_rail(&peer),
        up.elapsed().as_secs_f64()
    );
    for i in N..N + 2000 {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    expect_notifs(&d, "sender", (N, N + 2000), Duration::from_secs(120))?;
    ensure(p.notif_rail(&peer).as_deref() == Some("rxeA0:1"), || {
        format!("the rebuilt channel failed: {:?}", p.notif_rail(&peer))
    })
}

/// Until the notification channel to `peer` is up again (30 s at most).
fn wait_chan_rebuilt(p: &Agent, peer: &str) -> R {
    let t0 = Instant::now();
    while p.notif_rail(peer).is_none() {
        ensure(t0.elapsed() < Duration::from_secs(30), || {
            "the notification channel was not rebuilt within 30 s".into()
        })?;
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// utime + stime of this process, in clock ticks (/proc/self/stat fields 14 and 15).
fn cpu_ticks() -> Result<u64, String> {
    let st = std::fs::read_to_string("/proc/self/stat").map_err(s)?;
    let rest = st.rsplit_once(')').ok_or("odd /proc/self/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // after the command: state is field 3, so utime (14) and stime (15) are f[11], f[12]
    let n = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or("odd /proc/self/stat")
    };
    Ok(n(11)? + n(12)?)
}

/// Two connected agents (queue pairs, notification channels, progress threads, listeners)
/// with nothing to do sleep: the process uses (almost) no CPU over 3 seconds. A progress
/// thread that polled would burn all 300 ticks of one CPU.
/// Idle connected agents use no CPU — with adaptive progress on (a 20 ms polling budget for
/// waiting callers), which must stop polling once the completions stop and leave the queues
/// armed for the progress thread.
fn idle_cpu(t: &Topology) -> R {
    let p = polling_agent("idle-p", &t.b_devs, 20_000)?;
    let d = polling_agent("idle-d", &t.a_devs, 20_000)?;
    let peer_p = d.load_remote(p.side_channel_addr()).map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    // received by waiting callers, which poll (and leave the queues unarmed behind them)
    d.send_notif(&peer_p, b"hi".to_vec()).map_err(s)?;
    p.send_notif(&peer_d, b"hi".to_vec()).map_err(s)?;
    let got = (
        d.wait_notifs(Duration::from_secs(5)).len(),
        p.wait_notifs(Duration::from_secs(5)).len(),
    );
    ensure(got == (1, 1), || format!("notifications lost: {got:?}"))?;
    let c0 = cpu_ticks()?;
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_ticks()? - c0;
    println!("    CPU over 3 s idle: {used} ticks");
    ensure(used <= 15, || {
        format!("idle agents used {used} clock ticks of CPU in 3 s")
    })?;
    // nobody polls now: the progress threads must have armed the queues again, or these
    // would never be seen by a consumer that only looks
    d.send_notif(&peer_p, b"again".to_vec()).map_err(s)?;
    p.send_notif(&peer_d, b"again".to_vec()).map_err(s)?;
    let t0 = Instant::now();
    let (mut at_d, mut at_p) = (0, 0);
    while (at_d, at_p) != (1, 1) && t0.elapsed() < Duration::from_secs(5) {
        at_d += d.get_new_notifs().len();
        at_p += p.get_new_notifs().len();
        std::thread::sleep(Duration::from_millis(5));
    }
    ensure((at_d, at_p) == (1, 1), || {
        format!("after the pollers left, notifications seen without polling: D {at_d}, P {at_p}")
    })
}

/// `tc netem` on both ends of a rail's veth while it lives (removed on drop).
struct Netem(Vec<String>);

impl Netem {
    fn on(netdevs: &[String], spec: &str) -> Result<Self, String> {
        let _ = Command::new("modprobe").arg("sch_netem").status();
        let mut n = Self(Vec::new());
        for dev in netdevs {
            let mut args = vec!["qdisc", "add", "dev", dev.as_str(), "root", "netem"];
            args.extend(spec.split_whitespace());
            let o = Command::new("tc").args(&args).output().map_err(s)?;
            ensure(o.status.success(), || {
                format!("tc {args:?}: {}", String::from_utf8_lossy(&o.stderr))
            })?;
            n.0.push(dev.clone());
        }
        Ok(n)
    }
}

impl Drop for Netem {
    fn drop(&mut self) {
        for dev in &self.0 {
            let _ = Command::new("tc")
                .args(["qdisc", "del", "dev", dev, "root"])
                .status();
        }
    }
}

/// A WRITE with a notification (checked byte-exact the moment the notification is there),
/// then a READ back (checked too), of `len` bytes from `p` to `d`: the goodput (MB/s) of both.
fn goodput(p: &Agent, d: &Agent, len: usize, seed: u64) -> Result<f64, String> {
    let src = p.register(len, RemoteAccess::READ, vec![]).map_err(s)?;
    let dst = d.register(len, RemoteAccess::WRITE, vec![]).map_err(s)?;
    let back = d.register(len, RemoteAccess::NONE, vec![]).map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    let peer_p = d.load_remote(p.side_channel_addr()).map_err(s)?;
    let bytes = pattern(seed, len);
    p.write_region(src, 0, &bytes).map_err(s)?;
    // 16 descriptors, so a striped transfer crosses both rails
    let descs = |r: RegionId| -> Vec<Desc> {
        (0..16u64)
            .map(|k| Desc::new(r, k * (len as u64 / 16), len as u64 / 16))
            .collect()
    };
    let t0 = Instant::now();
    let x = p
        .create_xfer(
            XferOp::Write,
            descs(src),
            &peer_d,
            descs(dst),
            Some(b"landed".to_vec()),
        )
        .map_err(s)?;
    p.post(x).map_err(s)?;
    let n = loop {
        let n = d.get_new_notifs();
        if !n.is_empty() {
            break n;
        }
        ensure(t0.elapsed() < Duration::from_secs(240), || {
            format!("no notification after 240 s ({:?})", p.status(x))
        })?;
        std::thread::sleep(Duration::from_millis(1));
    };
    let mut got = vec![0u8; len];
    d.read_region(dst, 0, &mut got).map_err(s)?;
    let bad = got.iter().zip(&bytes).filter(|(a, b)| a != b).count();
    ensure(bad == 0, || {
        format!("notification before {bad} bytes landed")
    })?;
    ensure(n.len() == 1 && n[0].1 == b"landed", || format!("{n:?}"))?;
    ensure(wait(p, x)? == XferStatus::Done, || "WRITE not done".into())?;
    let x = d
        .create_xfer(XferOp::Read, descs(back), &peer_p, descs(src), None)
        .map_err(s)?;
    d.post(x).map_err(s)?;
    ensure(wait(d, x)? == XferStatus::Done, || {
        format!("READ: {:?}", d.status(x))
    })?;
    let secs = t0.elapsed().as_secs_f64();
    d.read_region(back, 0, &mut got).map_err(s)?;
    let bad = got.iter().zip(&bytes).filter(|(a, b)| a != b).count();
    ensure(bad == 0, || format!("READ: {bad} wrong bytes"))?;
    Ok(2.0 * len as f64 / secs / 1e6)
}

/// Rail 0 made lossy and slow with `tc netem` on both ends of its veth, transfers on it
/// alone and striped over both rails: they land byte-exact with the notification after the
/// data, goodput next to the clean rail's in the same run. Loss, duplication and a fixed
/// delay (1 %, 0.1 %, 5 ms) with 4 MiB; then jitter (5 ms ± 2 ms, which reorders nearly
/// every packet) with 25 % reordering on top, with 256 KiB: RC's go-back-N resends from the
/// first packet out of order, so goodput collapses — it must still land exactly.
fn lossy_rail(t: &Topology) -> R {
    let b_netdevs: Vec<String> = std::env::var("LAB_B_NETDEVS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let rail0 = vec![t.a_netdevs[0].clone(), b_netdevs[0].clone()];
    let single = (
        agent("p-one", &t.b_devs[..1], None)?,
        agent("d-one", &t.a_devs[..1], None)?,
    );
    let striped = (
        agent("p-two", &t.b_devs, Some(0))?,
        agent("d-two", &t.a_devs, Some(0))?,
    );
    let mut seed = 1;
    for (spec, len) in [
        ("delay 5ms loss 1% duplicate 0.1%", 4usize << 20),
        (
            "delay 5ms 2ms loss 1% duplicate 0.1% reorder 25% 50%",
            256 << 10,
        ),
    ] {
        let mut run = |what: &str| -> Result<(f64, f64), String> {
            seed += 2;
            let one = goodput(&single.0, &single.1, len, seed)?;
            println!("    {what}: rail 0 alone {one:.2} MB/s");
            let two = goodput(&striped.0, &striped.1, len, seed + 1)?;
            println!("    {what}: striped over both rails {two:.2} MB/s");
            Ok((one, two))
        };
        let clean = run("clean")?;
        let lossy = {
            let _netem = Netem::on(&rail0, spec)?;
            run(spec)?
        };
        println!(
            "    goodput ({} KiB WRITE + READ, MB/s), clean vs rail 0 under netem {spec:?}: \
             rail 0 alone {:.2} vs {:.2}; striped {:.2} vs {:.2}",
            len >> 10,
            clean.0,
            lossy.0,
            clean.1,
            lossy.1
        );
    }
    Ok(())
}
