//! `kvrail-verbs-lat`: SEND ping-pong latency between the two ends of one lab rail through
//! kvrail's verbs layer alone (no agent), in `ib_send_lat`'s columns — the floors under
//! `kvrail-perf --op lat`, which measures the agent's notification round trip:
//!
//! - `--mode send`: plain SENDs into one reposted receive, signaled every 16th (as perftest
//!   signals only some): the verbs layer's own cost next to `ib_send_lat`.
//! - `--mode channel` (default): the agent's notification framing (`MsgChannel`: credits,
//!   slots, every SEND signaled, messages copied in and out): what the agent's
//!   notifications cost before the agent's own work.
//!
//! One thread per end in this process; every message that comes back is checked byte for
//! byte against the one sent.

#[path = "../logging.rs"]
mod logging;
#[path = "../verbs_pair.rs"]
mod verbs_pair;

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use kvrail::transport::notif::rdma::MsgChannel;
use kvrail::transport::verbs::{Access, Mr, RecvWr, SendWr, Sge};
use verbs_pair::{pattern, Side};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Plain SENDs (perftest's way).
    Send,
    /// The notification channel's framing.
    Channel,
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "SEND ping-pong latency between two local RDMA devices (ib_send_lat columns)",
    after_help = concat!(
        "The verbs layer alone (no agent): kvrail-perf --op lat measures the agent.\n\n",
        "Examples:\n",
        "  kvrail-verbs-lat --dev-a rxeA0 --dev-b rxeB0 -s 64 -n 5000\n",
        "  kvrail-verbs-lat --mode send --inline 256       # the lab's rail 0\n\n",
        "Exit status: 0 every message checked; 1 a failed run; 2 usage."
    )
)]
struct Args {
    #[command(flatten)]
    log: logging::LogArgs,
    #[command(flatten)]
    pair: verbs_pair::PairArgs,
    /// What goes back and forth.
    #[arg(long, value_enum, default_value_t = Mode::Channel)]
    mode: Mode,
    /// Message size in bytes (send mode: at most 4096).
    #[arg(short = 's', long, default_value_t = 64)]
    size: usize,
    /// Round trips.
    #[arg(short = 'n', long, default_value_t = 1000)]
    iters: usize,
    /// Inline data the queue pairs ask for (0: none); messages that fit go inline.
    #[arg(long, default_value_t = 0)]
    inline: u32,
}

/// Slots of the channel mode (as the agent's notification channel).
const SLOTS: u32 = 64;
const SLOT_SIZE: usize = 1024;
/// The send mode's receive buffer.
const BUF: usize = 4096;

