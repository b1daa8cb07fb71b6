//! Agent metadata through a real etcd (Debian's etcd-server, started here): publish, load by
//! name, follow registrations, a clean stop, a SIGKILLed agent whose key expires and whose
//! restart is loaded again (never its dead incarnation), an unreachable etcd at start, and
//! etcd lost while running. TCP on this host; in the lab on verbs (P on host B's rails, D on
//! host A's: a restarted P's new queue pairs and rkeys), with etcd started inside the VM.

#[path = "etcd/mod.rs"]
mod etcd;
mod lab;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvrail::agent::metadata::BackendKind;
use kvrail::agent::{
    Agent, AgentConfig, AgentError, BackendChoice, Desc, Fault, RegionId, RemoteAccess, XferOp,
    XferStatus,
};
use kvrail::store::{EtcdStore, StoreConfig, StoreError};
use lab::pattern;

const LEN: usize = 1 << 20;

fn store(url: &str, ns: &str, ttl_s: u64) -> StoreConfig {
    let mut s = StoreConfig::from_url(url).unwrap();
    s.namespace = ns.into();
    s.lease_ttl = Duration::from_secs(ttl_s);
    s
}

/// An agent on host A (D's side) or B (P's): TCP here, verbs on that host's rails in the lab.
fn cfg_on(s: Option<StoreConfig>, host_a: bool) -> AgentConfig {
    let mut c = lab::agent_config(host_a);
    if lab::Topology::from_env().is_none() {
        c.backend = BackendChoice::Tcp;
    }
    c.metadata_store = s;
    c
}

fn cfg(s: Option<StoreConfig>) -> AgentConfig {
    cfg_on(s, true)
}

fn cfg_p(s: Option<StoreConfig>) -> AgentConfig {
    cfg_on(s, false)
}

/// In the lab, `d` reaches `peer` on verbs (never a quiet TCP fallback).
fn on_verbs_in_the_lab(d: &Agent, peer: &str) {
    if lab::Topology::from_env().is_some() {
        assert_eq!(d.metadata().backend, BackendKind::Verbs);
        assert_eq!(
            d.remote_metadata(peer).map(|m| m.backend),
            Some(BackendKind::Verbs)
        );
    }
}

/// READ all of `peer`'s region `src` into a fresh region of `d`; the bytes.
fn read_all(d: &Agent, peer: &str, src: RegionId) -> Result<Vec<u8>, String> {
    let dst = d.register(LEN, RemoteAccess::NONE, vec![]).unwrap();
    let r = read_into(d, peer, dst, src, &|| ());
    d.deregister(dst).unwrap();
    r
}

/// READ all of `peer`'s region `src` into `d`'s region `dst`, running `fill` between the
/// transfer's creation and its post; the bytes.
fn read_into(
    d: &Agent,
    peer: &str,
    dst: RegionId,
    src: RegionId,
    fill: &dyn Fn(),
) -> Result<Vec<u8>, String> {
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, LEN as u64)],
            peer,
            vec![Desc::new(src, 0, LEN as u64)],
            None,
        )
        .map_err(|e| e.to_string())?;
    fill();
    d.post(x).map_err(|e| e.to_string())?;
    let st = d
        .wait(x, Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    d.release(x).ok();
    if st != XferStatus::Done {
        return Err(format!("{st:?}"));
    }
    let mut got = vec![0u8; LEN];
    d.read_region(dst, 0, &mut got).unwrap();
    Ok(got)
}

fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

