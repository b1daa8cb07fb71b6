//! kvrail-perf end to end on this host (TCP loopback: two agents in one process, real
//! sockets): the table, the JSON document, the data check, latency, and argument errors.

use std::process::{Command, Output};

fn perf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args(args)
        .output()
        .expect("run kvrail-perf")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn loopback_write_table_with_data_check() {
    let o = perf(&[
        "--loopback",
        "--transport",
        "tcp",
        "-s",
        "64K",
        "-n",
        "50",
        "-t",
        "4",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("kvrail-perf: RDMA WRITE bandwidth"), "{out}");
    assert!(out.contains(" Transport        : tcp"), "{out}");
    assert!(
        out.contains("#bytes     #iterations    BW peak[MB/sec]"),
        "{out}"
    );
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("65536 "))
        .unwrap_or_else(|| panic!("no result line: {out}"));
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cols[1], "50", "{line}");
    assert!(cols[3].parse::<f64>().unwrap() > 0.0, "{line}");
    assert!(
        out.contains("# data check: every byte of every size verified"),
        "{out}"
    );
}

#[test]
fn json_read_with_many_descriptors() {
    let o = perf(&[
        "--loopback",
        "--transport",
        "tcp",
        "-o",
        "read",
        "-s",
        "1M",
        "--descs",
        "16",
        "-n",
        "20",
        "-t",
        "8",
        "--json",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON document");
    assert_eq!(v["tool"], "kvrail-perf");
    assert_eq!(v["op"], "read");
    assert_eq!(v["transport"], "tcp");
    assert_eq!(v["descs"], 16);
    let r = &v["results"][0];
    assert_eq!(r["bytes"], 1 << 20);
    assert_eq!(r["iterations"], 20);
    assert_eq!(r["wrong_bytes"], 0);
    assert!(r["ctx_switches_per_xfer"].as_f64().is_some(), "{r}");
    assert!(r["bw_avg_mbps"].as_f64().unwrap() > 0.0);
    assert!(!out.contains("BW peak"), "no table in --json mode");
}

#[test]
fn sweep_and_report_gbits() {
    let o = perf(&[
        "--loopback",
        "--transport",
        "tcp",
        "-a",
        "-n",
        "5",
        "-t",
        "2",
        "--report_gbits",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("BW average[Gb/sec]"), "{out}");
    let sizes: Vec<u64> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(sizes, (1..=23).map(|k| 1u64 << k).collect::<Vec<_>>());
    // stdout is not a terminal here: no progress bar
    assert!(!err.contains("sizes, now"), "{err}");
}

#[test]
fn notification_latency() {
    let o = perf(&[
        "--loopback",
        "--transport",
        "tcp",
        "-o",
        "lat",
        "-s",
        "32",
        "-n",
        "200",
        "--json",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let l = &v["latency"][0];
    assert_eq!(l["iterations"], 200);
    assert_eq!(l["bytes"], 32);
    let (min, typ, max) = (
        l["t_min"].as_f64().unwrap(),
        l["t_typical"].as_f64().unwrap(),
        l["t_max"].as_f64().unwrap(),
    );
    assert!(min > 0.0 && min <= typ && typ <= max, "{l}");
}

#[test]
fn no_verify_says_nothing_about_a_check() {
    let o = perf(&[
        "--loopback",
        "--transport",
        "tcp",
        "-s",
        "4K",
        "-n",
        "10",
        "--no-verify",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("Data check       : off"), "{out}");
    assert!(!out.contains("# data check"), "{out}");
}

#[test]
fn bad_arguments_are_refused_with_the_flag_named() {
    for (args, want) in [
        (
            &["-s", "1M"][..],
            "say --server, --client HOST:PORT or --loopback",
        ),
        (
            &["--loopback", "-s", "0"][..],
            "size must be at least 1 byte",
        ),
        (&["--loopback", "-s", "12Q"][..], "is not a size"),
        (
            &["--loopback", "-t", "0"][..],
            "-t/--depth must be at least 1",
        ),
        (
            &["--loopback", "--descs", "0"][..],
            "--descs must be at least 1",
        ),
        (
            &["--loopback", "-s", "3", "--descs", "4"][..],
            "size 3 cannot be split into 4 descriptors",
        ),
        (
            &["--loopback", "-D", "0"][..],
            "-D/--duration must be a positive number of seconds",
        ),
        (
            &["--client", "nowhere.invalid:1"][..],
            "--client: cannot resolve",
        ),
        (
            &["--loopback", "--transport", "carrier-pigeon"][..],
            "carrier-pigeon",
        ),
    ] {
        let o = perf(args);
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{args:?} succeeded: {out}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn server_and_client_in_two_processes() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args(["--server", "--transport", "tcp", "--listen", &listen])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("server");
    // the server prints its side channel once it listens
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.contains(&listen), "{line}");
    let o = perf(&[
        "--client",
        &listen,
        "--transport",
        "tcp",
        "-o",
        "write",
        "-s",
        "256K",
        "-n",
        "40",
        "-t",
        "4",
        "--json",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    // WRITE: the server compared its memory with the client's pattern
    assert_eq!(v["results"][0]["wrong_bytes"], 0);
    assert_eq!(v["results"][0]["iterations"], 40);
    // the server exits once the client said bye
    assert!(server.wait().unwrap().success(), "server failed");
}

/// kvrail's log events on stderr: none below warnings by default, info with `-v`, JSON
/// objects with `--log-json`, and `RUST_LOG` over the flags; stdout keeps only the table.
#[test]
fn log_output_follows_the_flags_and_rust_log() {
    let base = ["--loopback", "--transport", "tcp", "-s", "4K", "-n", "10"];
    let run = |extra: &[&str], env: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"));
        c.args(base).args(extra).env_remove("RUST_LOG");
        if let Some(f) = env {
            c.env("RUST_LOG", f);
        }
        let o = c.output().expect("run kvrail-perf");
        assert!(o.status.success(), "{:?}", text(&o));
        text(&o)
    };
    let (out, err) = run(&[], None);
    assert!(!err.contains("INFO"), "info logged by default: {err}");
    assert!(!out.contains("kvrail backend"), "logs on stdout: {out}");
    let (_, err) = run(&["-v"], None);
    assert!(
        err.contains("INFO") && err.contains("kvrail backend: tcp (configured)"),
        "{err}"
    );
    assert!(!err.contains('\u{1b}'), "colour codes into a pipe: {err}");
    let (_, err) = run(&["-v", "--log-json"], None);
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(lines
        .iter()
        .any(|j| j["level"] == "INFO" && j["fields"]["agent"] == "kvrail-perf-server"));
    let (_, err) = run(&["-q"], Some("kvrail=debug"));
    assert!(err.contains("DEBUG"), "RUST_LOG should win over -q: {err}");
}
