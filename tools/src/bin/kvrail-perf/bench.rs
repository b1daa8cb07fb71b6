//! The client's timed loops: bandwidth (WRITE / READ with `depth` transfer requests in
//! flight, each reposted as soon as it is done) and notification round-trip latency.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvrail::agent::{Agent, Desc, RegionId, XferId, XferOp, XferStatus};

/// When a run stops.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stop {
    /// After this many transfers.
    Iters(u64),
    /// After this long (transfers in flight then finish).
    For(Duration),
}

/// A bandwidth run's numbers.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Bw {
    pub(crate) bytes: u64,
    pub(crate) iterations: u64,
    pub(crate) seconds: f64,
    /// Best throughput over a window of completions, bytes/s.
    pub(crate) peak_bps: f64,
    /// Bytes moved / elapsed, bytes/s.
    pub(crate) avg_bps: f64,
    /// Transfers per second, millions.
    pub(crate) msg_rate_mpps: f64,
    /// Context switches of this process (all threads, voluntary and not) per transfer
    /// during the timed loop; None where /proc is not readable.
    pub(crate) ctx_switches_per_xfer: Option<f64>,
    /// Buffers of `bytes` each side's transfers took in turn (`BwSpec::slots`).
    pub(crate) slots: u64,
}

/// Context switches of this process's live threads so far (Linux /proc).
pub(crate) fn ctx_switches() -> Option<u64> {
    let mut sum = 0;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let s = std::fs::read_to_string(t.ok()?.path().join("status")).ok()?;
        for l in s.lines() {
            if let Some(v) = l
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                sum += v.trim().parse::<u64>().ok()?;
            }
        }
    }
    Some(sum)
}

/// What a bandwidth run moves.
pub(crate) struct BwSpec<'a> {
    pub(crate) agent: &'a Agent,
    pub(crate) peer: &'a str,
    pub(crate) op: XferOp,
    pub(crate) local: RegionId,
    pub(crate) remote: RegionId,
    pub(crate) size: u64,
    pub(crate) descs: u64,
    pub(crate) depth: usize,
    /// Slots of `size` bytes in the regions; transfer `k` uses slot `k % slots`.
    pub(crate) slots: u64,
    pub(crate) stop: Stop,
    /// Where the slots start in the local and the remote region (`-b`: each direction
    /// has its half).
    pub(crate) base: (u64, u64),
}

/// The descriptors of one transfer: `size` bytes at `base` split into `n` pieces.
pub(crate) fn split(region: RegionId, base: u64, size: u64, n: u64) -> Vec<Desc> {
    let piece = size / n;
    (0..n)
        .map(|i| {
            let len = if i + 1 == n { size - piece * i } else { piece };
            Desc::new(region, base + piece * i, len)
        })
        .collect()
}

/// SIGINT or SIGTERM arrived (see `HALT`).
fn halted() -> bool {
    crate::HALT.load(std::sync::atomic::Ordering::Relaxed)
}

fn status(a: &Agent, x: XferId) -> Result<XferStatus, String> {
    a.status(x).map_err(|e| e.to_string())
}