/// One end of the channel ping-pong; `first` sends first. Round-trip times in µs.
fn channel_end(side: &Side, mut ch: MsgChannel, a: &Args, first: bool) -> Result<Vec<f64>, String> {
    let mut done = Vec::with_capacity(16);
    let mut rtts = Vec::with_capacity(a.iters);
    for i in 0..a.iters {
        let msg = pattern(i as u64, a.size);
        let t = Instant::now();
        if first {
            ch.send(msg.clone()).map_err(|e| e.to_string())?;
        }
        let got = loop {
            if let Some(m) = ch.recv() {
                break m;
            }
            done.clear();
            side.cq.poll(&mut done).map_err(|e| e.to_string())?;
            for c in &done {
                ch.handle(c).map_err(|e| e.to_string())?;
            }
        };
        if got != msg {
            return Err(format!("message {i} came back wrong"));
        }
        if !first {
            ch.send(got).map_err(|e| e.to_string())?;
        }
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(rtts)
}

/// One end of the plain SEND ping-pong: two receives posted (the next one is always there
/// when a message lands), each reposted when taken; sends from the second half of the
/// buffer, signaled every 16th so the send queue drains.
fn send_end(side: &Side, a: &Args, first: bool) -> Result<Vec<f64>, String> {
    let e = |e: kvrail::transport::verbs::Error| e.to_string();
    let mr = Mr::alloc(&side.pd, 2 * BUF, Access::LOCAL_WRITE).map_err(e)?;
    let post_recv = || {
        (side.qp)
            .post_recv(&[RecvWr {
                wr_id: 1,
                local: [Sge::new(&mr, 0, BUF)].into_iter().collect(),
            }])
            .map_err(e)
    };
    post_recv()?;
    post_recv()?;
    let inline = side.qp.max_inline() as usize >= a.size;
    let send = |i: usize| {
        let mut wr = SendWr::send(2, Sge::new(&mr, BUF, a.size));
        if i % 16 != 15 {
            wr = wr.unsignaled();
        }
        if inline {
            wr = wr.inlined();
        }
        side.qp.post_send(&[wr]).map_err(e)
    };
    let mut done = Vec::with_capacity(16);
    let mut rtts = Vec::with_capacity(a.iters);
    let mut got = vec![0u8; a.size];
    for i in 0..a.iters {
        let msg = pattern(i as u64, a.size);
        let t = Instant::now();
        if first {
            mr.write(BUF, &msg).map_err(e)?;
            send(i)?;
        }
        let len = 'wait: loop {
            done.clear();
            side.cq.poll(&mut done).map_err(e)?;
            for c in &done {
                if let Err(err) = &c.status {
                    return Err(err.to_string());
                }
                if c.wr_id == 1 {
                    break 'wait c.byte_len as usize;
                }
            }
        };
        // the receive buffer is read before its receive goes back on the queue
        mr.read(0, &mut got).map_err(e)?;
        post_recv()?;
        if len != a.size || got != msg {
            return Err(format!("message {i} came back wrong ({len} bytes)"));
        }
        if !first {
            mr.write(BUF, &got).map_err(e)?;
            send(i)?;
        }
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(rtts)
}

fn run(a: &Args) -> Result<(), String> {
    if a.mode == Mode::Send && a.size > BUF {
        return Err(format!("--mode send takes at most {BUF} bytes"));
    }
    if a.iters == 0 {
        return Err("-n must be at least 1".into());
    }
    let (dev_a, dev_b) = a.pair.devices()?;
    let shape = verbs_pair::Shape {
        send: SLOTS + 1,
        recv: SLOTS + 1,
        inline: a.inline,
    };
    let (init, echo) = verbs_pair::connect(&dev_a, &dev_b, a.pair.port, &shape)?;
    println!(
        "# kvrail-verbs-lat: {:?} {dev_a} <-> {dev_b} port {}, inline {} B",
        a.mode,
        a.pair.port,
        init.qp.max_inline()
    );
    let rtts = std::thread::scope(|s| -> Result<Vec<f64>, String> {
        let (theirs, mine) = match a.mode {
            Mode::Send => {
                let b = s.spawn(|| send_end(&echo, a, false));
                (b, send_end(&init, a, true))
            }
            Mode::Channel => {
                let e = |e: kvrail::transport::notif::rdma::ChannelError| e.to_string();
                let ca = MsgChannel::new(&init.pd, init.qp.clone(), SLOTS, SLOT_SIZE).map_err(e)?;
                let cb = MsgChannel::new(&echo.pd, echo.qp.clone(), SLOTS, SLOT_SIZE).map_err(e)?;
                let b = s.spawn(|| channel_end(&echo, cb, a, false));
                (b, channel_end(&init, ca, a, true))
            }
        };
        let theirs = theirs.join().map_err(|_| "the echoing end panicked")?;
        theirs.and(mine)
    })?;
    let mut half: Vec<f64> = rtts.iter().map(|r| r / 2.0).collect();
    half.sort_by(f64::total_cmp);
    let q = |f: f64| half[((half.len() - 1) as f64 * f).round() as usize];
    println!(
        "{:>7} {:>12} {:>12} {:>12} {:>16} {:>12} {:>14}",
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "99%[usec]",
        "99.9%[usec]"
    );
    println!(
        "{:>7} {:>12} {:>12.2} {:>12.2} {:>16.2} {:>12.2} {:>14.2}",
        a.size,
        a.iters,
        q(0.0),
        q(1.0),
        q(0.5),
        q(0.99),
        q(0.999)
    );
    println!(
        "# data check: every message of {} B that came back verified byte for byte",
        a.size
    );
    Ok(())
}

fn main() -> ExitCode {
    let a = Args::parse();
    logging::init(&a.log);
    verbs_pair::exit("kvrail-verbs-lat", run(&a))
}
