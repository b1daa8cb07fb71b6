//! Shared pieces of the lab suites: the topology the lab exports, byte patterns, the peer
//! ("host B") process and its JSON-lines control protocol over a TCP side channel.
#![allow(dead_code, unreachable_pub)]

pub mod cache;
pub mod peer;
pub mod runner;

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

/// The lab's topology, from the environment `tools/lab/run.sh` sets inside the VM.
#[derive(Debug, Clone)]
pub struct Topology {
    pub rails: usize,
    pub gid_index: u32,
    pub a_devs: Vec<String>,
    pub b_devs: Vec<String>,
    pub a_ips: Vec<Ipv4Addr>,
    pub b_ips: Vec<Ipv4Addr>,
    pub a_netdevs: Vec<String>,
}

impl Topology {
    /// None outside the lab.
    pub fn from_env() -> Option<Self> {
        std::env::var_os("LAB_GUEST")?;
        let list = |k: &str| -> Vec<String> {
            std::env::var(k)
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        };
        let ips = |k: &str| {
            list(k)
                .iter()
                .map(|s| s.parse().expect("lab IPv4"))
                .collect()
        };
        Some(Self {
            rails: std::env::var("LAB_RAILS").ok()?.parse().ok()?,
            gid_index: std::env::var("LAB_GID_INDEX").ok()?.parse().ok()?,
            a_devs: list("LAB_A_DEVS"),
            b_devs: list("LAB_B_DEVS"),
            a_ips: ips("LAB_A_IPS"),
            b_ips: ips("LAB_B_IPS"),
            a_netdevs: list("LAB_A_NETDEVS"),
        })
    }
}

/// The pattern byte at absolute offset `i` of a segment written with `seed` (position
/// dependent, so a misplaced or shifted byte is caught, not only a wrong one).
#[inline]
pub fn pattern_byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ (i as u8)
}

/// `len` pattern bytes for offsets `offset..offset+len` (relative to the segment start 0).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern_byte(seed, i)).collect()
}

/// A segment of a region: `len` bytes at `offset`, holding `pattern(seed)` (or zeros when
/// `seed` is None).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    pub offset: usize,
    pub len: usize,
    pub seed: Option<u64>,
}

/// Check a whole region against the segments written into it; every other byte must be 0.
/// Returns a description of the first mismatch and the count of wrong bytes.
pub fn verify_region(bytes: &[u8], segments: &[Segment]) -> Result<(), String> {
    let mut expect = vec![0u8; bytes.len()];
    for s in segments {
        if let Some(seed) = s.seed {
            let end = s
                .offset
                .checked_add(s.len)
                .filter(|&e| e <= bytes.len())
                .ok_or_else(|| format!("segment {s:?} outside the {}-byte region", bytes.len()))?;
            expect[s.offset..end].copy_from_slice(&pattern(seed, s.len));
        }
    }
    if bytes == expect.as_slice() {
        return Ok(());
    }
    let bad = bytes.iter().zip(&expect).filter(|(a, b)| a != b).count();
    let first = bytes
        .iter()
        .zip(&expect)
        .position(|(a, b)| a != b)
        .unwrap_or(0);
    Err(format!(
        "{bad} wrong byte(s) in {} bytes; first at offset {first}: got {:#04x}, want {:#04x}",
        bytes.len(),
        bytes[first],
        expect[first]
    ))
}

/// Lay out segments of the given sizes one after another with a 64-byte gap (so a write
/// past a segment's end lands in a zero gap and is caught). Returns (segments, region size).
pub fn layout(sizes: &[usize], first_seed: u64) -> (Vec<Segment>, usize) {
    let mut off = 7; // deliberately unaligned start
    let mut segs = Vec::new();
    for (k, &len) in sizes.iter().enumerate() {
        segs.push(Segment {
            offset: off,
            len,
            seed: Some(first_seed + k as u64),
        });
        off += len + 64;
    }
    (segs, off)
}

/// An agent's configuration for a test on either backend: loopback TCP outside the lab; in
/// the lab, verbs on host A's (`host_a`) or host B's devices.
pub fn agent_config(host_a: bool) -> kvrail::agent::AgentConfig {
    let mut c = kvrail::agent::AgentConfig {
        listen: "127.0.0.1:0".parse().expect("an address"),
        ..kvrail::agent::AgentConfig::default()
    };
    if let Some(t) = Topology::from_env() {
        c.backend = kvrail::agent::BackendChoice::Verbs;
        c.devices = if host_a { t.a_devs } else { t.b_devs };
    }
    c
}

/// `ip link set NETDEV STATE` (take a rail down or up).
pub fn ip_link(netdev: &str, state: &str) -> Result<(), String> {
    let o = Command::new("ip")
        .args(["link", "set", netdev, state])
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip link set {netdev} {state}: {}",
            String::from_utf8_lossy(&o.stderr)
        ))
    }
}