/// Run one bandwidth measurement.
pub(crate) fn bandwidth(s: &BwSpec<'_>) -> Result<Bw, String> {
    let a = s.agent;
    let xs: Vec<XferId> = (0..s.depth as u64)
        .map(|k| {
            let base = (k % s.slots) * s.size;
            a.create_xfer(
                s.op,
                split(s.local, s.base.0 + base, s.size, s.descs),
                s.peer,
                split(s.remote, s.base.1 + base, s.size, s.descs),
                None,
            )
            .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let target = match s.stop {
        Stop::Iters(n) => n,
        Stop::For(_) => u64::MAX,
    };
    let mut done_at: Vec<f64> = Vec::new();
    let cs0 = ctx_switches();
    let start = Instant::now();
    let mut posted = 0u64;
    // transfers in flight, oldest first
    let mut flight: VecDeque<usize> = VecDeque::new();
    for (k, x) in xs.iter().enumerate() {
        if posted < target {
            a.post(*x).map_err(|e| e.to_string())?;
            flight.push_back(k);
            posted += 1;
        }
    }
    while let Some(&oldest) = flight.front() {
        // sleep until the oldest finishes (the agent wakes us), then take every finished one
        let st = a
            .wait(xs[oldest], Duration::from_secs(120))
            .map_err(|e| e.to_string())?;
        if st == XferStatus::InProgress {
            return Err("a transfer is still in progress after 120 s".into());
        }
        // a signal ends the run like its time running out: what is in flight finishes
        let stopped = matches!(s.stop, Stop::For(d) if start.elapsed() >= d) || halted();
        let mut still = VecDeque::with_capacity(flight.len());
        let mut again = Vec::new();
        for k in flight.drain(..) {
            match status(a, xs[k])? {
                XferStatus::Done => {
                    done_at.push(start.elapsed().as_secs_f64());
                    if posted < target && !stopped {
                        again.push(k);
                        posted += 1;
                    }
                }
                XferStatus::Error(e) => return Err(format!("transfer failed: {e}")),
                _ => still.push_back(k),
            }
        }
        for k in again {
            a.post(xs[k]).map_err(|e| e.to_string())?;
            still.push_back(k);
        }
        flight = still;
    }
    let cs = cs0
        .zip(ctx_switches())
        .map(|(a, b)| b.saturating_sub(a) as f64 / done_at.len().max(1) as f64);
    for x in xs {
        a.release(x).map_err(|e| e.to_string())?;
    }
    let n = done_at.len() as u64;
    let secs = done_at.last().copied().unwrap_or(0.0).max(1e-9);
    let avg = (n * s.size) as f64 / secs;
    // peak: the best window of max(depth, n/20) consecutive completions
    let w = (s.depth as u64).max(n / 20).max(1) as usize;
    let mut peak = avg;
    if done_at.len() > 2 * w {
        for i in 0..done_at.len() - w {
            let dt = done_at[i + w] - done_at[i];
            if dt > 0.0 {
                peak = peak.max((w as u64 * s.size) as f64 / dt);
            }
        }
    }
    Ok(Bw {
        bytes: s.size,
        iterations: n,
        seconds: secs,
        peak_bps: peak,
        avg_bps: avg,
        msg_rate_mpps: n as f64 / secs / 1e6,
        ctx_switches_per_xfer: cs,
        slots: s.slots,
    })
}

/// Latency numbers, microseconds (round trip / 2, as perftest's `_lat` tools report).
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Lat {
    pub(crate) bytes: u64,
    pub(crate) iterations: u64,
    pub(crate) t_min: f64,
    pub(crate) t_max: f64,
    pub(crate) t_typical: f64,
    pub(crate) t_avg: f64,
    pub(crate) t_stdev: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
}

/// Notification ping-pong with the peer (which echoes), `size`-byte messages.
pub(crate) fn latency(a: &Agent, peer: &str, size: u64, stop: Stop) -> Result<Lat, String> {
    let mut msg = vec![0u8; size as usize];
    let mut samples = Vec::new();
    let start = Instant::now();
    let limit = Duration::from_secs(30);
    for i in 0u64.. {
        match stop {
            Stop::Iters(n) if i >= n => break,
            Stop::For(d) if start.elapsed() >= d => break,
            _ if halted() && i > 0 => break,
            _ => {}
        }
        let tag = i.to_le_bytes();
        let k = tag.len().min(msg.len());
        msg[..k].copy_from_slice(&tag[..k]);
        let t0 = Instant::now();
        a.send_notif(peer, msg.clone()).map_err(|e| e.to_string())?;
        loop {
            // sleeps until the echo comes (with --spin-us: polls the completion queues)
            let got = a.wait_notifs(Duration::from_millis(100));
            if let Some((_, m)) = got.first() {
                if *m != msg || got.len() > 1 {
                    return Err(format!("echo {i} came back wrong"));
                }
                break;
            }
            if t0.elapsed() > limit {
                return Err(format!("no echo of message {i} within 30 s"));
            }
            if !a.peer_connected(peer) {
                return Err(format!(
                    "the connection to the server closed before the echo of message {i}"
                ));
            }
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    Ok(lat_stats(size, &mut samples))
}

/// Summary statistics of one-way latencies (µs).
pub(crate) fn lat_stats(size: u64, s: &mut [f64]) -> Lat {
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let pct = |p: f64| {
        if n == 0 {
            0.0
        } else {
            s[((p * n as f64).ceil() as usize).clamp(1, n) - 1]
        }
    };
    let avg = if n == 0 {
        0.0
    } else {
        s.iter().sum::<f64>() / n as f64
    };
    let var = if n < 2 {
        0.0
    } else {
        s.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / (n - 1) as f64
    };
    Lat {
        bytes: size,
        iterations: n as u64,
        t_min: s.first().copied().unwrap_or(0.0),
        t_max: s.last().copied().unwrap_or(0.0),
        t_typical: pct(0.5),
        t_avg: avg,
        t_stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
    }
}

#[cfg(test)]
mod tests {
    use super::{lat_stats, split};
    use kvrail::agent::RegionId;

    #[test]
    fn split_covers_the_message_exactly() {
        let d = split(RegionId(3), 100, 10, 3);
        let v: Vec<(u64, u64)> = d.iter().map(|d| (d.offset, d.len)).collect();
        assert_eq!(v, [(100, 3), (103, 3), (106, 4)]);
    }

    #[test]
    fn latency_percentiles() {
        let mut s: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        let l = lat_stats(8, &mut s);
        assert_eq!((l.t_min, l.t_max), (1.0, 1000.0));
        assert_eq!(l.t_typical, 500.0);
        assert_eq!(l.p99, 990.0);
        assert_eq!(l.p999, 999.0);
        assert!((l.t_avg - 500.5).abs() < 1e-9);
    }
}
