//! `kvrail-perf`: bandwidth and latency of kvrail's agent API — what an engine gets — with
//! perftest's flags and columns, so a fabric can be judged the same way with kvrail as with
//! `ib_write_bw` / `ib_read_bw`.
//!
//! ```text
//! kvrail-perf -d mlx5_0 -x 3 -s 1M                               # on host B (server)
//! kvrail-perf -d mlx5_0 -x 3 -s 1M -t 32 hostB                   # on host A: WRITE
//! kvrail-perf --loopback -a                                     # both agents here
//! ```
//!
//! perftest's flags mean what they mean there (`-d -i -x -m -p -s -n -D -a -t`,
//! `--run_infinitely`, `--perform_warm_up`, `--report_gbits`, `--out_json[_file]`); kvrail's
//! own are long (`--op`, `--descs`, `--stripe-width`, `--transport`, `--no-verify`).
//! SIGINT or SIGTERM stops a client's run: it prints what it measured and exits 130.
//!
//! Every run checks its data after the timed loop (`--no-verify` skips it): WRITE — the
//! server compares its memory with the client's pattern; READ — the client compares what
//! landed with the server's pattern. A wrong byte fails the run.

#[path = "../../cli.rs"]
mod cli;
#[macro_use]
#[path = "../../out.rs"]
mod out;
mod args;
mod bench;
#[path = "../../logging.rs"]
mod logging;
mod mem;
mod peer;
mod report;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kvrail::agent::{Agent, AgentConfig, BackendChoice, RegionId, RemoteAccess, XferOp};

use args::{Args, Op, Transport};
use bench::{Bw, BwSpec, Stop};
use peer::{expect, pattern, CTL};

/// The most memory a side registers for its slots.
const SLOT_BYTES: u64 = 64 << 20;
/// Seed of the server's pattern (what READ brings back).
const READ_SEED: u64 = 7;
const ANSWER: Duration = Duration::from_secs(120);

/// Set by SIGINT or SIGTERM: the client stops its run and prints what it measured.
pub(crate) static HALT: std::sync::LazyLock<Arc<AtomicBool>> =
    std::sync::LazyLock::new(|| Arc::new(AtomicBool::new(false)));

/// Exit status of an interrupted run (128 + SIGINT, as a shell reports it).
const INTERRUPTED: u8 = 130;

fn main() -> ExitCode {
    if let Some(code) = cli::generate_if_asked(<Args as clap::CommandFactory>::command()) {
        return code;
    }
    let args = Args::parse();
    logging::init(&(&args.log).into());
    if let Err(e) = args.validate() {
        eprintln!("kvrail-perf: {e}");
        return ExitCode::from(2);
    }
    if !args.is_server() {
        // the first signal stops the run (its numbers are printed); a second one ends the
        // process at once
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let h = HALT.clone();
            let ok = signal_hook::flag::register_conditional_shutdown(
                sig,
                INTERRUPTED.into(),
                h.clone(),
            )
            .and_then(|_| signal_hook::flag::register(sig, h));
            if let Err(e) = ok {
                eprintln!("kvrail-perf: cannot handle signal {sig}: {e}");
            }
        }
    }
    let res = run(&args);
    let halted = HALT.load(Ordering::Relaxed);
    match res {
        Ok(()) if halted => {
            outln!("# interrupted: the numbers above are what was measured until then");
            ExitCode::from(INTERRUPTED)
        }
        Ok(()) => ExitCode::SUCCESS,
        Err(Failed::Usage(e)) => {
            eprintln!("kvrail-perf: {e}");
            ExitCode::from(2)
        }
        Err(Failed::Run(e)) => {
            eprintln!("kvrail-perf: {e}");
            ExitCode::from(if halted { INTERRUPTED } else { 1 })
        }
    }
}

/// Why a run did not happen or did not finish.
enum Failed {
    /// The options cannot work here (exit 2, before anything ran): an address that does not
    /// parse, devices that are not usable rails, a transport this host has not got.
    Usage(String),
    /// The run failed (exit 1).
    Run(String),
}

impl From<String> for Failed {
    fn from(e: String) -> Self {
        Self::Run(e)
    }
}

