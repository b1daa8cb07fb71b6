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

/// perftest's default side-channel port.
pub(crate) const DEFAULT_PORT: u16 = 18515;

/// kvrail-perf: bandwidth and latency of kvrail's agent API, with perftest's flags and
/// columns.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvrail-perf",
    version = crate::cli::VERSION,
    about,
    after_help = concat!(
        "Examples (perftest's command lines work as they are):\n",
        "  kvrail-perf -d mlx5_0 -x 3 -s 1M -n 1000                 # server, host B\n",
        "  kvrail-perf -d mlx5_0 -x 3 -s 1M -n 1000 hostB           # client, host A: WRITE\n",
        "  kvrail-perf --op read -a hostB                           # READ, every size\n",
        "  kvrail-perf --loopback -a                                # both agents here\n",
        "  kvrail-perf -D 2 --run_infinitely hostB                  # a line every 2 s until ^C\n",
        "  kvrail-perf -s 1M hostB --out_json --out_json_file r.json\n\n",
        "Without HOST (and without --loopback or --client) it is the server: it serves one ",
        "client, then exits. SIGINT or SIGTERM stops a run after printing what was measured. ",
        "Exit status: 0 success; 1 the run failed (a wrong byte, a failed transfer, the ",
        "peer); 2 usage (before anything runs); 130 interrupted; 141 stdout closed."
    )
)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) log: crate::logging::PerfLogArgs,
    /// The server's host (perftest's positional argument): run as its client.
    #[arg(value_name = "HOST", conflicts_with_all = ["client", "loopback", "server"])]
    pub(crate) host: Option<String>,
    /// Side-channel port: the server listens there, the client connects there.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub(crate) port: u16,
    /// Serve one client, then exit (the default without HOST).
    #[arg(long, conflicts_with_all = ["client", "loopback"])]
    pub(crate) server: bool,
    /// Run against the server whose side channel is at HOST:PORT (kvrail's long form).
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "loopback")]
    pub(crate) client: Option<String>,
    /// Both agents in this process.
    #[arg(long)]
    pub(crate) loopback: bool,
    /// Side-channel listen address (default: 0.0.0.0 and -p for the server).
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) listen: Option<String>,
    /// Address advertised to the peer (`side_channel_host`); needed across hosts.
    #[arg(long, value_name = "IP")]
    pub(crate) side_channel_host: Option<String>,
    /// The cluster's shared secret (`cluster_secret`, 16 bytes or more), the same on server
    /// and client; needed across hosts unless --insecure. KVRAIL_CLUSTER_SECRET in the
    /// environment keeps it off the command line.
    #[arg(long, value_name = "SECRET", conflicts_with = "insecure")]
    pub(crate) cluster_secret: Option<String>,
    /// Serve peers beyond loopback without a cluster secret (`insecure`): anyone who
    /// reaches the side channel can then READ and WRITE the benchmark's memory.
    #[arg(long)]
    pub(crate) insecure: bool,
    /// Operation (perftest's tool name: ib_write_bw, ib_read_bw; lat: notification round
    /// trip).
    #[arg(long, value_enum, default_value = "write")]
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
    /// Measure again and again, a line every -D seconds (default 5), until SIGINT.
    #[arg(long = "run_infinitely", alias = "run-infinitely")]
    pub(crate) run_infinitely: bool,
    /// A round of the same transfers before each measurement, not counted.
    #[arg(long = "perform_warm_up", alias = "perform-warm-up")]
    pub(crate) warm_up: bool,
    /// Transfer requests in flight (`-t 1`: one at a time).
    #[arg(short = 't', long = "tx-depth", alias = "depth", default_value_t = 32)]
    pub(crate) depth: usize,
    /// Buffers of the message size in each side's region, which the transfers take in turn
    /// (default: one per transfer in flight, 64 MiB at most). 1 is perftest's layout: every
    /// transfer in flight moves the same bytes, so the memory touched is one message's.
    #[arg(long, value_name = "N")]
    pub(crate) slots: Option<u64>,
    /// Descriptors per transfer request (the message split into this many pieces).
    #[arg(long, default_value_t = 1)]
    pub(crate) descs: u64,
    /// Report Gb/s instead of MiB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub(crate) report_gbits: bool,
    /// One JSON document on stdout (kvrail's keys) instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Also write the results as JSON with perftest's keys (`test_info`, `results`:
    /// `MsgSize`, `n_iterations`, `BW_peak`, `BW_average`, `MsgRate`) to --out_json_file.
    #[arg(long = "out_json", alias = "out-json")]
    pub(crate) out_json: bool,
    /// Where --out_json writes (implies --out_json).
    #[arg(
        long = "out_json_file",
        alias = "out-json-file",
        value_name = "FILE",
        default_value = "perftest_out.json"
    )]
    pub(crate) out_json_file: String,
    /// Data path.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) transport: Transport,
    /// RDMA devices this agent may use as rails (comma separated `DEV` or `DEV/PORT`;
    /// default: every usable one).
    #[arg(
        short = 'd',
        long = "devices",
        aliases = ["ib-dev", "rails"],
        value_delimiter = ','
    )]
    pub(crate) devices: Vec<String>,
    /// The port of each -d device (perftest's -i).
    #[arg(short = 'i', long = "ib-port")]
    pub(crate) ib_port: Option<u8>,
    /// GID table index on every rail (perftest's -x; default: kvrail's choice, the RoCEv2
    /// IPv4 entry).
    #[arg(short = 'x', long = "gid-index")]
    pub(crate) gid_index: Option<u32>,
    /// Largest path MTU: 256, 512, 1024, 2048 or 4096 (default: the ports' active MTU).
    #[arg(short = 'm', long)]
    pub(crate) mtu: Option<u32>,
    /// Queue pairs per rail (perftest's -q, 1 to 16): each a lane of its own with its own
    /// completion queue; transfers spread over them like over rails.
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    pub(crate) qps: u32,
    /// TCP connections to the peer (1 to 16; the agent's default 1): transfers of 1 MiB and
    /// more spread over them (AgentConfig::tcp_conns).
    #[arg(long, default_value_t = kvrail::agent::AgentConfig::default().tcp_conns)]
    pub(crate) tcp_conns: u32,
    /// Both directions at once (perftest's -b): the server runs the same operation toward
    /// the client meanwhile; the line is the sum (the server's WRITEs are checked too).
    #[arg(short = 'b', long)]
    pub(crate) bidirectional: bool,
    /// Loopback: RDMA devices of the second agent.
    #[arg(
        long = "peer-devices",
        alias = "peer-rails",
        value_delimiter = ',',
        requires = "loopback"
    )]
    pub(crate) peer_devices: Vec<String>,
    /// `stripe_width`: unset = one rail per transfer; 0 = every transfer striped over all rails.
    #[arg(long)]
    pub(crate) stripe_width: Option<i64>,
    /// Memory both agents move.
    #[arg(long, value_enum, default_value = "host")]
    pub(crate) mem: Mem,
    /// Skip the data check after the timed loop.
    #[arg(long)]
    pub(crate) no_verify: bool,
    /// Adaptive progress: a waiting thread polls the completion queues itself for this many
    /// microseconds (restarted by each completion) before sleeping (`progress_spin_us`).
    /// The default polls, as perftest does; `-e` (or 0) sleeps at once.
    #[arg(long, default_value_t = 2000, value_name = "USEC")]
    pub(crate) spin_us: u32,
    /// Sleep on completion events instead of polling (perftest's `-e`): the agent's own
    /// default, `progress_spin_us` 0.
    #[arg(short = 'e', long = "use_event", conflicts_with = "spin_us")]
    pub(crate) use_event: bool,
    /// Serve the agent's metrics in the Prometheus format at ADDR:PORT while it runs.
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) metrics_listen: Option<String>,
}

