//! An agent dropped while its notification channel makes no progress (rail 0's packets all
//! lost, its port still ACTIVE, so nothing fails the channel): after the drop's flush
//! bound passes without progress, what is still on the channel goes over TCP — the receiver
//! gets every notification exactly once and in order, none lost to the drop. And messages
//! still in the receiver's completion queue when the sender closes its connection arrive too.

use std::time::{Duration, Instant};

use super::{agent, expect_notifs, notif_msg, s, Netem, Topology, R};

pub(super) fn stalled_channel_drop(t: &Topology) -> R {
    const N: u64 = 2000;
    let b_netdevs: Vec<String> = std::env::var("LAB_B_NETDEVS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let p = agent("sender", &t.a_devs, None)?;
    let d = agent("receiver", &t.b_devs, None)?;
    let peer = p.load_remote(d.side_channel_addr()).map_err(s)?;
    super::ensure(p.notif_rail(&peer).as_deref() == Some("rxeA0:1"), || {
        format!("the channel is on {:?}, not rail 0", p.notif_rail(&peer))
    })?;
    for i in 0..N / 2 {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    expect_notifs(&d, "sender", (0, N / 2), Duration::from_secs(120))?;
    // every packet of rail 0 lost from now on; the port stays ACTIVE
    let netem = Netem::on(&[t.a_netdevs[0].clone(), b_netdevs[0].clone()], "loss 100%")?;
    for i in N / 2..N {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    let t0 = Instant::now();
    drop(p);
    println!(
        "    the sender's drop took {:.2} s with its channel stalled",
        t0.elapsed().as_secs_f64()
    );
    let res = expect_notifs(&d, "sender", (N / 2, N), Duration::from_secs(60));
    drop(netem);
    res
}

/// The last messages are still in the receiver's completion queue when the dropped sender
/// closes its connection (a sender counts a message delivered once the receiver's queue
/// pair has it): they are handed out all the same, none lost with the channel. The
/// receiver's callers poll (a 1 s budget) and one just got its answer, so for that budget
/// its progress thread leaves the queue to them: nobody looks at it until after the close.
pub(super) fn queued_at_the_receiver(t: &Topology) -> R {
    const N: u64 = 20;
    let p = agent("sender", &t.a_devs, None)?;
    let d = super::polling_agent("receiver", &t.b_devs, 1_000_000)?;
    let peer = p.load_remote(d.side_channel_addr()).map_err(s)?;
    p.send_notif(&peer, notif_msg(0)).map_err(s)?;
    let first = d.wait_notifs(Duration::from_secs(30));
    super::ensure(first == [("sender".to_owned(), notif_msg(0))], || {
        format!("the first notification: {} messages", first.len())
    })?;
    for i in 1..N {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    let t0 = Instant::now();
    drop(p);
    let dropped = t0.elapsed();
    // the receiver sees the connection end (and its channel go) before anyone polls
    std::thread::sleep(Duration::from_millis(200));
    println!(
        "    the sender's drop took {:.3} s; the receiver looks {:.3} s after its last poll",
        dropped.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    expect_notifs(&d, "sender", (1, N), Duration::from_secs(30))
}
