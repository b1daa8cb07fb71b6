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
        out.contains("#bytes     #iterations    BW peak[MiB/sec]"),
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
        "--op",
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

/// `--slots 1` is perftest's layout (every transfer in flight moves the same bytes); the
/// default takes one buffer per transfer in flight. Both check every byte, WRITE and READ.
#[test]
fn slots_choose_the_buffers_transfers_take_in_turn() {
    for (op, slots, want) in [
        ("write", Some("1"), 1),
        ("read", Some("1"), 1),
        ("write", Some("3"), 3),
        ("read", None, 8),
    ] {
        let mut args = vec![
            "--loopback",
            "--transport",
            "tcp",
            "--op",
            op,
            "-s",
            "256K",
            "-n",
            "40",
            "-t",
            "8",
            "--json",
        ];
        if let Some(n) = slots {
            args.extend(["--slots", n]);
        }
        let o = perf(&args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}: {out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON document");
        let r = &v["results"][0];
        assert_eq!(r["slots"], want, "{args:?}: {r}");
        assert_eq!(r["iterations"], 40, "{r}");
        assert_eq!(r["wrong_bytes"], 0, "{args:?}: {r}");
    }
    let o = perf(&[
        "--loopback",
        "--transport",
        "tcp",
        "-n",
        "5",
        "--slots",
        "2",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains(" Buffers per side : 2 (--slots)"), "{out}");
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
        "--op",
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
            &["--loopback", "-s", "0"][..],
            "size must be at least 1 byte",
        ),
        (&["--loopback", "-s", "12Q"][..], "is not a size"),
        (
            &["--loopback", "-t", "0"][..],
            "-t/--tx-depth must be at least 1",
        ),
        (
            &["--loopback", "--descs", "0"][..],
            "--descs must be at least 1",
        ),
        (
            &["--loopback", "--slots", "0"][..],
            "--slots must be at least 1",
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
            &["--loopback", "--transport", "carrier-pigeon"][..],
            "carrier-pigeon",
        ),
        // (issue 46: these hung for the loopback server's 600 s idle limit, or exited 1)
        (&["--loopback", "--rails", "nosuchdev"][..], "nosuchdev"),
        (
            &["--loopback", "--peer-devices", "nosuchdev"][..],
            "nosuchdev",
        ),
        (
            &["--loopback", "--listen", "nonsense"][..],
            "--listen: \"nonsense\" is not ADDR:PORT",
        ),
        (
            &["--loopback", "--metrics-listen", "x"][..],
            "--metrics-listen",
        ),
        (
            &["--loopback", "--side-channel-host", "x"][..],
            "--side-channel-host",
        ),
        (
            &["--loopback", "--op", "lat", "-s", "8M"][..],
            "at most 4194304 bytes",
        ),
    ] {
        let t = std::time::Instant::now();
        let o = perf(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "{args:?} took {:?} to refuse",
            t.elapsed()
        );
    }
}

