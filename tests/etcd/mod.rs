//! A real etcd for the store suites: Debian's `etcd-server` (`/usr/bin/etcd`, or `ETCD_BIN`),
//! started on free loopback ports with a temporary data directory, stopped (and the
//! directory removed) on drop. `tools/lab/setup.sh` installs it; a missing binary fails the
//! test saying so (never a silent skip).
#![allow(dead_code, unreachable_pub)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd server.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client: SocketAddr,
    peer: SocketAddr,
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn bin() -> String {
    std::env::var("ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into())
}

impl Etcd {
    /// Start one and wait until it answers.
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvrail-etcd-{}-{:x}",
            std::process::id(),
            rand_u64()
        ));
        let mut e = Self {
            child: None,
            dir,
            client: free_port(),
            peer: free_port(),
        };
        e.run();
        e
    }

    fn run(&mut self) {
        assert!(
            std::path::Path::new(&bin()).exists(),
            "no etcd at {} (apt-get install etcd-server, or set ETCD_BIN)",
            bin()
        );
        let (c, p) = (self.client, self.peer);
        // etcd runs under a watchdog shell: it goes when this test process does (a shared
        // etcd in a static is never dropped; the shell then removes its data directory, ~120 MB
        // each), and when told (SIGTERM to the shell: the data stays for a restart)
        let watch = format!(
            "\"$0\" \"$@\" >/dev/null 2>&1 & e=$!; trap 'kill -9 $e 2>/dev/null; wait $e; exit 0' TERM; \
             while kill -0 {} 2>/dev/null && kill -0 $e 2>/dev/null; do sleep 0.2; done; \
             kill -9 $e 2>/dev/null; wait $e; kill -0 {} 2>/dev/null || rm -rf '{}'",
            std::process::id(),
            std::process::id(),
            self.dir.display()
        );
        let child = Command::new("bash")
            .arg("-c")
            .arg(watch)
            .arg(bin())
            .args([
                "--name",
                "kvrail-test",
                "--data-dir",
                self.dir.to_str().unwrap(),
                "--listen-client-urls",
                &format!("http://{c}"),
                "--advertise-client-urls",
                &format!("http://{c}"),
                "--listen-peer-urls",
                &format!("http://{p}"),
                "--initial-advertise-peer-urls",
                &format!("http://{p}"),
                "--initial-cluster",
                &format!("kvrail-test=http://{p}"),
                "--log-level",
                "error",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin()));
        self.child = Some(child);
        let t = Instant::now();
        // up when a v3 read over its JSON gateway answers (a listening port is not enough)
        while !self.answers() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "etcd at {c} did not come up within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn answers(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = TcpStream::connect_timeout(&self.client, Duration::from_millis(200)) else {
            return false;
        };
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        let body = r#"{"key":"AA=="}"#;
        let req = format!(
            "POST /v3/kv/range HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.client,
            body.len()
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.starts_with("HTTP/1.1 200")
    }

    /// `etcd://HOST:PORT` of its client endpoint.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.client)
    }

    /// Kill it (SIGKILL to etcd), keeping its data.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }

    /// Start it again on the same ports and data (after [`Etcd::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}

/// A namespace of its own for one test (tests share one etcd per process at most).
pub fn namespace(test: &str) -> String {
    format!("t-{test}-{:x}", rand_u64() & 0xffff_ffff)
}

/// Metadata-store mode of the connector suites (`KVRAIL_CONNECTOR_ETCD=1`).
pub fn mode() -> bool {
    std::env::var_os("KVRAIL_CONNECTOR_ETCD").is_some()
}

/// In store mode, `json` (a `kv_transfer_config`) with the store's keys in
/// `kv_connector_extra_config`: the suite's etcd (started once per test process), a
/// namespace of the running test's own, a 5 s lease. Otherwise `json` as it is.
pub fn with_store(json: &str) -> String {
    static ETCD: std::sync::OnceLock<Etcd> = std::sync::OnceLock::new();
    if !mode() {
        return json.to_owned();
    }
    let url = ETCD.get_or_init(Etcd::start).url();
    let ns: String = (std::thread::current().name().unwrap_or("main").chars())
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
    let extra = v
        .as_object_mut()
        .unwrap()
        .entry("kv_connector_extra_config")
        .or_insert_with(|| serde_json::json!({}));
    let extra = extra.as_object_mut().unwrap();
    extra.insert("metadata_store".into(), url.into());
    extra.insert("metadata_namespace".into(), ns.into());
    extra.insert("metadata_lease_ttl_s".into(), 5.into());
    v.to_string()
}

/// In store mode, P's transfer parameters name its engine (and TP size) only: no host, no
/// ports; D finds every rank by name through the store.
pub fn engine_only(p: &mut kvrail::connector::KvTransferParams) {
    if mode() {
        p.remote_host.clear();
        p.remote_port = 0;
        p.remote_ports.clear();
    }
}
