//! `kvrail-rails` on the fixture trees (tier 1): the table, JSON that parses back, explain
//! with check commands, errors, and serve/probe over a real TCP side channel (on a host
//! without RDMA every pair fails at a named step, with the reason).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/sysfs")
        .join(name)
        .display()
        .to_string()
}

fn rails(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvrail-rails"))
        .args(args)
        .output()
        .expect("run kvrail-rails")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn list_table_on_the_two_socket_host() {
    let o = rails(&[
        "list",
        "--sysfs-root",
        &fixture("two-socket-8nic"),
        "--accel",
        "0000:b1:00.0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "# rails for NUMA node 1");
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["DEVICE", "PORT", "STATE", "LINK", "MTU", "NETDEV", "IPV4", "NUMA", "GID", "VERDICT"]
    );
    assert_eq!(
        lines[6].split_whitespace().collect::<Vec<_>>(),
        [
            "mlx5_4",
            "1",
            "ACTIVE",
            "Ethernet",
            "4096",
            "ens5f0",
            "10.4.0.1/24",
            "1",
            "3",
            "::ffff:10.4.0.1",
            "usable"
        ]
    );
    assert!(
        lines[2].ends_with("on NUMA node 0, not the accelerator's node 1"),
        "{}",
        lines[2]
    );
    assert_eq!(*lines.last().unwrap(), "# 4 of 9 port(s) usable");
}

#[test]
fn list_json_parses_back() {
    let o = rails(&[
        "list",
        "--sysfs-root",
        &fixture("port-down"),
        "--numa",
        "0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("valid JSON");
    assert_eq!(v["numa"], 0);
    let ports = v["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 2);
    assert_eq!(ports[0]["usable"], true);
    assert_eq!(ports[0]["port"]["device"], "mlx5_0");
    assert_eq!(ports[0]["port"]["ipv4"][0], "10.0.0.1/24");
    assert_eq!(ports[0]["gid"]["index"], 3);
    assert_eq!(ports[0]["gid"]["gid"], "::ffff:10.0.0.1");
    assert_eq!(ports[1]["usable"], false);
    assert_eq!(ports[1]["reasons"][0]["reason"], "port_not_active");
    assert_eq!(ports[1]["reasons"][0]["state"], "DOWN");
}

#[test]
fn list_says_why_nothing_is_usable() {
    let o = rails(&["list", "--sysfs-root", &fixture("no-rdma"), "--numa", "0"]);
    assert_eq!(o.status.code(), Some(1), "nothing usable is exit status 1");
    let out = stdout(&o);
    assert!(
        out.contains("# no usable data-plane RoCE NIC on numa=0; no RDMA devices under "),
        "{out}"
    );
}

#[test]
fn explain_gives_reasons_and_checks() {
    let o = rails(&[
        "explain",
        "mlx5_8:1",
        "--sysfs-root",
        &fixture("two-socket-8nic"),
        "--numa",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1), "not usable: {}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "mlx5_8:1, netdev eno1: NOT USABLE for NUMA node 1:\n\
         \x20 - on NUMA node 0, not the accelerator's node 1\n\
         \x20   check: cat /sys/class/infiniband/mlx5_8/device/numa_node   # and the accelerator's: cat /sys/bus/pci/devices/<BDF>/numa_node\n\
         \x20 - netdev eno1 carries the default route (management interface, not data plane)\n\
         \x20   check: ip route show default\n"
    );
    // rdma(8)'s DEV/PORT names the same port
    let o2 = rails(&[
        "explain",
        "mlx5_8/1",
        "--sysfs-root",
        &fixture("two-socket-8nic"),
        "--numa",
        "1",
    ]);
    assert_eq!(stdout(&o2), stdout(&o));
    let o = rails(&["explain", "mlx5_0", "--sysfs-root", &fixture("no-ipv4")]);
    let out = stdout(&o);
    assert!(out.contains("check: ip -4 addr show dev ens1f0"), "{out}");
    assert!(
        out.contains("check: grep . /sys/class/infiniband/mlx5_0/ports/1/gids/*"),
        "{out}"
    );
    let o = rails(&["explain", "qib0", "--sysfs-root", &fixture("ib-only")]);
    assert!(
        stdout(&o).contains("check: ibv_devinfo -d qib0"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let o = rails(&["explain", "mlx5_9", "--sysfs-root", &fixture("port-down")]);
    assert_eq!(o.status.code(), Some(4), "no such port");
    assert_eq!(
        stderr(&o),
        "kvrail-rails: no RDMA port mlx5_9 (ports: mlx5_0:1, mlx5_1:1)\n"
    );
    let o = rails(&["explain", "mlx5_0:x", "--sysfs-root", &fixture("port-down")]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "a port that does not parse is usage"
    );
    assert!(
        stderr(&o).contains("port must be a number"),
        "{}",
        stderr(&o)
    );
    let o = rails(&[
        "list",
        "--sysfs-root",
        &fixture("port-down"),
        "--devices",
        "mlx5_0,nope",
    ]);
    assert_eq!(o.status.code(), Some(4), "no such device");
    assert!(
        stderr(&o).contains("no RDMA device \"nope\""),
        "{}",
        stderr(&o)
    );
    let o = rails(&[
        "list",
        "--sysfs-root",
        &fixture("one-nic"),
        "--accel",
        "0000:00:00.9",
    ]);
    assert!(
        stderr(&o).contains("cannot read ") && stderr(&o).contains("0000:00:00.9/numa_node"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        o.status.code(),
        Some(3),
        "an unreadable sysfs file is a runtime error"
    );
    let o = rails(&["list", "--numa", "0", "--accel", "0000:17:00.0"]);
    assert_eq!(o.status.code(), Some(2), "--numa and --accel conflict");
}

#[test]
fn devices_filter() {
    let o = rails(&[
        "list",
        "--sysfs-root",
        &fixture("soft-roce"),
        "--devices",
        "rxeA0,rxeA1",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"]["device"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rxeA0", "rxeA1"]);
}

#[test]
fn probe_of_an_address_nobody_serves_says_which_address() {
    // bind then drop a listener: that port is (almost certainly) closed now
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let peer = format!("127.0.0.1:{port}");
    let o = rails(&[
        "probe",
        "--peer",
        &peer,
        "--sysfs-root",
        &fixture("one-nic"),
    ]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "an unreachable peer is a runtime error"
    );
    let e = stderr(&o);
    assert!(
        e.starts_with(&format!("kvrail-rails: handshake with {peer} failed (")),
        "{e}"
    );
    assert!(e.contains("is `kvrail-rails serve` running there"), "{e}");
}

struct Server(Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(root: &str) -> Server {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrail-rails"))
        .args(["serve", "--listen", "127.0.0.1:0", "--sysfs-root", root])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_owned();
    assert!(
        line.starts_with("kvrail-rails serve: listening on "),
        "{line}"
    );
    Server(c, addr)
}

#[test]
fn serve_and_probe_report_the_failing_step_per_pair() {
    // Both sides read fixture trees; this host has no RDMA, so usable pairs fail when the
    // peer opens its device, and unusable ones fail at the verdict.
    let srv = serve(&fixture("port-down"));
    let o = rails(&[
        "probe",
        "--peer",
        &srv.1,
        "--sysfs-root",
        &fixture("port-down"),
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("valid JSON");
    let pairs = v["pairs"].as_array().unwrap();
    // same-subnet pairing: mlx5_0 (10.0.0.1/24) with mlx5_0, mlx5_1 (10.1.0.1/24) with mlx5_1
    let names: Vec<(String, String)> = pairs
        .iter()
        .map(|p| {
            (
                p["local"].as_str().unwrap().into(),
                p["peer"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("mlx5_0:1".into(), "mlx5_0:1".into()),
            ("mlx5_1:1".into(), "mlx5_1:1".into())
        ]
    );
    assert_eq!(pairs[0]["connected"], false);
    assert_eq!(pairs[0]["step"], "handshake");
    assert!(
        pairs[0]["error"]
            .as_str()
            .unwrap()
            .starts_with("peer: RDMA unavailable"),
        "{}",
        pairs[0]["error"]
    );
    assert_eq!(pairs[1]["step"], "verdict");
    assert_eq!(
        pairs[1]["error"],
        "local mlx5_1:1: port is DOWN, not ACTIVE"
    );
    // --all-pairs tries the cross-subnet pairs too
    let o = rails(&[
        "probe",
        "--peer",
        &srv.1,
        "--sysfs-root",
        &fixture("port-down"),
        "--json",
        "--all-pairs",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["pairs"].as_array().unwrap().len(), 4);
    // the table form
    let o = rails(&[
        "probe",
        "--peer",
        &srv.1,
        "--sysfs-root",
        &fixture("port-down"),
    ]);
    let out = stdout(&o);
    assert!(
        out.starts_with(&format!("# probe of {}: 2 pair(s)\n", srv.1)),
        "{out}"
    );
    assert!(
        out.contains("local mlx5_1:1: port is DOWN, not ACTIVE"),
        "{out}"
    );
}

#[test]
fn serve_survives_garbage_on_the_side_channel() {
    let srv = serve(&fixture("one-nic"));
    for junk in [
        &b"garbage\n"[..],
        &[0xff, 0xfe, b'\n'][..],
        &vec![b'x'; 70_000][..],
    ] {
        let mut s = TcpStream::connect(&srv.1).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let _ = s.write_all(junk);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest); // the server closes the session
        assert!(
            rest.is_empty(),
            "answered garbage with {:?}",
            String::from_utf8_lossy(&rest)
        );
    }
    // and still answers a real prober
    let o = rails(&[
        "probe",
        "--peer",
        &srv.1,
        "--sysfs-root",
        &fixture("one-nic"),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("valid JSON after garbage");
    assert_eq!(v["pairs"].as_array().unwrap().len(), 1);
}

/// `gids` prints the GID table the way `show_gids` does, with kvrail's entry marked, as a
/// table and as JSON; the exit statuses: 0 (an entry chosen), 1 (none usable), 4 (no such
/// port), 2 (a port that does not parse).
#[test]
fn gids_table_json_and_exit_statuses() {
    let root = fixture("soft-roce");
    let o = rails(&["gids", "rxeA1/1", "--sysfs-root", &root]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("DEV        PORT INDEX GID"), "{out}");
    assert!(
        lines[2].starts_with("rxeA1      1    0     fe80:0000:0000:0000:0000:00ff:fe00:01c1")
            && !lines[2].ends_with('*'),
        "{out}"
    );
    assert!(
        lines[3].starts_with(
            "rxeA1      1    1     0000:0000:0000:0000:0000:ffff:c612:0101 198.18.1.1"
        ) && lines[3].contains(" v2 ")
            && lines[3].contains("vethA1")
            && lines[3].ends_with(" *"),
        "{out}"
    );
    assert_eq!(
        lines[4],
        "n_gids_found=2 (* = the entry kvrail's queue pairs use)"
    );
    let o = rails(&["gids", "--sysfs-root", &root, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 8, "two entries on each of four ports");
    let chosen: Vec<(&str, u64)> = rows
        .iter()
        .filter(|r| r["chosen"] == true)
        .map(|r| (r["device"].as_str().unwrap(), r["index"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        chosen,
        [("rxeA0", 1), ("rxeA1", 1), ("rxeB0", 1), ("rxeB1", 1)]
    );
    assert_eq!(rows[1]["ipv4"], "198.18.0.1");
    assert_eq!(rows[0]["ipv4"], serde_json::Value::Null);
    // IPv6-only tables: every entry listed, none kvrail would use
    let o = rails(&["gids", "--sysfs-root", &fixture("no-ipv4")]);
    assert_eq!(o.status.code(), Some(1), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("2001:0db8:0000:0000:0000:0000:0000:0000"));
    assert!(!stdout(&o).contains(" *\n"));
    let o = rails(&["gids", "rxeZ9", "--sysfs-root", &root]);
    assert_eq!(o.status.code(), Some(4));
    assert_eq!(stderr(&o), "kvrail-rails: no RDMA port rxeZ9\n");
    let o = rails(&["gids", "rxeA0/one", "--sysfs-root", &root]);
    assert_eq!(o.status.code(), Some(2));
}

/// `explain --json`: the verdicts of the ports asked about; 1 when none is usable.
#[test]
fn explain_json_and_its_exit_status() {
    let o = rails(&[
        "explain",
        "rxeA0/1",
        "--json",
        "--sysfs-root",
        &fixture("soft-roce"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["usable"], true);
    assert_eq!(v[0]["port"]["device"], "rxeA0");
    let o = rails(&[
        "explain",
        "mlx5_1",
        "--json",
        "--sysfs-root",
        &fixture("port-down"),
    ]);
    assert_eq!(o.status.code(), Some(1), "the port is not usable");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["usable"], false);
    assert_eq!(v[0]["port"]["phys_state"], "Disabled", "{v}");
    // the words say the physical state too (read from sysfs, where the file is)
    let o = rails(&["explain", "mlx5_1", "--sysfs-root", &fixture("port-down")]);
    assert!(
        stdout(&o).contains("  link: port DOWN, physical Disabled, active MTU 4096\n"),
        "{}",
        stdout(&o)
    );
    assert!(!v[0]["reasons"].as_array().unwrap().is_empty(), "{v}");
}