/// An agent for this run: one of the options' mistakes is a usage error (devices named
/// that are not usable rails, a transport this host has not got).
fn agent(args: &Args, name: &str, devices: &[String], listen: &str) -> Result<Agent, Failed> {
    let c = config(args, devices, listen).map_err(Failed::Usage)?;
    Agent::new(name, c).map_err(|e| {
        let named = !devices.is_empty() || args.transport != Transport::Auto;
        if named && e.fault() == kvrail::agent::Fault::Unavailable {
            Failed::Usage(e.to_string())
        } else {
            Failed::Run(e.to_string())
        }
    })
}

fn config(args: &Args, devices: &[String], listen: &str) -> Result<AgentConfig, String> {
    let mut c = AgentConfig {
        listen: listen
            .parse()
            .map_err(|_| format!("--listen: {listen:?} is not ADDR:PORT"))?,
        backend: match args.transport {
            Transport::Auto => BackendChoice::Auto,
            Transport::Verbs => BackendChoice::Verbs,
            Transport::Tcp => BackendChoice::Tcp,
        },
        devices: args.device_list(devices),
        stripe_width: args.stripe_width,
        gid_index: args.gid_index,
        mtu: args.mtu,
        qps_per_rail: args.qps,
        tcp_conns: args.tcp_conns,
        progress_spin_us: if args.use_event { 0 } else { args.spin_us },
        insecure: args.insecure,
        ..AgentConfig::default()
    };
    if let Some(k) = &args.cluster_secret {
        c.cluster_secret = Some(
            kvrail::agent::ClusterSecret::new(k.as_bytes())
                .map_err(|e| format!("--cluster-secret: {e}"))?,
        );
    }
    if let Some(m) = &args.metrics_listen {
        c.metrics_listen = Some(
            m.parse()
                .map_err(|_| format!("--metrics-listen: {m:?} is not ADDR:PORT"))?,
        );
    }
    if let Some(h) = &args.side_channel_host {
        c.side_channel_host = h
            .parse()
            .map_err(|_| format!("--side-channel-host: {h:?} is not an IP address"))?;
    }
    Ok(c)
}

fn run(args: &Args) -> Result<(), Failed> {
    if args.is_server() {
        let listen = args
            .listen
            .clone()
            .unwrap_or_else(|| format!("0.0.0.0:{}", args.port));
        let a = agent(args, "kvrail-perf-server", &args.devices, &listen)?;
        outln!(
            "kvrail-perf server: side channel on {}",
            a.side_channel_addr()
        );
        let _ = std::io::stdout().flush();
        return Ok(peer::serve(&a, Duration::from_secs(600))?);
    }
    if args.loopback {
        // both agents first: a bad option fails before the server waits for a client
        let server = agent(
            args,
            "kvrail-perf-server",
            &args.peer_devices,
            "127.0.0.1:0",
        )?;
        let listen = args.listen.as_deref().unwrap_or("127.0.0.1:0");
        let a = agent(args, "kvrail-perf-client", &args.devices, listen)?;
        let addr = server.side_channel_addr();
        let t = std::thread::spawn(move || peer::serve(&server, Duration::from_secs(600)));
        let res = client(args, &a, addr);
        drop(a);
        let served = t
            .join()
            .map_err(|_| "the server thread panicked".to_string())?;
        return Ok(res.and(served)?);
    }
    let to = args.server_addr().unwrap_or_default();
    let what = if args.host.is_some() {
        "HOST"
    } else {
        "--client"
    };
    let addr: SocketAddr = to
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&to)
                .ok()
                .and_then(|mut a| a.next())
                .ok_or(())
        })
        // (a name that does not resolve may be the network's fault: a failed run, 1)
        .map_err(|()| Failed::Run(format!("{what}: cannot resolve {to:?} (HOST:PORT)")))?;
    let listen = args.listen.as_deref().unwrap_or("0.0.0.0:0");
    let a = agent(args, "kvrail-perf-client", &args.devices, listen)?;
    Ok(client(args, &a, addr)?)
}

fn client(args: &Args, a: &Agent, server: SocketAddr) -> Result<(), String> {
    let res = drive(args, a, server);
    // tell the server we are done whatever happened, so it exits too; its answer means it
    // read that (dropping the agent closes the connection, and what is still queued on it).
    // A server never reached is not tried again (a silent one took its timeout once).
    if let Some(peer) = a.peers().into_iter().next() {
        if a.send_notif(&peer, format!("{CTL}bye").into_bytes())
            .is_ok()
        {
            let _ = expect(a, &peer, "done", Duration::from_secs(10));
        }
    }
    res
}

