//! Output: perftest's header and columns, or one JSON document.

use std::net::Ipv6Addr;

use kvrail::agent::Agent;

use crate::args::{Args, Op};
use crate::bench::{Bw, Lat};

const RULE: &str =
    "---------------------------------------------------------------------------------------";

/// The header: operation, transport, rails with MTU and GID, stripe mode, depth.
pub(crate) fn header(args: &Args, a: &Agent, peer: &str) -> String {
    let m = a.metadata();
    let what = match args.op {
        Op::Write => "RDMA WRITE bandwidth",
        Op::Read => "RDMA READ bandwidth",
        Op::Lat => "notification round trip latency",
    };
    let used = a.peer_rails(peer);
    let rails: Vec<String> = m
        .rails
        .iter()
        .filter(|r| used.is_empty() || used.contains(&r.name))
        .map(|r| format!("{} (MTU {}, GID {})", r.name, r.mtu, Ipv6Addr::from(r.gid)))
        .collect();
    let transport = if used.is_empty() { "tcp" } else { "verbs" };
    let stripe = match args.stripe_width {
        None => "one rail per transfer",
        Some(_) => "every transfer striped over all rails",
    };
    let mut s = format!("{RULE}\n                    kvrail-perf: {what}\n");
    s += &format!(" Transport        : {transport}\n");
    if !rails.is_empty() {
        s += &format!(" Rails            : {}\n", rails.join(", "));
        s += &format!(" Striping         : {stripe}\n");
    }
    if let Some(r) = a.notif_rail(peer) {
        s += &format!(" Notifications    : SEND/RECV channel on {r}\n");
    }
    if transport == "verbs" {
        s += &if args.use_event || args.spin_us == 0 {
            " Completions      : sleeping on events (-e)\n".to_owned()
        } else {
            format!(
                " Completions      : polled by the waiting thread, {} us budget\n",
                args.spin_us
            )
        };
    }
    if args.op != Op::Lat {
        s += &format!(
            " Transfers in flight: {}   Descriptors per transfer: {}\n",
            args.depth, args.descs
        );
        s += &match args.slots {
            None => " Buffers per side : one per transfer in flight (64 MiB at most)\n".to_owned(),
            Some(n) => format!(" Buffers per side : {n} (--slots), taken in turn\n"),
        };
    }
    if args.bidirectional {
        s += " Bidirectional    : on (the server runs the same toward us; BW is the sum)\n";
    }
    s += &format!(
        " Data check       : {}\n{RULE}\n",
        if args.no_verify { "off" } else { "on" }
    );
    s
}

/// The bandwidth column titles.
pub(crate) fn bw_titles(gbits: bool) -> String {
    let u = if gbits { "Gb/sec" } else { "MiB/sec" };
    format!(" #bytes     #iterations    BW peak[{u}]    BW average[{u}]   MsgRate[Mpps]")
}

fn bw_unit(bps: f64, gbits: bool) -> f64 {
    if gbits {
        bps * 8.0 / 1e9
    } else {
        bps / f64::from(1u32 << 20)
    }
}

/// One bandwidth line, perftest's layout.
pub(crate) fn bw_line(b: &Bw, gbits: bool) -> String {
    format!(
        " {:<10} {:<14} {:<18.2} {:<20.2} {:.6}",
        b.bytes,
        b.iterations,
        bw_unit(b.peak_bps, gbits),
        bw_unit(b.avg_bps, gbits),
        b.msg_rate_mpps
    )
}

/// The latency column titles.
pub(crate) fn lat_titles() -> &'static str {
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
}

/// One latency line.
pub(crate) fn lat_line(l: &Lat) -> String {
    format!(
        " {:<6} {:<10} {:>13.2} {:>14.2} {:>16.2} {:>14.2} {:>16.2} {:>22.2} {:>24.2}",
        l.bytes, l.iterations, l.t_min, l.t_max, l.t_typical, l.t_avg, l.t_stdev, l.p99, l.p999
    )
}

/// The rails (lanes) this agent moves data to `peer` on.
fn used_rails(a: &Agent, peer: &str) -> Vec<kvrail::agent::metadata::RailAddr> {
    let used = a.peer_rails(peer);
    (a.metadata().rails.into_iter())
        .filter(|r| used.contains(&r.name))
        .collect()
}

