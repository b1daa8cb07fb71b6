//! `kvrail-perf` with perftest's command lines inside the kvrail lab, on real queue pairs:
//! the server is `kvrail-perf -d rxeB0 -x 1 -s 1M -n 100`, the client the same with the
//! host; `--out_json_file` names the device, the GID of index 1 and the MTU; `-m 1024`
//! caps the MTU; a GID index the table lacks fails the start naming the table. Outside the
//! lab every case is SKIPPED.

#[path = "../../tests/lab/mod.rs"]
mod lab;

use std::io::BufRead;
use std::process::{Command, Output, Stdio};

use lab::runner::Runner;
use lab::Topology as Lab;

type R = Result<(), String>;

fn ensure(c: bool, msg: impl FnOnce() -> String) -> R {
    if c {
        Ok(())
    } else {
        Err(msg())
    }
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port().to_string())
        .unwrap_or_else(|_| "18515".into())
}

/// Server and client with `common` flags each, the client with `client` too; the client's
/// output and its `--out_json_file`.
fn pair(
    server_dev: &str,
    client_dev: &str,
    extra: &[&str],
) -> Result<(Output, serde_json::Value), String> {
    let port = free_port();
    let bin = env!("CARGO_BIN_EXE_kvrail-perf");
    let common = ["-x", "1", "-s", "1M", "-n", "100", "-p", &port];
    let mut server = Command::new(bin)
        .args(["-d", server_dev])
        .args(common)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    let out = server.stdout.take().ok_or("no stdout")?;
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    ensure(line.contains("side channel on"), || {
        format!("server said {line:?}")
    })?;
    let file = std::env::temp_dir().join(format!("perf-lab-{port}.json"));
    let f = file.to_str().unwrap_or_default().to_owned();
    let o = Command::new(bin)
        .args(["-d", client_dev])
        .args(common)
        .args(extra)
        .args(["--out_json_file", &f, "127.0.0.1"])
        .output()
        .map_err(|e| e.to_string())?;
    let status = server.wait().map_err(|e| e.to_string())?;
    print!("{}", String::from_utf8_lossy(&o.stdout));
    ensure(o.status.success() && status.success(), || {
        format!(
            "client {:?}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        )
    })?;
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{f}: {e}"))?;
    let _ = std::fs::remove_file(&file);
    let v = serde_json::from_str(&text).map_err(|e| format!("{f}: {e}: {text}"))?;
    Ok((o, v))
}

fn main() {
    let mut r = Runner::new("perf_lab");
    let cases = [
        "perftest_command_line_on_rail_0",
        "mtu_cap_and_a_missing_gid_index",
        "two_queue_pairs_per_rail_both_carry_bytes",
        "bidirectional_on_rail_0",
        "verbs_layer_latency_plain_sends_and_the_channel",
    ];
    let Some(lab) = Lab::from_env() else {
        println!("perf_lab: not inside the kvrail lab (LAB_GUEST unset): every case SKIPPED");
        for c in cases {
            r.skip(c);
        }
        r.finish();
    };
    r.run(cases[0], || command_line(&lab));
    r.run(cases[1], || mtu_and_gid(&lab));
    r.run(cases[2], || two_qps(&lab));
    r.run(cases[3], || bidirectional(&lab));
    r.run(cases[4], verbs_lat);
    r.finish();
}

fn command_line(lab: &Lab) -> R {
    let (o, v) = pair(&lab.b_devs[0], &lab.a_devs[0], &[])?;
    let out = String::from_utf8_lossy(&o.stdout);
    ensure(out.contains(" Transport        : verbs"), || {
        out.to_string()
    })?;
    ensure(
        out.contains("# data check: every byte of every size verified"),
        || out.to_string(),
    )?;
    let t = &v["test_info"];
    let want_gid = format!("::ffff:{}", lab.a_ips[0]);
    ensure(
        t["Device"] == format!("{}:1", lab.a_devs[0]).as_str()
            && t["GID"] == want_gid.as_str()
            && t["Mtu"] == 4096
            && t["Connection_type"] == "RC",
        || format!("test_info {t}"),
    )?;
    let res = &v["results"];
    ensure(
        res["MsgSize"] == 1 << 20
            && res["n_iterations"] == 100
            && res["BW_average"].as_f64() > Some(0.0),
        || format!("results {res}"),
    )
}

fn mtu_and_gid(lab: &Lab) -> R {
    let (_, v) = pair(&lab.b_devs[0], &lab.a_devs[0], &["-m", "1024"])?;
    ensure(v["test_info"]["Mtu"] == 1024, || format!("{v}"))?;
    let o = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args([
            "--loopback",
            "-d",
            &lab.a_devs[0],
            "--peer-devices",
            &lab.b_devs[0],
        ])
        .args(["-x", "7", "--transport", "verbs", "-n", "10"])
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&o.stderr);
    // (a GID index the port lacks is found while both agents are built, before anything
    // runs: exit 2, as for every other bad device or address)
    ensure(
        o.status.code() == Some(2)
            && err.contains("gid_index 7")
            && err.contains("has no such GID entry"),
        || format!("{:?}: {err}", o.status),
    )
}