#[test]
fn agents_find_each_other_by_name_and_follow_registrations() {
    let e = etcd::Etcd::start();
    let ns = etcd::namespace("names");
    let s = store(&e.url(), &ns, 30);
    let p = Agent::new("p-0", cfg_p(Some(s.clone()))).unwrap();
    let d = Agent::new("d-0", cfg(Some(s.clone()))).unwrap();
    let src = p.register(LEN, RemoteAccess::READ, vec![]).unwrap();
    p.write_region(src, 0, &pattern(1, LEN)).unwrap();
    let watcher = EtcdStore::connect(&s).unwrap();
    assert_eq!(watcher.agents().unwrap(), ["d-0", "p-0"]);
    assert_eq!(d.load_by_name("p-0").unwrap(), "p-0");
    on_verbs_in_the_lab(&d, "p-0");
    assert_eq!(d.store_up(), Some(true));
    assert!(d.peer_incarnation("p-0").is_some());
    assert!(read_all(&d, "p-0", src).unwrap() == pattern(1, LEN));
    // a region P registers later reaches D through the store's watch (no reload by hand)
    let src2 = p.register(LEN, RemoteAccess::READ, vec![]).unwrap();
    p.write_region(src2, 0, &pattern(2, LEN)).unwrap();
    until("D sees P's new region", Duration::from_secs(20), || {
        d.remote_metadata("p-0")
            .is_some_and(|m| m.regions.iter().any(|r| r.id == src2.0))
    });
    assert!(read_all(&d, "p-0", src2).unwrap() == pattern(2, LEN));
    // a clean stop takes the key away at once (not after the 30 s TTL), and D forgets P
    let inc = d.peer_incarnation("p-0");
    drop(p);
    let gone = until("P's key gone", Duration::from_secs(10), || {
        watcher.fetch("p-0").unwrap().is_none()
    });
    until("D forgot P", Duration::from_secs(10), || {
        !d.peer_connected("p-0")
    });
    println!("a dropped agent's key was gone after {gone:?} (TTL 30 s)");
    assert!(inc.is_some() && d.peer_incarnation("p-0").is_none());
    match d.load_by_name("p-0") {
        Err(AgentError::Store(StoreError::NotFound(n))) => assert_eq!(n, "p-0"),
        other => panic!("{other:?}"),
    }
}

/// A region a peer registered a moment ago is usable at once: a transfer that names what
/// the loaded metadata lacks asks the store before it is refused (the watch delivers a
/// registration within milliseconds; an engine's next request can come sooner). Eight
/// regions, each READ right after its registration returns, every byte checked; a region
/// the peer never registered is still refused, naming it.
#[test]
fn a_region_registered_a_moment_ago_is_usable_at_once() {
    let e = etcd::Etcd::start();
    let ns = etcd::namespace("fresh");
    let s = store(&e.url(), &ns, 30);
    let p = Agent::new("p-1", cfg_p(Some(s.clone()))).unwrap();
    let d = Agent::new("d-1", cfg(Some(s))).unwrap();
    d.load_by_name("p-1").unwrap();
    on_verbs_in_the_lab(&d, "p-1");
    let dst = d.register(LEN, RemoteAccess::NONE, vec![]).unwrap();
    // the transfer is created right after the registration returns (the race is there: its
    // checks use the loaded metadata); the bytes are written before it is posted
    let read = |src: RegionId, fill: &dyn Fn()| read_into(&d, "p-1", dst, src, fill);
    for k in 0..8u64 {
        let src = p.register(LEN, RemoteAccess::READ, vec![]).unwrap();
        let fill = || p.write_region(src, 0, &pattern(20 + k, LEN)).unwrap();
        let got = read(src, &fill).unwrap_or_else(|e| panic!("region {}: {e}", src.0));
        assert!(
            got == pattern(20 + k, LEN),
            "region {}: bytes differ",
            src.0
        );
    }
    match read(RegionId(999), &|| ()) {
        Err(e) => assert!(e.contains("advertised no region 999"), "{e}"),
        Ok(_) => panic!("a region never registered was read"),
    }
}

