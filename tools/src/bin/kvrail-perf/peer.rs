//! The serving side (`--server`, and the second agent of `--loopback`), and the small
//! control protocol both sides speak in notifications. Control messages start with
//! `kvrail-perf:`; anything else is echoed back (the latency test).
//!
//! - `kvrail-perf:hello <side channel> <len> <seed> [host|npu]`: load the client, register
//!   `len` bytes of that memory readable and writable, fill them with `pattern(seed)`;
//!   answer `kvrail-perf:ready <id>`.
//! - `kvrail-perf:check <len> <seed>`: compare the first `len` bytes with `pattern(seed)`;
//!   answer `kvrail-perf:checked <wrong bytes>`.
//! - `kvrail-perf:reverse <write|read> <size> <depth> <descs> <slots> <iters> <secs>
//!   <client region> <half>` (`-b`): run the same operation toward the client at once, from
//!   and into the upper halves (offset `half`) of both regions; answer
//!   `kvrail-perf:reversing`, and when it ends `kvrail-perf:reversed <iterations> <seconds>
//!   <peak B/s> <average B/s>` (or an error).
//! - `kvrail-perf:bye`: done; answer `kvrail-perf:done` and stop.

use std::time::{Duration, Instant};

use kvrail::agent::{Agent, RegionId, RemoteAccess};

/// Prefix of control messages.
pub(crate) const CTL: &str = "kvrail-perf:";

/// The byte at offset `i` of a buffer filled with `seed`.
pub(crate) fn pattern_byte(seed: u64, i: u64) -> u8 {
    let x = (i ^ seed.rotate_left(23)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8 ^ i as u8
}

/// `len` bytes of `seed`'s pattern.
pub(crate) fn pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len).map(|i| pattern_byte(seed, i)).collect()
}

/// The most memory a client may ask the server to register (a larger `hello` is refused).
pub(crate) const MAX_SERVE_BYTES: u64 = 1 << 30;

/// Serve one client until it says bye (or `idle` passes without a word from it). Words
/// from anyone else are logged and dropped; a control message that cannot be served is
/// answered `kvrail-perf:error <why>` and the server goes on.
pub(crate) fn serve(a: &Agent, idle: Duration) -> Result<(), String> {
    let mut st = Served::default();
    // since when the client has been quiet: from the first wait that got nothing (the clock
    // is not read for each message: a reading is ~120 ns in the lab, a latency run's echo
    // ~30 us)
    let mut quiet_since = Some(Instant::now());
    loop {
        // sleeps until a message comes (with --spin-us it polls the completion queues a
        // while first): no CPU taken from a bandwidth run, no wake-up hand-off in a
        // latency run that polls
        let msgs = a.wait_notifs(Duration::from_millis(100));
        if msgs.is_empty() {
            if quiet_since.get_or_insert_with(Instant::now).elapsed() > idle {
                return Err(format!("no word from the client for {} s", idle.as_secs()));
            }
            continue;
        }
        quiet_since = None;
        for (from, m) in msgs {
            let ctl = std::str::from_utf8(&m)
                .ok()
                .and_then(|s| s.strip_prefix(CTL))
                .map(str::to_owned);
            let is_hello = ctl.as_deref().is_some_and(|c| c.starts_with("hello "));
            if !is_hello && st.client.as_deref() != Some(from.as_str()) {
                tracing::warn!(from = %from, "kvrail-perf server: a message from an agent that is not the client; dropped");
                continue;
            }
            let Some(ctl) = ctl else {
                // latency: echo
                if let Err(e) = a.send_notif(&from, m) {
                    tracing::warn!(to = %from, "kvrail-perf server: echo failed: {e}");
                }
                continue;
            };
            let reply = match st.control(a, &ctl) {
                Ok(Some(reply)) => reply,
                Ok(None) => return Ok(()), // bye (answered)
                Err(why) => {
                    tracing::warn!(from = %from, "kvrail-perf server: {why}");
                    format!("error {why}")
                }
            };
            if let Err(e) = a.send_notif(&from, format!("{CTL}{reply}").into_bytes()) {
                tracing::warn!(to = %from, "kvrail-perf server: answer failed: {e}");
            }
        }
    }
}

/// What the server holds for its client.
#[derive(Default)]
struct Served {
    client: Option<String>,
    region: Option<RegionId>,
}

