//! `kvrail-rails probe`: for every pair of a local rail and a peer rail (same IPv4 subnet,
//! or all pairs), connect an RC queue pair, WRITE and READ a small and a large message,
//! check the bytes, and report per pair: connected with numbers, or the step that failed.

use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvrail::rails::{Ipv4If, Verdict};
use kvrail::transport::verbs::{
    Access, Completion, ConnectOptions, Context, Cq, Error, Mr, Pd, Qp, QpOptions, SendWr, Sge,
};
use serde::Serialize;

use super::serve::port_descs;
use super::wire::{Channel, PortDesc, Request, Response, VERSION};
use super::HostArgs;

const SMALL: usize = 64;
const LARGE: usize = 1 << 20;
const LAT_ITERS: usize = 20;
const BW_ITERS: usize = 8;
/// Longest wait for any one completion: a dead link fails the pair in bounded time.
const STEP_LIMIT: Duration = Duration::from_secs(4);

/// Connection parameters for probing: a short ACK timeout (16 ≈ 268 ms) and 3 retries, so a
/// dead path fails in about a second instead of the data path's generous budget.
pub(crate) fn probe_connect_options() -> ConnectOptions {
    ConnectOptions {
        timeout: 16,
        retry_cnt: 3,
        rnr_retry: 3,
        ..ConnectOptions::default()
    }
}

/// The outcome for one pair.
#[derive(Debug, Serialize)]
struct PairResult {
    local: String,
    peer: String,
    connected: bool,
    /// The step that failed: verdict, handshake, RTR, RTS, first completion, transfer, verify.
    step: Option<&'static str>,
    error: Option<String>,
    write_small_lat_us: Option<f64>,
    write_large_mib_s: Option<f64>,
    read_large_mib_s: Option<f64>,
    elapsed_ms: f64,
}

#[derive(Serialize)]
struct Report<'a> {
    peer: &'a str,
    pairs: &'a [PairResult],
}

struct Failed(&'static str, String);

pub(crate) fn run(
    host: &HostArgs,
    peer: &str,
    all_pairs: bool,
    json: bool,
) -> Result<ExitCode, super::fail::Fail> {
    let (_, local) = host.verdicts()?;
    let mut ch = handshake(peer)?;
    ch.send(&Request::Hello { version: VERSION })?;
    let peer_ports = match ch.recv::<Response>()? {
        Some(Response::Hello { version, ports }) if version == VERSION => ports,
        Some(Response::Error { message }) => return Err(format!("peer {peer}: {message}").into()),
        other => return Err(format!("peer {peer}: unexpected hello reply {other:?}").into()),
    };
    let locals = port_descs(&local);
    let mut results = Vec::new();
    for (l, ld) in local.iter().zip(&locals) {
        for p in &peer_ports {
            if all_pairs || paired(ld, p) {
                results.push(probe_pair(&mut ch, l, p));
            }
        }
    }
    if json {
        let r = Report {
            peer,
            pairs: &results,
        };
        outln!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?
        );
    } else {
        print_table(peer, &results);
    }
    Ok(super::fail::usable(
        !results.is_empty() && results.iter().all(|r| r.connected),
    ))
}

fn handshake(peer: &str) -> Result<Channel, String> {
    let hint =
        "is `kvrail-rails serve` running there, and is that address reachable from this host?";
    let addrs: Vec<_> = peer
        .to_socket_addrs()
        .map_err(|e| format!("handshake: cannot resolve {peer}: {e}"))?
        .collect();
    let mut last = String::from("no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(30)))
                    .map_err(|e| e.to_string())?;
                s.set_nodelay(true).ok();
                return Channel::new(s).map_err(|e| e.to_string());
            }
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(format!("handshake with {peer} failed ({last}); {hint}"))
}

/// Rails pair up when they share an IPv4 subnet (rail-optimized fabrics), or when neither
/// has IPv4 (InfiniBand).
fn paired(l: &PortDesc, p: &PortDesc) -> bool {
    let parse = |v: &[String]| {
        v.iter()
            .filter_map(|s| s.parse::<Ipv4If>().ok())
            .collect::<Vec<_>>()
    };
    let (la, pa) = (parse(&l.ipv4), parse(&p.ipv4));
    (la.is_empty() && pa.is_empty()) || la.iter().any(|a| pa.iter().any(|b| a.same_subnet(b.addr)))
}