/// The child: agent `crash-p` publishing generation `KVRAIL_GEN`'s pattern, until killed.
fn child_main() {
    let url = std::env::var("KVRAIL_ETCD").unwrap();
    let ns = std::env::var("KVRAIL_NS").unwrap();
    let gen: u64 = std::env::var("KVRAIL_GEN").unwrap().parse().unwrap();
    let p = Agent::new("crash-p", cfg_p(Some(store(&url, &ns, 3)))).unwrap();
    let src = p.register(LEN, RemoteAccess::READ, vec![]).unwrap();
    p.write_region(src, 0, &pattern(gen, LEN)).unwrap();
    // published again after the registration; say so once the store has it
    let w = EtcdStore::connect(&store(&url, &ns, 3)).unwrap();
    until(
        "own metadata with the region",
        Duration::from_secs(20),
        || {
            w.fetch("crash-p").unwrap().is_some_and(|m| {
                kvrail::agent::metadata::AgentMetadata::decode(&m.bytes)
                    .is_ok_and(|md| md.regions.iter().any(|r| r.id == src.0))
            })
        },
    );
    println!("READY {}", src.0);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A child process, killed when dropped (a failing test leaves none behind).
struct Kid(Child);

impl Kid {
    fn sigkill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        self.sigkill();
    }
}

fn spawn_child(url: &str, ns: &str, gen: u64) -> (Kid, RegionId) {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_crashed_agent_expires_and_its_restart_is_loaded_again",
            "--nocapture",
        ])
        .env("KVRAIL_STORE_CHILD", "1")
        .env("KVRAIL_ETCD", url)
        .env("KVRAIL_NS", ns)
        .env("KVRAIL_GEN", gen.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .map(Kid)
        .unwrap();
    let mut out = std::io::BufReader::new(c.0.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child said nothing"
        );
        if let Some(id) = line.trim().strip_prefix("READY ") {
            return (c, RegionId(id.parse().unwrap()));
        }
    }
}

#[test]
fn a_crashed_agent_expires_and_its_restart_is_loaded_again() {
    if std::env::var_os("KVRAIL_STORE_CHILD").is_some() {
        return child_main();
    }
    let e = etcd::Etcd::start();
    let ns = etcd::namespace("crash");
    let s = store(&e.url(), &ns, 3);
    let d = Agent::new("crash-d", cfg(Some(s.clone()))).unwrap();
    let watcher = EtcdStore::connect(&s).unwrap();
    let (mut child, src) = spawn_child(&e.url(), &ns, 1);
    d.load_by_name("crash-p").unwrap();
    let first = d.peer_incarnation("crash-p").unwrap();
    assert!(read_all(&d, "crash-p", src).unwrap() == pattern(1, LEN));
    // a transfer made on the first incarnation, done, to repost later
    let dst = d.register(LEN, RemoteAccess::NONE, vec![]).unwrap();
    let old = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, LEN as u64)],
            "crash-p",
            vec![Desc::new(src, 0, LEN as u64)],
            None,
        )
        .unwrap();
    d.post(old).unwrap();
    assert_eq!(
        d.wait(old, Duration::from_secs(60)).unwrap(),
        XferStatus::Done
    );
    // SIGKILL: no clean stop, the key goes when the lease (3 s) runs out
    child.sigkill();
    let t = Instant::now();
    until(
        "the crashed agent's key expires",
        Duration::from_secs(30),
        || watcher.fetch("crash-p").unwrap().is_none(),
    );
    println!(
        "a SIGKILLed agent's key disappeared {:?} after the kill (lease TTL 3 s)",
        t.elapsed()
    );
    until("D invalidated the dead P", Duration::from_secs(10), || {
        d.peer_incarnation("crash-p").is_none() && !d.peer_connected("crash-p")
    });
    // restarted under the same name: D loads the new incarnation by itself (the watch)
    let (mut child2, src2) = spawn_child(&e.url(), &ns, 2);
    until(
        "D loaded the new incarnation",
        Duration::from_secs(20),
        || d.peer_incarnation("crash-p").is_some_and(|l| l != first),
    );
    on_verbs_in_the_lab(&d, "crash-p");
    assert!(read_all(&d, "crash-p", src2).unwrap() == pattern(2, LEN));
    // the transfer made on the dead incarnation is refused, never posted into the new one
    match d.post(old) {
        Err(err) => {
            assert_eq!(err.fault(), Fault::Connection);
            assert!(err.to_string().contains("loaded again"), "{err}");
        }
        Ok(()) => panic!("a transfer of the dead incarnation was posted to the new one"),
    }
    child2.sigkill();
}