fn drive(args: &Args, a: &Agent, server: SocketAddr) -> Result<(), String> {
    let e = |e: kvrail::agent::AgentError| e.to_string();
    let peer = a.load_remote(server).map_err(e)?;
    let sizes = args.sizes();
    let max = sizes.iter().copied().max().unwrap_or(1);
    let slots = (args.depth as u64)
        .min((SLOT_BYTES / max).max(1))
        .min(args.slots.unwrap_or(u64::MAX));
    let len = slots * max;
    // -b: each side's region has a second half, for the direction the server drives (which
    // needs access to ours)
    let (reg_len, access) = if args.bidirectional {
        (2 * len, RemoteAccess::READ_WRITE)
    } else {
        (len, RemoteAccess::NONE)
    };
    let local = mem::register(a, args.mem, reg_len, access, 0)?;
    let me = a.metadata().side_channel; // what this agent advertises
    let kind = match args.mem {
        args::Mem::Host => "host",
        args::Mem::Npu => "npu",
    };
    a.send_notif(
        &peer,
        format!("{CTL}hello {me} {reg_len} {READ_SEED} {kind}").into_bytes(),
    )
    .map_err(e)?;
    let id: u32 = expect(a, &peer, "ready", ANSWER)?
        .parse()
        .map_err(|_| "bad ready answer".to_string())?;
    a.load_remote(server).map_err(e)?; // the region registered for us
    let remote = RegionId(id);
    let human = !args.json;
    if human {
        out!("{}", report::header(args, a, &peer));
        if args.mem == args::Mem::Npu {
            outln!(
                "# memory: NPU (runtime {}), {}",
                mem::runtime_path().unwrap_or_default(),
                if a.bounce_stats().is_some() {
                    "staged by the agent's host bounce"
                } else {
                    "copied by the runtime into the TCP stream"
                }
            );
        }
        outln!(
            "{}",
            if args.op == Op::Lat {
                report::lat_titles().to_owned()
            } else {
                report::bw_titles(args.report_gbits)
            }
        );
    }
    let stop = match args.duration {
        Some(d) => Stop::For(Duration::from_secs_f64(d)),
        None => Stop::Iters(args.iters),
    };
    let stop = if args.run_infinitely {
        Stop::For(Duration::from_secs_f64(args.duration.unwrap_or(5.0)))
    } else {
        stop
    };
    let bar = args.all && human && std::io::stdout().is_terminal();
    let (mut bws, mut lats) = (Vec::new(), Vec::new());
    let halted = || HALT.load(Ordering::Relaxed);
    let regions = (local, remote);
    let res: Result<(), String> = (|| {
        for (i, &size) in sizes.iter().enumerate() {
            if halted() {
                break;
            }
            if bar {
                report::progress(i, sizes.len(), size);
            }
            loop {
                if args.op == Op::Lat {
                    if args.warm_up {
                        bench::latency(a, &peer, size, Stop::Iters(100))?;
                    }
                    let l = bench::latency(a, &peer, size, stop)?;
                    if human {
                        outln!("{}", report::lat_line(&l));
                    }
                    lats.push(l);
                } else {
                    if args.warm_up {
                        let w = Stop::Iters((2 * args.depth as u64).max(16));
                        bw_run(args, a, &peer, regions, (len, size), (w, false))?;
                    }
                    let verify = !args.no_verify;
                    let (bw, wrong) = bw_run(args, a, &peer, regions, (len, size), (stop, verify))?;
                    if human {
                        outln!("{}", report::bw_line(&bw, args.report_gbits));
                        if !args.all && !args.run_infinitely {
                            if let Some(c) = bw.ctx_switches_per_xfer {
                                outln!("# context switches per transfer (this process): {c:.1}");
                            }
                        }
                    }
                    bws.push((bw, wrong));
                    if let Some(w) = wrong.filter(|w| *w > 0) {
                        return Err(format!("data check failed at {size} B: {w} wrong bytes"));
                    }
                }
                let _ = std::io::stdout().flush();
                if !args.run_infinitely || halted() {
                    break;
                }
            }
        }
        Ok(())
    })();
    if bar {
        report::progress(sizes.len(), sizes.len(), max);
    }
    // what was measured is reported even when the run ended early (a signal, a failure)
    if args.wants_out_json() {
        let doc = report::perftest_json(args, a, &peer, &bws, &lats);
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(&args.out_json_file, text + "\n")
            .map_err(|e| format!("--out_json_file {}: {e}", args.out_json_file))?;
        if human {
            outln!(
                "# results written to {} (perftest's keys)",
                args.out_json_file
            );
        }
    }
    if args.json {
        outln!("{}", report::json(args, a, &peer, &bws, &lats));
    } else if res.is_ok() && !halted() && !args.no_verify && args.op != Op::Lat {
        outln!("# data check: every byte of every size verified");
    }
    res
}

