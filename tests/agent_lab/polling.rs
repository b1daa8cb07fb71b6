//! Callers that poll (`AgentConfig::progress_spin_us`): threads on both agents keep READs
//! and WRITEs in flight and wait for them with `Agent::wait` (which then polls the
//! completion queues itself and posts in place) while a notification stream goes from P to
//! D, received with `wait_notifs`. Every byte is checked, the notifications arrive once each
//! and in order, and `kvrail_completions_total{by="caller"}` shows the callers dispatched
//! completions (the progress thread would otherwise have done all of it). A reader that
//! only calls `get_new_notifs` in a loop polls too.

use std::thread;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, Desc, RegionId, RemoteAccess, XferOp, XferStatus};

use super::{ensure, pattern, polling_agent, s, Topology, R};

const SLOT: u64 = 64 << 10;
const SLOTS: u64 = 16;
const THREADS: u64 = 3;
const ROUNDS: u64 = 6;
const NOTIFS: u64 = 3000;

fn msg(i: u64) -> Vec<u8> {
    let mut m = i.to_le_bytes().to_vec();
    m.extend(pattern(i, (i % 61) as usize));
    m
}

/// `ROUNDS` rounds of `SLOTS` transfers in flight from thread `k`'s slots: post all, then
/// wait for each (polling) and post it again until the rounds are done.
fn churn(a: &Agent, op: XferOp, peer: &str, (local, remote): (RegionId, RegionId), k: u64) -> R {
    let xs = (0..SLOTS)
        .map(|i| {
            let off = (k * SLOTS + i) * SLOT;
            a.create_xfer(
                op,
                vec![Desc::new(local, off, SLOT)],
                peer,
                vec![Desc::new(remote, off, SLOT)],
                None,
            )
            .map_err(s)
        })
        .collect::<Result<Vec<_>, _>>()?;
    for round in 0..ROUNDS {
        for x in &xs {
            a.post(*x).map_err(s)?;
        }
        for x in &xs {
            let st = a.wait(*x, Duration::from_secs(120)).map_err(s)?;
            ensure(st == XferStatus::Done, || {
                format!("{op:?} thread {k} round {round}: {st:?}")
            })?;
        }
    }
    xs.iter().try_for_each(|x| a.release(*x).map_err(s))
}

pub(super) fn callers_poll(t: &Topology) -> R {
    let p = polling_agent("poll-p", &t.b_devs, 50_000)?;
    let d = polling_agent("poll-d", &t.a_devs, 50_000)?;
    let len = (THREADS * SLOTS * SLOT) as usize;
    let src = p.register(len, RemoteAccess::READ, vec![]).map_err(s)?;
    let dst = d.register(len, RemoteAccess::NONE, vec![]).map_err(s)?;
    let back = d.register(len, RemoteAccess::WRITE, vec![]).map_err(s)?;
    let data = pattern(4242, len);
    p.write_region(src, 0, &data).map_err(s)?;
    let peer_p = d.load_remote(p.side_channel_addr()).map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    let t0 = Instant::now();
    thread::scope(|sc| -> R {
        let mut jobs = Vec::new();
        for k in 0..THREADS {
            let (d, p, peer_p, peer_d) = (&d, &p, &peer_p, &peer_d);
            jobs.push(sc.spawn(move || churn(d, XferOp::Read, peer_p, (dst, src), k)));
            jobs.push(sc.spawn(move || churn(p, XferOp::Write, peer_d, (src, back), k)));
        }
        let rx = sc.spawn(|| -> R {
            let mut next = 0;
            let until = Instant::now() + Duration::from_secs(180);
            while next < NOTIFS {
                ensure(Instant::now() < until, || {
                    format!("{next} of {NOTIFS} notifications arrived")
                })?;
                for (who, m) in d.wait_notifs(Duration::from_millis(200)) {
                    ensure(who == "poll-p", || format!("notification from {who}"))?;
                    ensure(m == msg(next), || {
                        format!("notification {next} wrong, missing or out of order")
                    })?;
                    next += 1;
                }
            }
            Ok(())
        });
        for i in 0..NOTIFS {
            p.send_notif(&peer_d, msg(i)).map_err(s)?;
        }
        rx.join()
            .map_err(|_| "the receiver panicked".to_string())??;
        for j in jobs {
            j.join()
                .map_err(|_| "a transfer thread panicked".to_string())??;
        }
        Ok(())
    })?;
    let secs = t0.elapsed().as_secs_f64();
    thread::sleep(Duration::from_millis(200));
    ensure(d.get_new_notifs().is_empty(), || {
        "notifications too many".into()
    })?;
    for (what, r) in [("READ", dst), ("WRITE", back)] {
        let mut got = vec![0u8; len];
        d.read_region(r, 0, &mut got).map_err(s)?;
        let bad = got.iter().zip(&data).filter(|(a, b)| a != b).count();
        ensure(bad == 0, || format!("{what}: {bad} wrong bytes"))?;
    }
    let by = |a: &Agent, who: &str| {
        a.metrics()
            .value(
                "kvrail_completions_total",
                &[("agent", a.name()), ("by", who)],
            )
            .unwrap_or(0.0)
    };
    let (dc, dp, pc, pp) = (
        by(&d, "caller"),
        by(&d, "progress"),
        by(&p, "caller"),
        by(&p, "progress"),
    );
    println!(
        "    {} transfers of 64 KiB each way and {NOTIFS} notifications in {secs:.1} s; \
         completions by callers / progress thread: D {dc} / {dp}, P {pc} / {pp}",
        THREADS * SLOTS * ROUNDS
    );
    ensure(dc > 0.0 && pc > 0.0, || {
        format!("no completion was dispatched by a polling caller: D {dc}, P {pc}")
    })
}

/// D reads a notification stream with `get_new_notifs` alone (a NIXL-style loop, no
/// waiting call): every notification once and in order, and D's own reads dispatched
/// completions (without the poll in `get_new_notifs` the progress thread does all of it).
pub(super) fn readers_poll(t: &Topology) -> R {
    const N: u64 = 2000;
    let p = polling_agent("read-p", &t.b_devs, 2000)?;
    let d = polling_agent("read-d", &t.a_devs, 2000)?;
    let _ = d.load_remote(p.side_channel_addr()).map_err(s)?;
    let peer_d = p.load_remote(d.side_channel_addr()).map_err(s)?;
    thread::scope(|sc| -> R {
        let rx = sc.spawn(|| -> R {
            let (mut next, until) = (0, Instant::now() + Duration::from_secs(120));
            while next < N {
                ensure(Instant::now() < until, || {
                    format!("{next} of {N} notifications arrived")
                })?;
                for (who, m) in d.get_new_notifs() {
                    ensure(who == "read-p", || format!("notification from {who}"))?;
                    ensure(m == msg(next), || {
                        format!("notification {next} wrong or out of order")
                    })?;
                    next += 1;
                }
                std::hint::spin_loop();
            }
            Ok(())
        });
        for i in 0..N {
            p.send_notif(&peer_d, msg(i)).map_err(s)?;
        }
        rx.join().map_err(|_| "the reader panicked".to_string())?
    })?;
    let by = |who: &str| {
        d.metrics()
            .value(
                "kvrail_completions_total",
                &[("agent", d.name()), ("by", who)],
            )
            .unwrap_or(0.0)
    };
    let (caller, progress) = (by("caller"), by("progress"));
    println!("    {N} notifications read with get_new_notifs; D's completions by the reader / progress thread: {caller} / {progress}");
    ensure(caller > 0.0, || {
        format!("the reader dispatched no completion (progress thread: {progress})")
    })
}
