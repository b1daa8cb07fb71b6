//! An agent dropped while its notification channel makes no progress (rail 0's packets all
//! lost, its port still ACTIVE, so nothing fails the channel): after the drop's flush
//! bound passes without progress, what is still on the channel goes over TCP — the receiver
//! gets every notification exactly once and in order, none lost to the drop.

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