#[test]
fn an_unreachable_etcd_at_start_is_an_error_naming_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("etcd://127.0.0.1:{port}");
    let t = Instant::now();
    let e = Agent::new("lonely", cfg(Some(store(&url, "x", 5)))).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, AgentError::Store(StoreError::Unreachable { .. })),
        "{e:?}"
    );
    assert_eq!(e.fault(), Fault::Connection);
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    println!("refused after {:?}: {text}", t.elapsed());
}

#[test]
fn etcd_lost_while_running_keeps_connections_and_reports_it() {
    let mut e = etcd::Etcd::start();
    let ns = etcd::namespace("lost");
    let s = store(&e.url(), &ns, 5);
    let p = Agent::new("lost-p", cfg_p(Some(s.clone()))).unwrap();
    let d = Agent::new("lost-d", cfg(Some(s))).unwrap();
    let src = p.register(LEN, RemoteAccess::READ, vec![]).unwrap();
    p.write_region(src, 0, &pattern(5, LEN)).unwrap();
    d.load_by_name("lost-p").unwrap();
    let inc = d.peer_incarnation("lost-p");
    let up = |a: &Agent| {
        a.metrics()
            .value("kvrail_metadata_store_up", &[("agent", a.name())])
    };
    assert_eq!(up(&d), Some(1.0));
    e.kill();
    // the loaded peer keeps working while the store is down, which both agents report
    assert!(read_all(&d, "lost-p", src).unwrap() == pattern(5, LEN));
    until("D reports the store down", Duration::from_secs(30), || {
        d.store_up() == Some(false)
    });
    assert_eq!(up(&d), Some(0.0), "the metric says so too");
    until("P reports the store down", Duration::from_secs(30), || {
        p.store_up() == Some(false)
    });
    match d.load_by_name("lost-p") {
        Err(err @ AgentError::Store(StoreError::Failed { .. })) => {
            assert_eq!(err.fault(), Fault::Connection);
        }
        other => panic!("{other:?}"),
    }
    assert!(read_all(&d, "lost-p", src).unwrap() == pattern(5, LEN));
    // back: reported up again, the same incarnation still loaded (nothing invalidated)
    e.restart();
    until("P reports the store up", Duration::from_secs(60), || {
        p.store_up() == Some(true)
    });
    until("D reports the store up", Duration::from_secs(60), || {
        d.load_by_name("lost-p").is_ok() && d.store_up() == Some(true)
    });
    assert_eq!(d.peer_incarnation("lost-p"), inc);
    assert_eq!(up(&d), Some(1.0));
    assert!(read_all(&d, "lost-p", src).unwrap() == pattern(5, LEN));
}

#[test]
fn names_without_a_store_or_unpublished_are_refused() {
    let a = Agent::new("plain", cfg(None)).unwrap();
    assert_eq!(a.store_up(), None);
    match a.load_by_name("x") {
        Err(e @ AgentError::Store(StoreError::Unavailable(_))) => {
            assert_eq!(e.fault(), Fault::Unavailable);
        }
        other => panic!("{other:?}"),
    }
    let e = etcd::Etcd::start();
    let b = Agent::new("b", cfg(Some(store(&e.url(), &etcd::namespace("none"), 5)))).unwrap();
    match b.load_by_name("nobody") {
        Err(err @ AgentError::Store(StoreError::NotFound(_))) => {
            assert_eq!(err.fault(), Fault::Misuse);
            assert!(err.to_string().contains("\"nobody\""));
        }
        other => panic!("{other:?}"),
    }
    // the JSON keys reach the agent's configuration, each bad one named
    let c = AgentConfig::from_json(&format!(
        r#"{{"metadata_store":"{}","metadata_namespace":"ns-j","metadata_lease_ttl_s":7}}"#,
        e.url()
    ))
    .unwrap();
    let sc = c.metadata_store.unwrap();
    assert_eq!((sc.namespace.as_str(), sc.lease_ttl.as_secs()), ("ns-j", 7));
    let bad = AgentConfig::from_json(r#"{"metadata_lease_ttl_s":7}"#).unwrap_err();
    assert_eq!(bad.key, "metadata_lease_ttl_s");
}