fn probe_pair(ch: &mut Channel, l: &Verdict, p: &PortDesc) -> PairResult {
    let t0 = Instant::now();
    let mut r = PairResult {
        local: l.port.name(),
        peer: p.name.clone(),
        connected: false,
        step: None,
        error: None,
        write_small_lat_us: None,
        write_large_mib_s: None,
        read_large_mib_s: None,
        elapsed_ms: 0.0,
    };
    if let Err(Failed(step, e)) = exercise(ch, l, p, &mut r) {
        r.step = Some(step);
        r.error = Some(e);
    } else {
        r.connected = true;
    }
    r.elapsed_ms = t0.elapsed().as_secs_f64() * 1e3;
    r
}

struct Local {
    cq: Cq,
    qp: Qp,
    src: Mr,
    back: Mr,
    _pd: Pd,
}

fn exercise(ch: &mut Channel, l: &Verdict, p: &PortDesc, r: &mut PairResult) -> Result<(), Failed> {
    if !l.usable() {
        return Err(Failed(
            "verdict",
            format!("local {}: {}", l.port.name(), l.summary()),
        ));
    }
    if !p.usable {
        return Err(Failed("verdict", format!("peer {}: {}", p.name, p.verdict)));
    }
    let hs = |e: String| Failed("handshake", e);
    ch.send(&Request::Open {
        name: p.name.clone(),
        size: 2 * LARGE,
    })
    .map_err(hs)?;
    let (endpoint, remote) = match ch.recv::<Response>().map_err(hs)? {
        Some(Response::Opened { endpoint, region }) => (endpoint, region),
        Some(Response::Error { message }) => {
            return Err(Failed("handshake", format!("peer: {message}")))
        }
        other => return Err(Failed("handshake", format!("unexpected reply {other:?}"))),
    };
    let loc = open_local(l).map_err(|e| Failed("handshake", format!("local: {e}")))?;
    loc.qp
        .connect(&endpoint, &probe_connect_options())
        .map_err(|e| match &e {
            Error::ModifyQp { to: "RTS", .. } => Failed("RTS", e.to_string()),
            _ => Failed("RTR", e.to_string()),
        })?;
    ch.send(&Request::Connect {
        endpoint: loc.qp.endpoint(),
    })
    .map_err(hs)?;
    match ch.recv::<Response>().map_err(hs)? {
        Some(Response::Connected) => {}
        Some(Response::Error { message }) => return Err(Failed("RTR", format!("peer: {message}"))),
        other => return Err(Failed("handshake", format!("unexpected reply {other:?}"))),
    }
    let pat = pattern(LARGE);
    loc.src
        .write(0, &pat)
        .map_err(|e| Failed("transfer", e.to_string()))?;
    // first completion: a small WRITE
    post_wait(
        &loc,
        &[SendWr::write(0, Sge::new(&loc.src, 0, SMALL), remote, 0)],
        1,
    )
    .map_err(|e| Failed("first completion", e))?;
    let tf = |e: String| Failed("transfer", e);
    let t = Instant::now();
    for i in 0..LAT_ITERS {
        post_wait(
            &loc,
            &[SendWr::write(
                i as u64,
                Sge::new(&loc.src, 0, SMALL),
                remote,
                0,
            )],
            1,
        )
        .map_err(tf)?;
    }
    r.write_small_lat_us = Some(t.elapsed().as_secs_f64() * 1e6 / LAT_ITERS as f64);
    let big: Vec<SendWr<'_>> = (0..BW_ITERS)
        .map(|i| SendWr::write(i as u64, Sge::new(&loc.src, 0, LARGE), remote, LARGE as u64))
        .collect();
    let t = Instant::now();
    for chunk in big.chunks(4) {
        post_wait(&loc, chunk, chunk.len()).map_err(tf)?;
    }
    r.write_large_mib_s = Some(mib_s(BW_ITERS * LARGE, t.elapsed()));
    // READ back what was written, small and large, and compare every byte
    post_wait(
        &loc,
        &[SendWr::read(0, Sge::new(&loc.back, 0, SMALL), remote, 0)],
        1,
    )
    .map_err(tf)?;
    check(&loc.back, &pat[..SMALL], "small WRITE + READ")?;
    let t = Instant::now();
    post_wait(
        &loc,
        &[SendWr::read(
            1,
            Sge::new(&loc.back, 0, LARGE),
            remote,
            LARGE as u64,
        )],
        1,
    )
    .map_err(tf)?;
    r.read_large_mib_s = Some(mib_s(LARGE, t.elapsed()));
    check(&loc.back, &pat, "1 MiB WRITE + READ")?;
    Ok(())
}

