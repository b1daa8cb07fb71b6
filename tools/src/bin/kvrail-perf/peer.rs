//! The serving side (`--server`, and the second agent of `--loopback`), and the small
//! control protocol both sides speak in notifications. Control messages start with
//! `kvrail-perf:`; anything else is echoed back (the latency test).
//!
//! - `kvrail-perf:hello <side channel> <len> <seed> [host|npu]`: load the client, register
//!   `len` bytes of that memory readable and writable, fill them with `pattern(seed)`;
//!   answer `kvrail-perf:ready <id>`.
//! - `kvrail-perf:check <len> <seed>`: compare the first `len` bytes with `pattern(seed)`;
//!   answer `kvrail-perf:checked <wrong bytes>`.
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

/// Serve one client until it says bye (or `idle` passes without a word from it).
pub(crate) fn serve(a: &Agent, idle: Duration) -> Result<(), String> {
    let mut client: Option<String> = None;
    let mut region: Option<RegionId> = None;
    let mut last = Instant::now();
    loop {
        let msgs = a.get_new_notifs();
        if msgs.is_empty() {
            if last.elapsed() > idle {
                return Err(format!("no word from the client for {} s", idle.as_secs()));
            }
            // spin right after a message (latency runs), sleep when quiet: bandwidth runs
            // must not lose a CPU to the server
            let quiet = last.elapsed();
            if quiet > Duration::from_millis(100) {
                std::thread::sleep(Duration::from_millis(5));
            } else if quiet > Duration::from_millis(2) {
                std::thread::sleep(Duration::from_micros(200));
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        last = Instant::now();
        for (from, m) in msgs {
            let Some(ctl) = std::str::from_utf8(&m)
                .ok()
                .and_then(|s| s.strip_prefix(CTL))
            else {
                // latency: echo
                a.send_notif(&from, m).map_err(|e| e.to_string())?;
                continue;
            };
            let w: Vec<&str> = ctl.split_whitespace().collect();
            let reply = match w.as_slice() {
                ["hello", addr, len, seed, rest @ ..] => {
                    let mem = match rest {
                        [] | ["host"] => crate::args::Mem::Host,
                        ["npu"] => crate::args::Mem::Npu,
                        other => return Err(format!("unknown memory {other:?}")),
                    };
                    let addr = addr.parse().map_err(|_| format!("bad address {addr}"))?;
                    let len: u64 = len.parse().map_err(|_| format!("bad length {len}"))?;
                    let seed: u64 = seed.parse().map_err(|_| format!("bad seed {seed}"))?;
                    let name = a.load_remote(addr).map_err(|e| e.to_string())?;
                    if let Some(old) = region.take() {
                        a.deregister(old).map_err(|e| e.to_string())?;
                    }
                    let r = crate::mem::register(a, mem, len, RemoteAccess::READ_WRITE, 1)?;
                    a.write_region(r, 0, &pattern(seed, len))
                        .map_err(|e| e.to_string())?;
                    region = Some(r);
                    client = Some(name);
                    format!("ready {}", r.0)
                }
                ["check", len, seed] => {
                    let r = region.ok_or("check before hello")?;
                    let len: u64 = len.parse().map_err(|_| format!("bad length {len}"))?;
                    let seed: u64 = seed.parse().map_err(|_| format!("bad seed {seed}"))?;
                    let mut got = vec![0u8; len as usize];
                    a.read_region(r, 0, &mut got).map_err(|e| e.to_string())?;
                    let wrong = got
                        .iter()
                        .enumerate()
                        .filter(|(i, b)| **b != pattern_byte(seed, *i as u64))
                        .count();
                    format!("checked {wrong}")
                }
                ["bye"] => {
                    // answer, so the client does not close its agent (and connection)
                    // before this was read
                    if let Some(to) = client.as_deref() {
                        let _ = a.send_notif(to, format!("{CTL}done").into_bytes());
                    }
                    return Ok(());
                }
                other => return Err(format!("unknown control message {other:?}")),
            };
            let to = client.as_deref().ok_or("no client")?;
            a.send_notif(to, format!("{CTL}{reply}").into_bytes())
                .map_err(|e| e.to_string())?;
        }
    }
}

/// Wait for the control answer starting with `what` from the server.
pub(crate) fn expect(a: &Agent, what: &str, limit: Duration) -> Result<String, String> {
    let t = Instant::now();
    loop {
        let mut found = None;
        for (_, m) in a.get_new_notifs() {
            let s = String::from_utf8_lossy(&m).into_owned();
            match s.strip_prefix(CTL).and_then(|r| r.strip_prefix(what)) {
                Some(rest) if found.is_none() => found = Some(rest.trim().to_owned()),
                _ => return Err(format!("unexpected message from the server: {s:?}")),
            }
        }
        if let Some(f) = found {
            return Ok(f);
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