/// The `--json` document.
pub(crate) fn json(
    args: &Args,
    a: &Agent,
    peer: &str,
    bw: &[(Bw, Option<u64>)],
    lat: &[Lat],
) -> serde_json::Value {
    let used = used_rails(a, peer);
    let rails: Vec<serde_json::Value> = used
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.name, "mtu": r.mtu, "gid": Ipv6Addr::from(r.gid).to_string(),
            })
        })
        .collect();
    let results: Vec<serde_json::Value> = bw
        .iter()
        .map(|(b, wrong)| {
            serde_json::json!({
                "bytes": b.bytes,
                "iterations": b.iterations,
                "seconds": b.seconds,
                "bw_peak_mbps": bw_unit(b.peak_bps, false),
                "bw_avg_mbps": bw_unit(b.avg_bps, false),
                "bw_peak_gbps": bw_unit(b.peak_bps, true),
                "bw_avg_gbps": bw_unit(b.avg_bps, true),
                "msg_rate_mpps": b.msg_rate_mpps,
                "ctx_switches_per_xfer": b.ctx_switches_per_xfer,
                "wrong_bytes": wrong,
                "slots": b.slots,
            })
        })
        .collect();
    serde_json::json!({
        "tool": "kvrail-perf",
        "op": args.op,
        "transport": if used.is_empty() { "tcp" } else { "verbs" },
        "rails": rails,
        "stripe_width": args.stripe_width,
        "depth": args.depth,
        "descs": args.descs,
        "verify": !args.no_verify,
        "results": results,
        "latency": lat,
        // bytes completed on each rail (each queue pair with -q) since the agent started
        "rail_bytes": a.rail_bytes(),
    })
}

/// The `--out_json_file` document, with perftest's keys: `test_info` (the run) and
/// `results` (one object for one size, a list for a sweep; BW in MiB/s, or Gb/s with
/// `--report_gbits`, as the table). Unlike perftest's file it is valid JSON.
pub(crate) fn perftest_json(
    args: &Args,
    a: &Agent,
    peer: &str,
    bw: &[(Bw, Option<u64>)],
    lat: &[Lat],
) -> serde_json::Value {
    let rails = used_rails(a, peer);
    let test = match args.op {
        Op::Write => "RDMA_Write_BW_Test",
        Op::Read => "RDMA_Read_BW_Test",
        Op::Lat => "Notification_Lat_Test",
    };
    let devices: Vec<&str> = rails.iter().map(|r| r.name.as_str()).collect();
    let test_info = serde_json::json!({
        "test": test,
        "Dual_port": "OFF",
        "Bidirectional": if args.bidirectional { "ON" } else { "OFF" },
        "Device": if devices.is_empty() { "tcp".to_owned() } else { devices.join(",") },
        "Number_of_qps": rails.len().max(1),
        "Transport_type": if rails.is_empty() { "TCP" } else { "IB" },
        "Connection_type": if rails.is_empty() { "TCP" } else { "RC" },
        "Using_SRQ": "OFF",
        "TX_depth": args.depth,
        "Mtu": rails.iter().map(|r| r.mtu).min(),
        "Link_type": if rails.is_empty() { "TCP" } else { "Ethernet" },
        "GID": rails.first().map(|r| Ipv6Addr::from(r.gid).to_string()),
        "Data_ex_method": "kvrail side channel (TCP)",
        "Descriptors_per_transfer": args.descs,
        "Data_check": if args.no_verify { "OFF" } else { "ON" },
    });
    let mut results: Vec<serde_json::Value> = bw
        .iter()
        .map(|(b, _)| {
            serde_json::json!({
                "MsgSize": b.bytes,
                "n_iterations": b.iterations,
                "BW_peak": round2(bw_unit(b.peak_bps, args.report_gbits)),
                "BW_average": round2(bw_unit(b.avg_bps, args.report_gbits)),
                "MsgRate": b.msg_rate_mpps,
            })
        })
        .collect();
    results.extend(lat.iter().map(|l| {
        serde_json::json!({
            "MsgSize": l.bytes,
            "n_iterations": l.iterations,
            "t_min": l.t_min,
            "t_max": l.t_max,
            "t_typical": l.t_typical,
            "t_avg": l.t_avg,
            "t_stdev": l.t_stdev,
            "percentile_99": l.p99,
            "percentile_99.9": l.p999,
        })
    }));
    let results = if results.len() == 1 {
        results.remove(0)
    } else {
        serde_json::Value::Array(results)
    };
    serde_json::json!({"test_info": test_info, "results": results})
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// A progress bar on stderr for sweeps (`done` of `total` sizes).
pub(crate) fn progress(done: usize, total: usize, size: u64) {
    const W: usize = 30;
    let f = done * W / total.max(1);
    eprint!(
        "\r[{}{}] {done}/{total} sizes, now {size} B ",
        "#".repeat(f),
        ".".repeat(W - f)
    );
    if done == total {
        eprintln!();
    }
}