impl Args {
    /// The message sizes to run.
    pub(crate) fn sizes(&self) -> Vec<u64> {
        if self.all {
            // perftest's sweep, 2 B to 8 MiB; a latency run's messages are notifications,
            // which stop at their limit (4 MiB)
            let top = if self.op == Op::Lat {
                kvrail::agent::MAX_NOTIF_LEN as u64
            } else {
                1 << 23
            };
            (1..=23).map(|k| 1u64 << k).filter(|&s| s <= top).collect()
        } else {
            vec![self.size]
        }
    }

    /// The server's side channel, for a client (HOST or --client).
    pub(crate) fn server_addr(&self) -> Option<String> {
        match (&self.host, &self.client) {
            (Some(h), _) if h.parse::<std::net::Ipv6Addr>().is_ok() => {
                Some(format!("[{h}]:{}", self.port))
            }
            (Some(h), _) => Some(format!("{h}:{}", self.port)),
            (None, Some(c)) => Some(c.clone()),
            (None, None) => None,
        }
    }

    /// The server role: no HOST, no --client, no --loopback (or --server).
    pub(crate) fn is_server(&self) -> bool {
        self.server || (self.host.is_none() && self.client.is_none() && !self.loopback)
    }

    /// The -d devices, each on -i's port when given.
    pub(crate) fn device_list(&self, devs: &[String]) -> Vec<String> {
        match self.ib_port {
            None => devs.to_vec(),
            Some(p) => devs
                .iter()
                .map(|d| match d.split_once(['/', ':']) {
                    Some(_) => d.clone(),
                    None => format!("{d}/{p}"),
                })
                .collect(),
        }
    }

