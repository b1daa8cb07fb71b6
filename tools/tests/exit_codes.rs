//! The exit statuses each tool documents in its `--help`, one run each (kvrail-rails' and
//! kvrail-perf's are in their own suites): 0 success, 1 a failed run, 2 usage.

use std::process::Command;

fn code(bin: &str, args: &[&str]) -> (Option<i32>, String) {
    let o = Command::new(bin).args(args).output().expect("run the tool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code(), text)
}

/// True where this host has RDMA devices (then "no RDMA" cannot be provoked).
fn has_rdma() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

#[test]
fn kvrail_demo_0_1_2() {
    let demo = env!("CARGO_BIN_EXE_kvrail-demo");
    let small = ["--requests", "2", "--layers", "2", "--num-blocks", "32"];
    let (c, t) = code(demo, &[&small[..], &["--backend", "tcp"]].concat());
    assert_eq!(c, Some(0), "{t}");
    let (c, t) = code(demo, &["--requests", "0"]);
    assert_eq!(c, Some(2), "{t}");
    let (c, t) = code(demo, &["--no-such-flag"]);
    assert_eq!(c, Some(2), "{t}");
    if !has_rdma() {
        // verbs forced where there is no RDMA: the instances cannot start
        let (c, t) = code(demo, &[&small[..], &["--backend", "verbs"]].concat());
        assert_eq!(c, Some(1), "{t}");
        assert!(t.contains("did not start"), "{t}");
    }
}

#[test]
fn kvrail_verbs_bw_1_2() {
    let bw = env!("CARGO_BIN_EXE_kvrail-verbs-bw");
    let (c, t) = code(bw, &["-s", "1M"]);
    assert_eq!(c, Some(2), "a size it cannot parse: {t}");
    if !has_rdma() {
        let (c, t) = code(bw, &["--dev-a", "x", "--dev-b", "y"]);
        assert_eq!(c, Some(1), "{t}");
        assert!(t.contains("RDMA unavailable"), "{t}");
    }
}
