//! `kvrail-verbs-bw`: RDMA WRITE / READ bandwidth between two RDMA devices on one host,
//! through kvrail's verbs layer alone (no agent), in perftest's output format — the lab's
//! smoke run: what the verbs layer reaches next to `ib_write_bw` / `ib_read_bw`
//! (`kvrail-perf` measures the agent API on top of it).
//!
//! Both queue pairs live in this process (device A posts, device B is the target); in the
//! lab they are the two ends of one rail, so every byte crosses the veth wire. After the
//! timed loop every byte of the target buffers is checked.

#[path = "../logging.rs"]
mod logging;
#[path = "../verbs_pair.rs"]
mod verbs_pair;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use kvrail::transport::verbs::{Access, Completion, Mr, SendWr, Sge};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Op {
    Write,
    Read,
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "RDMA WRITE/READ bandwidth between two local RDMA devices (perftest columns)",
    after_help = concat!(
        "The verbs layer alone (no agent): kvrail-perf measures what an engine gets.\n\n",
        "Examples:\n",
        "  kvrail-verbs-bw --dev-a rxeA0 --dev-b rxeB0 -s 1M -t 32     # WRITE\n",
        "  kvrail-verbs-bw --rail 1 --op read -s 64K                   # the lab's rail 1\n\n",
        "Exit status: 0 every byte checked; 1 a failed run; 2 usage."
    )
)]
struct Args {
    #[command(flatten)]
    log: logging::LogArgs,
    #[command(flatten)]
    pair: verbs_pair::PairArgs,
    /// Operation.
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 1 << 20)]
    size: usize,
    /// Iterations.
    #[arg(short = 'n', long, default_value_t = 200)]
    iters: usize,
    /// Requests in flight.
    #[arg(short = 't', long, default_value_t = 32)]
    depth: u32,
    /// Distinct buffers cycled through (each checked byte for byte at the end).
    #[arg(long, default_value_t = 4)]
    slots: usize,
}

fn run(a: &Args) -> Result<(), String> {
    let (dev_a, dev_b) = a.pair.devices()?;
    let shape = verbs_pair::Shape {
        send: a.depth,
        recv: 1,
        inline: 0,
    };
    let (init, target) = verbs_pair::connect(&dev_a, &dev_b, a.pair.port, &shape)?;
    let mtu = init.qp.path_mtu().map_err(|e| e.to_string())?;
    let len = a.size * a.slots;
    // Least access: the target of a WRITE needs REMOTE_WRITE, the source of a READ
    // REMOTE_READ; the local end of a READ must be locally writable.
    let (src_pd, dst_pd, src_access, dst_access) = match a.op {
        Op::Write => (&init.pd, &target.pd, Access::NONE, Access::REMOTE_WRITE),
        Op::Read => (
            &target.pd,
            &init.pd,
            Access::REMOTE_READ,
            Access::LOCAL_WRITE,
        ),
    };
    let src = Mr::alloc(src_pd, len, src_access).map_err(|e| e.to_string())?;
    let dst = Mr::alloc(dst_pd, len, dst_access).map_err(|e| e.to_string())?;
    for k in 0..a.slots {
        src.write(k * a.size, &verbs_pair::pattern(k as u64 + 1, a.size))
            .map_err(|e| e.to_string())?;
    }
    let (local, remote) = match a.op {
        Op::Write => (&src, dst.remote()),
        Op::Read => (&dst, src.remote()),
    };
    println!(
        "# kvrail-verbs-bw: {:?} {dev_a} -> {dev_b} port {}, path MTU {}, depth {}",
        a.op,
        a.pair.port,
        mtu.bytes(),
        a.depth
    );
    println!(
        "{:>10} {:>12} {:>18} {:>21} {:>16}",
        "#bytes", "#iterations", "BW peak[MiB/sec]", "BW average[MiB/sec]", "MsgRate[Mpps]"
    );
    let mut done = Vec::with_capacity(64);
    let (mut posted, mut completed) = (0usize, 0usize);
    let mut peak = 0f64;
    let t0 = Instant::now();
    let mut last = (t0, 0usize);
    while completed < a.iters {
        while posted < a.iters && posted - completed < a.depth as usize {
            let off = (posted % a.slots) * a.size;
            let sge = Sge::new(local, off, a.size);
            let wr = match a.op {
                Op::Write => SendWr::write(posted as u64, sge, remote, off as u64),
                Op::Read => SendWr::read(posted as u64, sge, remote, off as u64),
            };
            init.qp.post_send(&[wr]).map_err(|e| e.to_string())?;
            posted += 1;
        }
        done.clear();
        init.cq.poll(&mut done).map_err(|e| e.to_string())?;
        if let Some(Completion { status: Err(e), .. }) = done.iter().find(|c| c.status.is_err()) {
            return Err(e.to_string());
        }
        completed += done.len();
        let now = Instant::now();
        if now - last.0 >= Duration::from_millis(100) {
            peak = peak
                .max((completed - last.1) as f64 * a.size as f64 / (now - last.0).as_secs_f64());
            last = (now, completed);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes = a.iters as f64 * a.size as f64;
    let avg = bytes / secs;
    let mib = (1u64 << 20) as f64;
    println!(
        "{:>10} {:>12} {:>18.2} {:>21.2} {:>16.6}",
        a.size,
        a.iters,
        peak.max(avg) / mib,
        avg / mib,
        a.iters as f64 / secs / 1e6
    );
    let _ = &target.cq;
    // every slot that was used must hold exactly its pattern
    for k in 0..a.slots.min(a.iters) {
        let mut got = vec![0u8; a.size];
        dst.read(k * a.size, &mut got).map_err(|e| e.to_string())?;
        if got != verbs_pair::pattern(k as u64 + 1, a.size) {
            let at = got
                .iter()
                .zip(verbs_pair::pattern(k as u64 + 1, a.size))
                .position(|(x, y)| *x != y)
                .unwrap_or(0);
            return Err(format!("data check FAILED: slot {k} differs at byte {at}"));
        }
    }
    println!(
        "# data check: {} slot(s) x {} B verified byte for byte",
        a.slots.min(a.iters),
        a.size
    );
    Ok(())
}

fn main() -> ExitCode {
    let a = Args::parse();
    logging::init(&a.log);
    verbs_pair::exit("kvrail-verbs-bw", run(&a))
}
