//! `kvrail-rails` inside the kvrail lab (tools/lab/): host A's rails are listed usable with
//! their real GIDs and addresses (the VM has no default route and rxe has no NUMA node:
//! neither may confuse the verdicts), `probe` from host A to `serve` on host B reports both
//! rail pairs connected with numbers, and with one rail's link taken down that pair fails
//! with its reason while the other still passes. Outside the lab every case is SKIPPED.

#[path = "../../tests/lab/mod.rs"]
mod lab;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use lab::runner::Runner;
use lab::{ip_link, wait_port, Topology as Lab};

type R = Result<(), String>;

fn rails(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvrail-rails"))
        .args(args)
        .output()
        .expect("run kvrail-rails")
}

fn ensure(c: bool, msg: impl FnOnce() -> String) -> R {
    if c {
        Ok(())
    } else {
        Err(msg())
    }
}

fn json(o: &Output) -> Result<serde_json::Value, String> {
    serde_json::from_slice(&o.stdout).map_err(|e| {
        format!(
            "bad JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

fn main() {
    let mut r = Runner::new("rails_lab");
    let cases = [
        "list_shows_host_a_rails_usable",
        "probe_connects_both_rail_pairs",
        "link_down_fails_that_pair_only",
        "gids_match_ibv_devinfo",
    ];
    let Some(lab) = Lab::from_env() else {
        println!("rails_lab: not inside the kvrail lab (LAB_GUEST unset): every case SKIPPED");
        for c in cases {
            r.skip(c);
        }
        r.finish();
    };
    r.run(cases[0], || list(&lab));
    r.run(cases[3], || gids(&lab));
    let server = Server::start(&lab);
    match server {
        Ok(srv) => {
            r.run(cases[1], || probe_all(&lab, &srv));
            r.run(cases[2], || link_down(&lab, &srv));
        }
        Err(e) => r.run("start_kvrail_rails_serve", || Err(e)),
    }
    r.finish();
}

/// `(index, GID)` of every entry of `dev` port 1 as `ibv_devinfo -v` prints them
/// (`GID[  1]:  ::ffff:198.18.0.1, RoCE v2`), the GID parsed whatever its form.
fn devinfo_gids(dev: &str) -> Result<Vec<(u64, std::net::Ipv6Addr, String)>, String> {
    let o = Command::new("ibv_devinfo")
        .args(["-v", "-d", dev])
        .output()
        .map_err(|e| format!("ibv_devinfo: {e}"))?;
    let text = String::from_utf8_lossy(&o.stdout);
    let mut v = Vec::new();
    for l in text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("GID["))
    {
        let (idx, rest) = l["GID[".len()..]
            .split_once("]:")
            .ok_or_else(|| format!("unparsed: {l}"))?;
        let (gid, kind) = rest.trim().split_once(", ").unwrap_or((rest.trim(), ""));
        let index = idx.trim().parse().map_err(|_| format!("unparsed: {l}"))?;
        let gid = gid.parse().map_err(|_| format!("unparsed GID: {l}"))?;
        v.push((index, gid, kind.to_owned()));
    }
    Ok(v)
}

/// `kvrail-rails gids` shows each lab port's GID table as the verbs library reads it
/// (`ibv_devinfo -v`), with the IPv4 entry (RoCE v2) marked.
fn gids(lab: &Lab) -> R {
    for dev in lab.a_devs.iter().chain(&lab.b_devs) {
        let o = rails(&["gids", &format!("{dev}/1")]);
        print!("{}", String::from_utf8_lossy(&o.stdout));
        ensure(o.status.success(), || {
            String::from_utf8_lossy(&o.stderr).into_owned()
        })?;
        let v = json(&rails(&["gids", &format!("{dev}/1"), "--json"]))?;
        let mine: Vec<(u64, std::net::Ipv6Addr, String)> = (v.as_array().ok_or("no rows")?)
            .iter()
            .map(|r| {
                let gid = r["gid"]
                    .as_str()
                    .unwrap_or("")
                    .parse()
                    .unwrap_or(std::net::Ipv6Addr::UNSPECIFIED);
                let kind = match r["version"].as_str() {
                    Some("v2") => "RoCE v2",
                    Some("v1") => "RoCE v1",
                    _ => "",
                };
                (
                    r["index"].as_u64().unwrap_or(u64::MAX),
                    gid,
                    kind.to_owned(),
                )
            })
            .collect();
        let theirs = devinfo_gids(dev)?;
        ensure(!theirs.is_empty() && mine == theirs, || {
            format!("{dev}: kvrail-rails {mine:?}, ibv_devinfo {theirs:?}")
        })?;
        let chosen: Vec<&serde_json::Value> = (v.as_array().ok_or("no rows")?)
            .iter()
            .filter(|r| r["chosen"] == true)
            .collect();
        ensure(
            chosen.len() == 1 && chosen[0]["ipv4"].is_string() && chosen[0]["version"] == "v2",
            || format!("{dev}: chosen {chosen:?}"),
        )?;
    }
    Ok(())
}

fn list(lab: &Lab) -> R {
    let devs = lab.a_devs.join(",");
    let o = rails(&["list", "--devices", &devs]);
    print!("{}", String::from_utf8_lossy(&o.stdout));
    ensure(o.status.success(), || {
        String::from_utf8_lossy(&o.stderr).into_owned()
    })?;
    let v = json(&rails(&["list", "--devices", &devs, "--json"]))?;
    let ports = v["ports"].as_array().ok_or("no ports")?;
    ensure(ports.len() == lab.rails, || {
        format!("{} ports listed", ports.len())
    })?;
    for (i, p) in ports.iter().enumerate() {
        let want_gid = format!("::ffff:{}", lab.a_ips[i]);
        ensure(
            p["usable"] == true
                && p["port"]["device"] == lab.a_devs[i].as_str()
                && p["port"]["state"] == "ACTIVE"
                && p["port"]["netdev"] == lab.a_netdevs[i].as_str()
                && p["port"]["ipv4"][0] == format!("{}/24", lab.a_ips[i]).as_str()
                && p["port"]["numa_node"].is_null()
                && p["port"]["default_route"] == false
                && p["port"]["active_mtu"] == 4096
                && p["gid"]["index"] == lab.gid_index
                && p["gid"]["gid"] == want_gid.as_str(),
            || format!("rail {i}: {p:#}"),
        )?;
    }
    Ok(())
}

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(lab: &Lab) -> Result<Self, String> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvrail-rails"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--devices",
                &lab.b_devs.join(","),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let addr = line
            .trim()
            .strip_prefix("kvrail-rails serve: listening on ")
            .ok_or(format!("serve said {line:?}"))?;
        Ok(Self {
            addr: addr.to_owned(),
            child,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `probe` from host A's rails to the server, as JSON, and how long it took.
fn probe(lab: &Lab, srv: &Server) -> Result<(serde_json::Value, Duration), String> {
    let devs = lab.a_devs.join(",");
    let t = Instant::now();
    let text = rails(&["probe", "--peer", &srv.addr, "--devices", &devs]);
    let took = t.elapsed();
    print!("{}", String::from_utf8_lossy(&text.stdout));
    println!("    (probe took {:.2} s)", took.as_secs_f64());
    Ok((
        json(&rails(&[
            "probe",
            "--peer",
            &srv.addr,
            "--devices",
            &devs,
            "--json",
        ]))?,
        took,
    ))
}

fn probe_all(lab: &Lab, srv: &Server) -> R {
    let (v, _) = probe(lab, srv)?;
    let pairs = v["pairs"].as_array().ok_or("no pairs")?;
    ensure(pairs.len() == lab.rails, || {
        format!("{} pairs, expected one per rail", pairs.len())
    })?;
    for (i, p) in pairs.iter().enumerate() {
        ensure(
            p["local"] == format!("{}:1", lab.a_devs[i]).as_str()
                && p["peer"] == format!("{}:1", lab.b_devs[i]).as_str()
                && p["connected"] == true
                && p["write_small_lat_us"].as_f64().is_some_and(|x| x > 0.0)
                && p["write_large_mib_s"].as_f64().is_some_and(|x| x > 0.0)
                && p["read_large_mib_s"].as_f64().is_some_and(|x| x > 0.0),
            || format!("pair {i}: {p:#}"),
        )?;
    }
    Ok(())
}

fn link_down(lab: &Lab, srv: &Server) -> R {
    ensure(lab.rails >= 2, || "needs two rails".into())?;
    let nd = &lab.a_netdevs[1];
    ip_link(nd, "down")?;
    // probe at once: whether the ports already say DOWN or not, the pair must fail in
    // bounded time with a reason
    let res = probe(lab, srv);
    ip_link(nd, "up")?;
    let (v, _) = res?;
    wait_port(&lab.a_devs[1], "ACTIVE")?;
    let pairs = v["pairs"].as_array().ok_or("no pairs")?;
    let p0 = pairs
        .iter()
        .find(|p| p["local"] == format!("{}:1", lab.a_devs[0]).as_str())
        .ok_or("no rail-0 pair")?;
    let p1 = pairs
        .iter()
        .find(|p| p["local"] == format!("{}:1", lab.a_devs[1]).as_str())
        .ok_or("no rail-1 pair")?;
    ensure(p0["connected"] == true, || {
        format!("rail 0 should still pass: {p0:#}")
    })?;
    ensure(
        p1["connected"] == false
            && p1["step"].is_string()
            && p1["error"].as_str().is_some_and(|e| !e.is_empty()),
        || format!("rail 1 should fail with a step and a reason: {p1:#}"),
    )
}