    /// --out_json, or a --out_json_file named on the command line.
    pub(crate) fn wants_out_json(&self) -> bool {
        self.out_json || self.out_json_file != "perftest_out.json"
    }

    /// Check what clap cannot.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if !(1..=16).contains(&self.qps) {
            return Err(format!("-q {}: use 1 to 16 queue pairs per rail", self.qps));
        }
        if !(1..=kvrail::agent::MAX_TCP_CONNS).contains(&self.tcp_conns) {
            return Err(format!(
                "--tcp-conns {}: use 1 to {}",
                self.tcp_conns,
                kvrail::agent::MAX_TCP_CONNS
            ));
        }
        if self.qps > 1 && self.transport == Transport::Tcp {
            return Err(format!(
                "-q {}: queue pairs are RDMA's; not with --transport tcp",
                self.qps
            ));
        }
        if self.bidirectional && self.op == Op::Lat {
            return Err("-b: bandwidth only (a latency run is a round trip already)".into());
        }
        if let Some(m) = self.mtu {
            if ![256, 512, 1024, 2048, 4096].contains(&m) {
                return Err(format!("-m {m}: use 256, 512, 1024, 2048 or 4096"));
            }
        }
        if self.ib_port == Some(0) {
            return Err("-i 0: ports are numbered from 1".into());
        }
        if self.run_infinitely && (self.all || self.json) {
            return Err(
                "--run_infinitely measures one size and prints a line per period: \
                        not with -a or --json"
                    .into(),
            );
        }
        if self.depth == 0 {
            return Err("-t/--tx-depth must be at least 1".into());
        }
        if self.slots == Some(0) {
            return Err("--slots must be at least 1".into());
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
        for (flag, addr) in [
            ("--listen", &self.listen),
            ("--metrics-listen", &self.metrics_listen),
        ] {
            if let Some(a) = addr {
                a.parse::<std::net::SocketAddr>()
                    .map_err(|_| format!("{flag}: {a:?} is not ADDR:PORT"))?;
            }
        }
        if let Some(h) = &self.side_channel_host {
            h.parse::<std::net::IpAddr>()
                .map_err(|_| format!("--side-channel-host: {h:?} is not an IP address"))?;
        }
        if let Some(k) = &self.cluster_secret {
            kvrail::agent::ClusterSecret::new(k.as_bytes())
                .map_err(|e| format!("--cluster-secret: {e}"))?;
        }
        if self.op == Op::Lat && self.size > kvrail::agent::MAX_NOTIF_LEN as u64 {
            return Err(format!(
                "-s {}: a latency run's messages are notifications, at most {} bytes",
                self.size,
                kvrail::agent::MAX_NOTIF_LEN
            ));
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