fn open_local(l: &Verdict) -> Result<Local, Error> {
    let gid = l.gid.as_ref().expect("usable ports have a GID");
    let ctx = Context::open(&l.port.device)?;
    let pd = Pd::new(&ctx)?;
    let src = Mr::alloc(&pd, LARGE, Access::NONE)?;
    let back = Mr::alloc(&pd, LARGE, Access::LOCAL_WRITE)?;
    let cq = Cq::new(&ctx, 64)?;
    let mut o = QpOptions::new(l.port.port, gid.index);
    o.max_send_wr = 16;
    o.max_recv_wr = 16;
    let qp = Qp::new(&pd, &cq, &cq, &o)?;
    Ok(Local {
        cq,
        qp,
        src,
        back,
        _pd: pd,
    })
}

/// Post and busy-poll for `n` completions, each within STEP_LIMIT.
fn post_wait(loc: &Local, wrs: &[SendWr<'_>], n: usize) -> Result<(), String> {
    loc.qp.post_send(wrs).map_err(|e| e.to_string())?;
    let mut got: Vec<Completion> = Vec::new();
    let mut deadline = Instant::now() + STEP_LIMIT;
    while got.len() < n {
        let before = got.len();
        loc.cq.poll(&mut got).map_err(|e| e.to_string())?;
        if let Some(Err(e)) = got.iter().map(|c| &c.status).find(|s| s.is_err()) {
            return Err(e.to_string());
        }
        if got.len() > before {
            deadline = Instant::now() + STEP_LIMIT;
        } else if Instant::now() > deadline {
            return Err(format!(
                "no completion within {} s (link down or peer unreachable?)",
                STEP_LIMIT.as_secs()
            ));
        }
    }
    Ok(())
}

fn check(mr: &Mr, want: &[u8], what: &str) -> Result<(), Failed> {
    let mut got = vec![0u8; want.len()];
    mr.read(0, &mut got)
        .map_err(|e| Failed("verify", e.to_string()))?;
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(Failed(
            "verify",
            format!(
                "{what}: byte {i} differs ({:#04x} != {:#04x})",
                got[i], want[i]
            ),
        )),
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8) ^ i as u8)
        .collect()
}

fn mib_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / (1u64 << 20) as f64
}

fn print_table(peer: &str, rs: &[PairResult]) {
    outln!("# probe of {peer}: {} pair(s)", rs.len());
    outln!(
        "{:<12} {:<12} {:<10} {:<17} {:>13} {:>15} {:>14} {:>9}  DETAIL",
        "LOCAL",
        "PEER",
        "RESULT",
        "STEP",
        "WRITE64 us",
        "WRITE1M MiB/s",
        "READ1M MiB/s",
        "TIME ms"
    );
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    for r in rs {
        outln!(
            "{:<12} {:<12} {:<10} {:<17} {:>13} {:>15} {:>14} {:>9.0}  {}",
            r.local,
            r.peer,
            if r.connected { "connected" } else { "FAILED" },
            r.step.unwrap_or("-"),
            f(r.write_small_lat_us),
            f(r.write_large_mib_s),
            f(r.read_large_mib_s),
            r.elapsed_ms,
            r.error.as_deref().unwrap_or("bytes checked")
        );
    }
    if rs.is_empty() {
        outln!("# no pairs: no local and peer rails share an IPv4 subnet (use --all-pairs to try every pair)");
    }
}
