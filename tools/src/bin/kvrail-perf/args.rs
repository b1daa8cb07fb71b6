//! Command-line arguments (perftest-like flags).

use clap::{Parser, ValueEnum};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Op {
    /// RDMA WRITE bandwidth (one-sided, the initiator's memory into the peer's).
    Write,
    /// RDMA READ bandwidth (the peer's memory into the initiator's).
    Read,
    /// Notification round-trip latency (the peer echoes each one).
    Lat,
}

/// Which memory the agents move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mem {
    /// Host memory.
    Host,
    /// NPU memory of the RBLN runtime `RBLN_RUNTIME_LIB` names (device 0 here, 1 at the
    /// server); on verbs the agent stages it through its host bounce.
    Npu,
}

/// Which data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Transport {
    /// Verbs when a usable RDMA rail exists, else TCP.
    Auto,
    /// RDMA verbs only.
    Verbs,
    /// TCP only.
    Tcp,
}

/// kvrail-perf: bandwidth and latency of kvrail's agent API, with perftest's columns.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) log: crate::logging::LogArgs,
    /// Serve one client, then exit.
    #[arg(long, conflicts_with_all = ["client", "loopback"])]
    pub(crate) server: bool,
    /// Run against the server whose side channel is at HOST:PORT.
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "loopback")]
    pub(crate) client: Option<String>,
    /// Both agents in this process.
    #[arg(long)]
    pub(crate) loopback: bool,
    /// Side-channel listen address (the server's default port is 18515).
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) listen: Option<String>,
    /// Address advertised to the peer (`side_channel_host`); needed across hosts.
    #[arg(long, value_name = "IP")]
    pub(crate) side_channel_host: Option<String>,
    /// Operation.
    #[arg(short = 'o', long, value_enum, default_value = "write")]
    pub(crate) op: Op,
    /// Message size in bytes (K/M/G suffixes allowed).
    #[arg(short = 's', long, value_parser = parse_size, default_value = "65536")]
    pub(crate) size: u64,
    /// Sweep sizes 2 B … 8 MiB (powers of two).
    #[arg(short = 'a', long)]
    pub(crate) all: bool,
    /// Iterations per size.
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub(crate) iters: u64,
    /// Run each size for this many seconds instead of --iters.
    #[arg(short = 'D', long)]
    pub(crate) duration: Option<f64>,
    /// Transfer requests in flight (`-t 1`: one at a time).
    #[arg(short = 't', long, default_value_t = 32)]
    pub(crate) depth: usize,
    /// Descriptors per transfer request (the message split into this many pieces).
    #[arg(long, default_value_t = 1)]
    pub(crate) descs: u64,
    /// Report Gb/s instead of MB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub(crate) report_gbits: bool,
    /// One JSON document on stdout instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Data path.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) transport: Transport,
    /// RDMA devices this agent may use as rails (comma separated; default: every usable one).
    #[arg(long, value_delimiter = ',')]
    pub(crate) rails: Vec<String>,
    /// Loopback: RDMA devices of the second agent.
    #[arg(long, value_delimiter = ',', requires = "loopback")]
    pub(crate) peer_rails: Vec<String>,
    /// `stripe_width`: unset = one rail per transfer; 0 = every transfer striped over all rails.
    #[arg(long)]
    pub(crate) stripe_width: Option<i64>,
    /// Memory both agents move.
    #[arg(long, value_enum, default_value = "host")]
    pub(crate) mem: Mem,
    /// Skip the data check after the timed loop.
    #[arg(long)]
    pub(crate) no_verify: bool,
}

impl Args {
    /// The message sizes to run.
    pub(crate) fn sizes(&self) -> Vec<u64> {
        if self.all {
            (1..=23).map(|k| 1u64 << k).collect()
        } else {
            vec![self.size]
        }
    }

    /// Check what clap cannot.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if !self.server && !self.loopback && self.client.is_none() {
            return Err("say --server, --client HOST:PORT or --loopback".into());
        }
        if self.depth == 0 {
            return Err("-t/--depth must be at least 1".into());
        }
        if self.descs == 0 {
            return Err("--descs must be at least 1".into());
        }
        if self.iters == 0 {
            return Err("-n/--iters must be at least 1".into());
        }
        if let Some(d) = self.duration {
            if !(d > 0.0 && d.is_finite()) {
                return Err(format!(
                    "-D/--duration must be a positive number of seconds, not {d}"
                ));
            }
        }
        for s in self.sizes() {
            if s > crate::peer::MAX_SERVE_BYTES {
                return Err(format!(
                    "size {s} is over {} MiB, the most a server registers",
                    crate::peer::MAX_SERVE_BYTES >> 20
                ));
            }
            if s < self.descs {
                return Err(format!(
                    "size {s} cannot be split into {} descriptors",
                    self.descs
                ));
            }
        }
        Ok(())
    }
}

/// `65536`, `64K`, `1M`, `2G` (powers of 1024).
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.eq_ignore_ascii_case(&'k') => (&t[..i], 1u64 << 10),
        Some((i, c)) if c.eq_ignore_ascii_case(&'m') => (&t[..i], 1 << 20),
        Some((i, c)) if c.eq_ignore_ascii_case(&'g') => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (a number, optionally with K, M or G)"))?;
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| format!("size {s} is too large"))?;
    if v == 0 {
        return Err("size must be at least 1 byte".into());
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_with_suffixes() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999G")
            .unwrap_err()
            .contains("too large"));
    }
}