/// Defect (issue 46): `kvrail-perf ... | head -1` panicked (exit 101) on the closed pipe.
#[test]
fn a_closed_stdout_ends_the_run_quietly() {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args(["--loopback", "-a", "-n", "20"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    std::io::Read::read_exact(c.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(c.stdout.take()); // the reader goes, as `head -1` does
    let o = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(141), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Defect (issue 46): `--op lat -a` always failed at 8 MiB, over the notification limit;
/// the sweep stops at the limit.
#[test]
fn a_latency_sweep_stops_at_the_notification_limit() {
    let o = perf(&["--loopback", "--op", "lat", "-a", "-n", "3"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    let sizes: Vec<u64> = (out.lines())
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert_eq!(sizes.first(), Some(&2), "{out}");
    assert_eq!(sizes.last(), Some(&(4 << 20)), "{out}");
}

/// Defect (issue 46): a server that accepts and never answers gave "Resource temporarily
/// unavailable" after 20 s; it is a timeout, said once.
#[test]
fn a_silent_server_is_a_timeout() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let keep = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming().take(2).flatten() {
            held.push(s);
        }
        std::thread::sleep(std::time::Duration::from_secs(15));
    });
    let t = std::time::Instant::now();
    let o = perf(&["127.0.0.1", "-p", &port]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("timed out after 10 s"), "{err}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(15),
        "{:?}",
        t.elapsed()
    );
    drop(keep);
}

/// A `kvrail-perf --server` on a free loopback port, once it listens: (process, address).
fn server() -> (std::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let (server, line) = start_server(&["--server", "--transport", "tcp", "--listen", &listen]);
    assert!(line.contains(&listen), "{line}");
    (server, listen)
}

/// A kvrail-perf server with `args`, once it printed its side channel (that line too).
fn start_server(args: &[&str]) -> (std::process::Child, String) {
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("server");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    (server, line)
}

#[test]
fn server_and_client_in_two_processes() {
    let (mut server, listen) = server();
    let o = perf(&[
        "--client",
        &listen,
        "--transport",
        "tcp",
        "--op",
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
    let (_, err) = run(&["--quiet"], Some("kvrail=debug"));
    assert!(
        err.contains("DEBUG"),
        "RUST_LOG should win over --quiet: {err}"
    );
    // the agent's registration and handshake lines, errors and ids as fields
    assert!(err.contains("memory registered"), "{err}");
    assert!(err.contains("handshake done; peer connected"), "{err}");
    let (_, err) = run(&["--log-json"], Some("kvrail=debug"));
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|j| j["fields"]["message"] == "memory registered"
                && j["fields"]["agent"].is_string()
                && j["fields"]["len"].is_u64()),
        "{err}"
    );
}

/// Defects: the server registered whatever a client asked (`-s 2G` aborted it), exited on
/// a word from an agent that was not its client, and a client took 30-120 s to notice a
/// dead server.
#[test]
fn the_server_survives_strangers_and_a_client_notices_its_death() {
    use kvrail::agent::{Agent, AgentConfig, BackendChoice};
    use std::time::{Duration, Instant};
    let (mut server, listen) = server();
    let tcp = || AgentConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend: BackendChoice::Tcp,
        ..AgentConfig::default()
    };
    let wait_answer = |a: &Agent| {
        let t = Instant::now();
        loop {
            if let Some((_, m)) = a.get_new_notifs().pop() {
                return String::from_utf8_lossy(&m).into_owned();
            }
            assert!(t.elapsed() < Duration::from_secs(30), "no answer");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // a stranger sends garbage and an echo request: dropped, the server stays up
    let stranger = Agent::new("stranger", tcp()).unwrap();
    let peer = stranger.load_remote(listen.parse().unwrap()).unwrap();
    stranger.send_notif(&peer, b"garbage".to_vec()).unwrap();
    stranger
        .send_notif(&peer, b"kvrail-perf:check 10 1".to_vec())
        .unwrap();
    // a client asking for 2 GiB is refused, in words, and the server stays up
    let greedy = Agent::new("greedy", tcp()).unwrap();
    let peer = greedy.load_remote(listen.parse().unwrap()).unwrap();
    let me = greedy.side_channel_addr();
    greedy
        .send_notif(
            &peer,
            format!("kvrail-perf:hello {me} {} 7 host", 2u64 << 30).into_bytes(),
        )
        .unwrap();
    let a = wait_answer(&greedy);
    assert!(
        a.starts_with("kvrail-perf:error cannot register 2147483648 bytes"),
        "{a}"
    );
    assert!(server.try_wait().unwrap().is_none(), "the server exited");
    // the client's own -s 2G is refused before it asks
    let o = perf(&["--client", &listen, "-s", "2G"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(text(&o).1.contains("over 1024 MiB"), "{:?}", text(&o));
    // a real client still gets served; then the server dies under a latency run, and the
    // client says so within seconds (it waited out 30 s per message)
    let mut client = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args(["--client", &listen, "--transport", "tcp", "--op", "lat"])
        .args(["-s", "64", "-D", "120"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        client.try_wait().unwrap().is_none(),
        "the client ended early"
    );
    server.kill().unwrap();
    server.wait().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = client.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the client did not notice the dead server in 15 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut client.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("closed"), "{err}");
}

/// A perftest command line works as it is: the server is the one without a host (port `-p`),
/// the client names the host positionally; `--out_json_file` gets perftest's keys.
#[test]
fn a_perftest_command_line_and_its_json_file() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let common = ["--transport", "tcp", "-s", "1M", "-n", "100", "-p", &port];
    let (mut server, line) = start_server(&common);
    assert!(line.contains(&format!(":{port}")), "{line}");
    let dir = std::env::temp_dir().join(format!("kvrail-perf-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("out.json");
    let f = file.to_str().unwrap();
    let o = perf(
        &[
            &common[..],
            &[
                "--perform_warm_up",
                "--out_json",
                "--out_json_file",
                f,
                "127.0.0.1",
            ],
        ]
        .concat(),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("BW average[MiB/sec]"), "{out}");
    assert!(server.wait().unwrap().success(), "server failed");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let r = &v["results"];
    assert_eq!(r["MsgSize"], 1 << 20, "{v}");
    assert_eq!(
        r["n_iterations"], 100,
        "warm-up transfers are not counted: {v}"
    );
    assert!(r["BW_average"].as_f64().unwrap() > 0.0, "{v}");
    assert!(
        r["BW_peak"].as_f64().unwrap() >= r["BW_average"].as_f64().unwrap() - 0.01,
        "{v}"
    );
    assert!(r["MsgRate"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["test_info"]["test"], "RDMA_Write_BW_Test");
    assert_eq!(v["test_info"]["TX_depth"], 32);
    // the table's average is the file's
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("1048576 "))
        .unwrap();
    let avg: f64 = row.split_whitespace().nth(3).unwrap().parse().unwrap();
    assert!(
        (avg - r["BW_average"].as_f64().unwrap()).abs() < 0.01,
        "{row} vs {v}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// SIGINT stops a client's run: what it measured is printed, then exit 130; the server ends
/// too. `--run_infinitely` prints a line per period meanwhile.
#[test]
fn sigint_prints_what_was_measured_and_exits_130() {
    let (mut server, listen) = server();
    let mut client = Command::new(env!("CARGO_BIN_EXE_kvrail-perf"))
        .args([
            "--client",
            &listen,
            "--transport",
            "tcp",
            "-s",
            "64K",
            "-t",
            "4",
        ])
        .args(["-D", "1", "--run_infinitely"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(3500));
    assert!(
        client.try_wait().unwrap().is_none(),
        "the run ended by itself"
    );
    let pid = client.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    let o = client.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(130), "{out}\n{err}");
    let rows = out
        .lines()
        .filter(|l| l.trim_start().starts_with("65536 "))
        .count();
    assert!(rows >= 3, "a line per second before the signal: {out}");
    assert!(
        out.contains("# interrupted: the numbers above are what was measured"),
        "{out}"
    );
    assert!(
        server.wait().unwrap().success(),
        "the server did not end with its client"
    );
}

/// perftest flags kvrail cannot honour are refused by name (exit 2), never ignored.
#[test]
fn perftest_flags_kvrail_cannot_honour_are_refused() {
    for (args, want) in [
        (&["--loopback", "-q", "17"][..], "-q 17: use 1 to 16"),
        (
            &["--loopback", "--transport", "tcp", "-q", "2"][..],
            "not with --transport tcp",
        ),
        (
            &["--loopback", "-b", "--op", "lat"][..],
            "-b: bandwidth only",
        ),
        (&["--loopback", "-m", "1000"][..], "-m 1000: use 256"),
        (&["--loopback", "-i", "0"][..], "-i 0"),
        (
            &["--loopback", "-a", "--run_infinitely"][..],
            "--run_infinitely measures one size",
        ),
        (&["somehost", "--loopback"][..], "cannot be used with"),
        (&["nowhere.invalid", "-p", "1"][..], "HOST: cannot resolve"),
        // -e sleeps on events: a polling budget beside it says the opposite
        (
            &["--loopback", "-e", "--spin-us", "50"][..],
            "cannot be used with",
        ),
    ] {
        let o = perf(args);
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{args:?} succeeded: {out}");
        assert!(err.contains(want), "{args:?}: {err}");
        // usage is 2; a host that does not resolve is a failed run, 1
        let want_code = if want.contains("resolve") { 1 } else { 2 };
        assert_eq!(o.status.code(), Some(want_code), "{args:?}: {err}");
    }
}

/// `-b`: the server runs the same operation toward the client at once; the line is the sum
/// of both directions (twice the iterations), and both directions' bytes are checked.
#[test]
fn bidirectional_sums_both_directions_with_both_checked() {
    for op in ["write", "read"] {
        let (mut server, listen) = server();
        let o = perf(&[
            "--client",
            &listen,
            "--transport",
            "tcp",
            "--op",
            op,
            "-b",
            "-s",
            "128K",
            "-n",
            "60",
            "-t",
            "4",
            "--json",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{op}: {out}\n{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["results"][0]["iterations"], 120, "{op}: {v}");
        assert_eq!(v["results"][0]["wrong_bytes"], 0, "{op}: {v}");
        assert!(server.wait().unwrap().success(), "server failed");
    }
}