/// `-q 2`: two queue pairs on rail 0, each a lane the transfers spread over; both carry
/// bytes (the client's `--json` counts bytes per lane) and the JSON file says 2.
fn two_qps(lab: &Lab) -> R {
    let (o, v) = pair(&lab.b_devs[0], &lab.a_devs[0], &["-q", "2", "--json"])?;
    ensure(v["test_info"]["Number_of_qps"] == 2, || format!("{v}"))?;
    let out = String::from_utf8_lossy(&o.stdout);
    let doc: serde_json::Value =
        serde_json::from_str(out.trim()).map_err(|e| format!("{e}: {out}"))?;
    let lanes = doc["rail_bytes"].as_array().ok_or("no rail_bytes")?;
    let names: Vec<&str> = lanes.iter().filter_map(|l| l[0].as_str()).collect();
    let want = [
        format!("{}:1/qp0", lab.a_devs[0]),
        format!("{}:1/qp1", lab.a_devs[0]),
    ];
    ensure(names == want, || format!("lanes {names:?}"))?;
    ensure(lanes.iter().all(|l| l[1].as_u64().unwrap_or(0) > 0), || {
        format!("a queue pair carried nothing: {lanes:?}")
    })?;
    ensure(doc["results"][0]["wrong_bytes"] == 0, || format!("{doc}"))
}

/// `-b` on real queue pairs: both directions at once, twice the iterations, every byte of
/// both directions checked.
fn bidirectional(lab: &Lab) -> R {
    let (o, v) = pair(&lab.b_devs[0], &lab.a_devs[0], &["-b"])?;
    let out = String::from_utf8_lossy(&o.stdout);
    ensure(out.contains(" Bidirectional    : on"), || out.to_string())?;
    ensure(
        out.contains("# data check: every byte of every size verified"),
        || out.to_string(),
    )?;
    ensure(
        v["results"]["n_iterations"] == 200 && v["test_info"]["Bidirectional"] == "ON",
        || format!("{v}"),
    )
}

/// `kvrail-verbs-lat` on rail 0: plain SENDs (inline and not) and the notification channel
/// (one slot and several frames per message); each run checks every message that came back
/// and prints a positive typical latency. A plain SEND larger than its buffer is refused.
fn verbs_lat() -> R {
    let bin = env!("CARGO_BIN_EXE_kvrail-verbs-lat");
    for (size, extra) in [
        ("64", &["--mode", "send"][..]),
        ("4096", &["--mode", "send", "--inline", "256"]),
        ("64", &["--inline", "256"]),
        ("3000", &[]),
    ] {
        let o = Command::new(bin)
            .args(["-s", size, "-n", "200"])
            .args(extra)
            .output()
            .map_err(|e| e.to_string())?;
        let out = String::from_utf8_lossy(&o.stdout);
        ensure(o.status.success(), || {
            format!(
                "{size} {extra:?}: {out}{}",
                String::from_utf8_lossy(&o.stderr)
            )
        })?;
        ensure(out.contains("# data check: every message"), || {
            out.to_string()
        })?;
        // the result line: #bytes #iterations t_min t_max t_typical ...
        let typical = (out.lines())
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|w| w.first() == Some(&size) && w.get(1) == Some(&"200"))
            .and_then(|w| w.get(4)?.parse::<f64>().ok());
        ensure(typical.is_some_and(|t| t > 0.0), || {
            format!("{size} {extra:?}: {out}")
        })?;
        println!(
            "    -s {size} {extra:?}: t_typical {:.2} us",
            typical.unwrap_or_default()
        );
    }
    let o = Command::new(bin)
        .args(["--mode", "send", "-s", "5000"])
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure(
        o.status.code() == Some(1) && err.contains("at most 4096"),
        || format!("{:?}: {err}", o.status),
    )
}
