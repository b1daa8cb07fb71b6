//! A frame the receiver cannot read (a broken or foreign sender's) on a live notification
//! channel: the receiver closes the channel at once, so the sender's next frame fails there
//! and it goes on over TCP — every notification sent after the bad frame arrives exactly
//! once and in order (before the receiver closed its queue pair, they were acknowledged by
//! it, counted delivered by the sender and dropped unread) — and the channel is rebuilt.

use std::time::{Duration, Instant};

use super::{agent, ensure, expect_notifs, notif_msg, s, Topology, R};

pub(super) fn bad_frame_closes_the_channel(t: &Topology) -> R {
    const N: u64 = 1000;
    let p = agent("sender", &t.a_devs, None)?;
    let d = agent("receiver", &t.b_devs, None)?;
    let peer = p.load_remote(d.side_channel_addr()).map_err(s)?;
    for i in 0..N {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    expect_notifs(&d, "sender", (0, N), Duration::from_secs(60))?;
    // an 8-byte frame header of the layout before (magic 'k'): refused as malformed
    p.inject_notif_frame(&peer, b"k\x03\0\0\0\0\0\0garbage")
        .map_err(s)?;
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    for i in N..3 * N {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    expect_notifs(&d, "sender", (N, 3 * N), Duration::from_secs(60))?;
    println!(
        "    {} notifications after the bad frame arrived in {:.2} s (channel now {:?})",
        2 * N,
        t0.elapsed().as_secs_f64(),
        p.notif_rail(&peer)
    );
    // the rail is up: the channel comes back, and the numbering goes on there
    super::wait_chan_rebuilt(&p, &peer)?;
    for i in 3 * N..4 * N {
        p.send_notif(&peer, notif_msg(i)).map_err(s)?;
    }
    expect_notifs(&d, "sender", (3 * N, 4 * N), Duration::from_secs(60))?;
    ensure(p.notif_rail(&peer).as_deref() == Some("rxeA0:1"), || {
        format!("the rebuilt channel failed: {:?}", p.notif_rail(&peer))
    })
}