/// An `ip -batch -` started ahead of time, so that taking a link down mid-transfer happens
/// when the test says and not a process start later (forking and loading `ip` under the
/// lab's CPU emulation, with rxe busy, took over a second: a fast transfer ended first).
pub struct LinkSwitch {
    child: std::process::Child,
    netdev: String,
}

impl LinkSwitch {
    /// Start the `ip` process for `netdev`.
    pub fn new(netdev: &str) -> Result<Self, String> {
        let child = Command::new("ip")
            .args(["-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("ip -batch -: {e}"))?;
        Ok(Self {
            child,
            netdev: netdev.to_owned(),
        })
    }

    /// `link set NETDEV STATE`, then wait (up to 10 s) until the netdev's operstate says so.
    pub fn set(&mut self, state: &str) -> Result<(), String> {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().ok_or("ip's stdin is closed")?;
        writeln!(stdin, "link set {} {state}", self.netdev)
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("ip -batch -: {e}"))?;
        let path = format!("/sys/class/net/{}/flags", self.netdev);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            // IFF_UP is bit 0 of the flags
            let flags = std::fs::read_to_string(&path).unwrap_or_default();
            let up = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16)
                .is_ok_and(|f| f & 1 == 1);
            if up == (state == "up") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Err(format!(
            "{} is not {state} 10 s after `ip link set`",
            self.netdev
        ))
    }
}

impl Drop for LinkSwitch {
    fn drop(&mut self) {
        drop(self.child.stdin.take()); // ip ends at the end of its input
        let _ = self.child.wait();
    }
}

/// Wait (up to 30 s) until port 1 of `dev` reports `want` (e.g. `ACTIVE`).
pub fn wait_port(dev: &str, want: &str) -> Result<(), String> {
    let path = format!("/sys/class/infiniband/{dev}/ports/1/state");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        if std::fs::read_to_string(&path)
            .unwrap_or_default()
            .contains(want)
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("{dev} never became {want}"))
}

/// Poll transfer `x` of `a` until it is no longer in progress (it must end within 120 s).
pub fn wait_xfer(a: &kvrail::agent::Agent, x: kvrail::agent::XferId) -> kvrail::agent::XferStatus {
    let t = Instant::now();
    loop {
        let s = a.status(x).expect("a transfer");
        if s != kvrail::agent::XferStatus::InProgress {
            return s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "transfer {x:?} hung"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Post a one-descriptor `op` from `a` to `peer` and wait for its end, retrying the post
/// (for up to 60 s) while it is refused for want of a queue pair: a refused key (a revoked
/// grant) kills the pair it ran on, and the agent rebuilds it.
#[allow(dead_code)] // each suite uses a part of this module
pub fn xfer_retrying(
    a: &kvrail::agent::Agent,
    peer: &str,
    op: kvrail::agent::XferOp,
    local: kvrail::agent::Desc,
    remote: kvrail::agent::Desc,
) -> kvrail::agent::XferStatus {
    let t = Instant::now();
    loop {
        let x = a
            .create_xfer(op, vec![local], peer, vec![remote], None)
            .expect("a valid transfer");
        match a.post(x) {
            Ok(()) => {
                let s = wait_xfer(a, x);
                a.release(x).expect("release");
                return s;
            }
            Err(e) => {
                a.release(x).expect("release");
                assert!(t.elapsed() < Duration::from_secs(60), "never posted: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// `s` is a failure as `GrantRevoked` (a peer's fault).
#[allow(dead_code)] // each suite uses a part of this module
pub fn assert_revoked(s: &kvrail::agent::XferStatus) {
    use kvrail::agent::{Fault, XferError, XferStatus};
    match s {
        XferStatus::Error(e @ XferError::GrantRevoked { .. }) => assert_eq!(e.fault(), Fault::Peer),
        other => panic!("expected GrantRevoked, got {other:?}"),
    }
}

/// A KV layout for the connector suites: `layers` layers named `model.layers.<i>.attn`,
/// K and V planes, 16 tokens a block, HND, one physical block a logical one.
pub fn kv_layout(
    layers: usize,
    num_blocks: u64,
    block_bytes: u64,
    kv_heads: u64,
) -> kvrail::connector::KvLayout {
    kvrail::connector::KvLayout {
        layers: (0..layers)
            .map(|i| format!("model.layers.{i}.attn"))
            .collect(),
        num_blocks,
        block_bytes,
        planes: 2,
        block_size: 16,
        kv_heads,
        sliding_windows: Default::default(),
        physical_per_logical: 1,
        block_stride: 0,
        inner: kvrail::connector::BlockOrder::Hnd,
    }
}