/// One size: prepare the buffers, run, check. Returns the numbers and the wrong-byte count
/// (None with `--no-verify`).
fn bw_run(
    args: &Args,
    a: &Agent,
    peer: &str,
    (local, remote): (RegionId, RegionId),
    (len, size): (u64, u64),
    (stop, verify): (Stop, bool),
) -> Result<(Bw, Option<u64>), String> {
    let e = |e: kvrail::agent::AgentError| e.to_string();
    let slots = (args.depth as u64)
        .min(len / size)
        .min(args.slots.unwrap_or(u64::MAX))
        .max(1);
    let op = if args.op == Op::Write {
        XferOp::Write
    } else {
        XferOp::Read
    };
    let write_seed = 1000 + size;
    let posted = match stop {
        Stop::Iters(n) => n.min(args.depth as u64),
        Stop::For(_) => args.depth as u64,
    };
    let used = slots.min(posted) * size;
    if verify {
        let fill = if op == XferOp::Write {
            pattern(write_seed, used)
        } else {
            vec![0u8; used as usize]
        };
        a.write_region(local, 0, &fill).map_err(e)?;
    }
    if args.bidirectional {
        // the server starts the same loop toward us, in the upper halves
        let (n, secs) = match stop {
            Stop::Iters(n) => (n, 0.0),
            Stop::For(d) => (0, d.as_secs_f64()),
        };
        let opw = if op == XferOp::Write { "write" } else { "read" };
        let msg = format!(
            "{CTL}reverse {opw} {size} {} {} {slots} {n} {secs} {} {len}",
            args.depth, args.descs, local.0
        );
        a.send_notif(peer, msg.into_bytes()).map_err(e)?;
        expect(a, peer, "reversing", ANSWER)?;
    }
    let mut bw = bench::bandwidth(&BwSpec {
        agent: a,
        peer,
        op,
        local,
        remote,
        size,
        descs: args.descs,
        depth: args.depth,
        slots,
        stop,
        base: (0, 0),
    })?;
    if args.bidirectional {
        // perftest's -b line: both directions together
        let r = expect(a, peer, "reversed", ANSWER)?;
        let v: Vec<f64> = r
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        let [iters, secs, peak, avg] = v[..] else {
            return Err(format!("bad reversed answer {r:?}"));
        };
        bw.iterations += iters as u64;
        bw.peak_bps += peak;
        bw.avg_bps += avg;
        bw.msg_rate_mpps += iters / secs.max(1e-9) / 1e6;
        bw.seconds = bw.seconds.max(secs);
        if verify && op == XferOp::Write {
            // the server's WRITEs brought its pattern into our upper half
            let used = slots.min(posted) * size;
            let mut got = vec![0u8; used as usize];
            a.read_region(local, len, &mut got).map_err(e)?;
            let wrong = (got.iter().enumerate())
                .filter(|(i, b)| **b != peer::pattern_byte(READ_SEED, len + *i as u64))
                .count();
            if wrong > 0 {
                return Err(format!("-b: {wrong} wrong bytes in the server's WRITEs"));
            }
        }
    }
    if !verify {
        return Ok((bw, None));
    }
    let wrong = if op == XferOp::Write {
        a.send_notif(peer, format!("{CTL}check {used} {write_seed}").into_bytes())
            .map_err(e)?;
        expect(a, peer, "checked", ANSWER)?
            .parse()
            .map_err(|_| "bad check answer".to_string())?
    } else {
        let mut got = vec![0u8; used as usize];
        a.read_region(local, 0, &mut got).map_err(e)?;
        got.iter()
            .enumerate()
            .filter(|(i, b)| **b != peer::pattern_byte(READ_SEED, *i as u64))
            .count() as u64
    };
    Ok((bw, Some(wrong)))
}