impl Served {
    /// Serve control message `ctl`: the answer, or None after `bye`.
    fn control(&mut self, a: &Agent, ctl: &str) -> Result<Option<String>, String> {
        let w: Vec<&str> = ctl.split_whitespace().collect();
        let num = |what: &str, v: &str| -> Result<u64, String> {
            v.parse().map_err(|_| format!("bad {what} {v:?}"))
        };
        Ok(Some(match w.as_slice() {
            ["hello", addr, len, seed, rest @ ..] => {
                let mem = match rest {
                    [] | ["host"] => crate::args::Mem::Host,
                    ["npu"] => crate::args::Mem::Npu,
                    other => return Err(format!("unknown memory {other:?}")),
                };
                let addr = addr.parse().map_err(|_| format!("bad address {addr:?}"))?;
                let len = num("length", len)?;
                let seed = num("seed", seed)?;
                // loaded first, so that even a refusal can be answered
                let name = a.load_remote(addr).map_err(|e| e.to_string())?;
                if len == 0 || len > MAX_SERVE_BYTES {
                    return Err(format!(
                        "cannot register {len} bytes (1 byte to {} MiB)",
                        MAX_SERVE_BYTES >> 20
                    ));
                }
                if let Some(old) = self.region.take() {
                    a.deregister(old).map_err(|e| e.to_string())?;
                }
                let r = crate::mem::register(a, mem, len, RemoteAccess::READ_WRITE, 1)?;
                a.write_region(r, 0, &pattern(seed, len))
                    .map_err(|e| e.to_string())?;
                self.region = Some(r);
                self.client = Some(name);
                format!("ready {}", r.0)
            }
            ["check", len, seed] => {
                let r = self.region.ok_or("check before hello")?;
                let (len, seed) = (num("length", len)?, num("seed", seed)?);
                if len > a.region_len(r).map_err(|e| e.to_string())? {
                    return Err(format!("check of {len} bytes: past the region"));
                }
                let mut got = vec![0u8; len as usize];
                a.read_region(r, 0, &mut got).map_err(|e| e.to_string())?;
                let wrong = got
                    .iter()
                    .enumerate()
                    .filter(|(i, b)| **b != pattern_byte(seed, *i as u64))
                    .count();
                format!("checked {wrong}")
            }
            ["reverse", op, size, depth, descs, slots, iters, secs, region, half] => {
                let local = self.region.ok_or("reverse before hello")?;
                let client = self.client.clone().ok_or("reverse before hello")?;
                let op = match *op {
                    "write" => kvrail::agent::XferOp::Write,
                    "read" => kvrail::agent::XferOp::Read,
                    o => return Err(format!("reverse: unknown operation {o:?}")),
                };
                let size = num("size", size)?;
                let depth = num("depth", depth)? as usize;
                let descs = num("descs", descs)?;
                let slots = num("slots", slots)?;
                let half = num("half", half)?;
                let stop = match (num("iterations", iters)?, secs.parse::<f64>()) {
                    (0, Ok(s)) if s > 0.0 => crate::bench::Stop::For(Duration::from_secs_f64(s)),
                    (n, _) if n > 0 => crate::bench::Stop::Iters(n),
                    _ => return Err("reverse: neither iterations nor seconds".into()),
                };
                let remote = RegionId(num("region", region)? as u32);
                if size == 0 || depth == 0 || descs == 0 || slots == 0 {
                    return Err("reverse: zero size, depth, descriptors or slots".into());
                }
                let have = a.region_len(local).map_err(|e| e.to_string())?;
                let end = half.checked_add(slots.saturating_mul(size));
                if end.is_none_or(|e| e > have) {
                    return Err("reverse: slots past the region".into());
                }
                let agent = a.clone();
                std::thread::spawn(move || {
                    let spec = crate::bench::BwSpec {
                        agent: &agent,
                        peer: &client,
                        op,
                        local,
                        remote,
                        size,
                        descs,
                        depth,
                        slots,
                        stop,
                        base: (half, half),
                    };
                    let answer = match crate::bench::bandwidth(&spec) {
                        Ok(b) => format!(
                            "reversed {} {} {} {}",
                            b.iterations, b.seconds, b.peak_bps, b.avg_bps
                        ),
                        Err(e) => format!("error reverse direction: {e}"),
                    };
                    let _ = agent.send_notif(&client, format!("{CTL}{answer}").into_bytes());
                });
                "reversing".to_owned()
            }
            ["bye"] => {
                // answer, so the client does not close its agent (and connection)
                // before this was read
                if let Some(to) = self.client.as_deref() {
                    let _ = a.send_notif(to, format!("{CTL}done").into_bytes());
                }
                return Ok(None);
            }
            other => return Err(format!("unknown control message {other:?}")),
        }))
    }
}

/// Wait for the control answer starting with `what` from `server`: an error answer, a
/// connection that went down, or `limit` end the wait.
pub(crate) fn expect(
    a: &Agent,
    server: &str,
    what: &str,
    limit: Duration,
) -> Result<String, String> {
    let t = Instant::now();
    loop {
        let mut found = None;
        for (_, m) in a.get_new_notifs() {
            let s = String::from_utf8_lossy(&m).into_owned();
            let answer = s.strip_prefix(CTL);
            if let Some(why) = answer.and_then(|r| r.strip_prefix("error ")) {
                return Err(format!("the server refused: {why}"));
            }
            match answer.and_then(|r| r.strip_prefix(what)) {
                Some(rest) if found.is_none() => found = Some(rest.trim().to_owned()),
                _ => return Err(format!("unexpected message from the server: {s:?}")),
            }
        }
        if let Some(f) = found {
            return Ok(f);
        }
        if !a.peer_connected(server) {
            return Err(format!(
                "the connection to the server closed while waiting for {what:?}"
            ));
        }
        if t.elapsed() > limit {
            return Err(format!(
                "the server did not answer {what:?} within {} s",
                limit.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}
