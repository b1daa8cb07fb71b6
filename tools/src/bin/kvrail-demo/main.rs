//! kvrail-demo: disaggregated prefill/decode end to end. The proxy (this process) starts a
//! prefill (P) and a decode (D) instance as child processes; each request goes proxy → P
//! (prefill: the fake model computes KV into P's paged cache) → proxy → D (with P's
//! transfer parameters), and D checks every KV byte it received before it "decodes".
//! `--mode pull` (D READs) or `push` (P WRITEs). Prints each request's transfer latency and
//! the totals. `--kill d` kills D mid-run and shows P reclaiming every block by lease
//! expiry; `--kill p` kills P and shows D failing those requests cleanly.

#[path = "../../cli.rs"]
mod cli;
#[macro_use]
#[path = "../../out.rs"]
mod out;
mod engine;
#[path = "../../logging.rs"]
mod logging;
mod model;
mod soak;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use kvrail::agent::BackendChoice;
use serde_json::{json, Value};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Mode {
    Pull,
    Push,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Kill {
    D,
    P,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Backend {
    Auto,
    Tcp,
    Verbs,
}

#[derive(Parser, Debug)]
#[command(
    name = "kvrail-demo",
    version = cli::VERSION,
    about = "P/D disaggregation end to end over kvrail: a proxy, a prefill and a decode process",
    after_help = concat!(
        "Examples:\n",
        "  kvrail-demo --mode pull                         # 8 requests, every KV byte checked\n",
        "  kvrail-demo --mode push --push-stream --step-tokens 64\n",
        "  kvrail-demo --kill d --lease 6                  # P reclaims its blocks by lease\n",
        "  kvrail-demo --devices rxeA0,rxeB0               # P and D on these RDMA devices\n",
        "  kvrail-demo --soak --mode pull --requests 1000 --kill-every 60\n",
        "  kvrail-demo --metadata etcd://127.0.0.1:2379    # D finds P by name through etcd\n\n",
        "Exit status: 0 every request as expected; 1 a run that failed (a wrong byte, a hang, ",
        "a leak); 2 usage; 141 stdout closed."
    )
)]
struct Args {
    #[command(flatten)]
    log: logging::LogArgs,
    #[command(subcommand)]
    instance: Option<Sub>,
    /// Pull (D READs from P) or push (P WRITEs into D).
    #[arg(long, value_enum, default_value = "pull")]
    mode: Mode,
    /// Requests to run.
    #[arg(long, default_value_t = 8)]
    requests: u64,
    /// Shortest prompt, in tokens (lengths are drawn between this and --max-tokens).
    #[arg(long, default_value_t = 40)]
    min_tokens: u64,
    /// Longest prompt, in tokens.
    #[arg(long, default_value_t = 300)]
    max_tokens: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per instance.
    #[arg(long, default_value_t = 96)]
    num_blocks: u64,
    /// Model layers (8 KV heads, head size 128, fp16).
    #[arg(long, default_value_t = 28)]
    layers: usize,
    /// `kv_lease_duration` in seconds.
    #[arg(long, default_value_t = 30)]
    lease: u64,
    /// The data path: verbs where a usable RDMA rail exists (auto), or forced.
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// RDMA devices of both instances (comma separated `DEV` or `DEV/PORT`);
    /// --p-devices / --d-devices set one side.
    #[arg(long, default_value = "")]
    devices: String,
    /// RDMA devices of P (comma separated; default: --devices).
    #[arg(long, default_value = "")]
    p_devices: String,
    /// RDMA devices of D (comma separated; default: --devices).
    #[arg(long, default_value = "")]
    d_devices: String,
    /// Kill an instance mid-run.
    #[arg(long, value_enum)]
    kill: Option<Kill>,
    /// Turn on chunk_mode with this chunk_tokens bound (the last block moves only up to the
    /// chunk holding the prompt's last token).
    #[arg(long)]
    chunk_tokens: Option<u64>,
    /// Give the odd layers a sliding window of this many tokens and turn on swa_window_mode
    /// (only the window of those layers moves; D checks what attention reads).
    #[arg(long)]
    swa_window: Option<usize>,
    /// Prefill this many tokens per engine step (default: the whole prompt in one step).
    #[arg(long)]
    step_tokens: Option<u64>,
    /// Push mode: turn on push_stream (each block goes to D as a prefill step closes it).
    #[arg(long)]
    push_stream: bool,
    /// Soak: run --requests while P and D are killed (SIGKILL) and restarted at random;
    /// report completed, failed cleanly, lost with a killed instance, wrong bytes, hung and
    /// leaked blocks (the last three must be 0).
    #[arg(long)]
    soak: bool,
    /// Soak: kill an instance after about one outcome in this many.
    #[arg(long, default_value_t = 40)]
    kill_every: u64,
    /// Agent metadata through etcd (`etcd://HOST:PORT[,HOST:PORT...]`): P and D publish
    /// theirs under a 5 s lease (namespace `kvrail-demo-<proxy pid>`), and D finds P by its
    /// engine name alone (the proxy passes no host and no port).
    #[arg(long, value_name = "etcd://HOST:PORT")]
    metadata: Option<String>,
    /// The cluster secret P and D prove to each other (`cluster_secret`, 16 bytes or
    /// more; handed to the instances in their environment, KVRAIL_CLUSTER_SECRET).
    #[arg(long, value_name = "SECRET", conflicts_with = "insecure")]
    cluster_secret: Option<String>,
    /// P and D serve peers beyond loopback without a secret (`insecure`).
    #[arg(long)]
    insecure: bool,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// (internal) run one instance; the proxy starts these.
    Instance {
        #[arg(long)]
        name: String,
        #[arg(long)]
        kv_config: String,
        #[arg(long)]
        devices: String,
    },
    /// Write the fake model's KV of one prompt to a file: for every layer, plane (K, V) and
    /// block of the prompt, the block's bytes in the HND layout (8 KV heads x 128, fp16),
    /// zeros after the prompt's end. Other implementations of the model (the Python engine
    /// harness) compare theirs with it byte for byte.
    FakeKv {
        /// The prompt's seed (its token ids are `tokens(seed, n)`).
        #[arg(long)]
        seed: u64,
        /// Prompt length in tokens.
        #[arg(long)]
        tokens: u64,
        /// Where to write the bytes.
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

fn shape(a: &Args) -> model::Shape {
    model::Shape {
        layers: a.layers,
        kv_heads: 8,
        head_size: 128,
        block_size: a.block_size,
        num_blocks: a.num_blocks,
        window: a.swa_window,
    }
}

fn backend(b: Backend) -> BackendChoice {
    match b {
        Backend::Auto => BackendChoice::Auto,
        Backend::Tcp => BackendChoice::Tcp,
        Backend::Verbs => BackendChoice::Verbs,
    }
}

struct Inst {
    child: Child,
    ctl: TcpStream,
    lines: BufReader<TcpStream>,
    backend: String,
    /// The instance's side-channel port (where D finds P).
    side: u16,
    /// `--metadata`: peers find it by name; its transfer parameters carry no address.
    by_name: bool,
}

impl Inst {
    /// P's transfer parameters as the proxy passes them on: with `--metadata`, the engine's
    /// name (and TP size) only.
    fn params(&self, mut v: Value) -> Value {
        if self.by_name {
            if let Some(o) = v.as_object_mut() {
                for k in ["remote_host", "remote_port", "remote_ports"] {
                    o.remove(k);
                }
            }
        }
        v
    }

    fn send(&mut self, v: Value) -> Result<(), String> {
        writeln!(self.ctl, "{v}").map_err(|e| format!("control: {e}"))
    }

    fn recv(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        match self.lines.read_line(&mut line) {
            Ok(0) | Err(_) => Err("instance closed its control connection".into()),
            Ok(_) => serde_json::from_str(&line).map_err(|e| format!("bad reply {line:?}: {e}")),
        }
    }

    fn stats(&mut self) -> Result<Value, String> {
        self.send(json!({"cmd": "stats"}))?;
        loop {
            let v = self.recv()?;
            if let Some(s) = v.get("stats") {
                return Ok(s.clone());
            }
        }
    }
}

fn spawn(a: &Args, name: &str, role: &str, devices: &str) -> Result<Inst, String> {
    let mut extra = json!({"kv_lease_duration": a.lease});
    if let Some(c) = a.chunk_tokens {
        extra["chunk_mode"] = json!(true);
        extra["chunk_tokens"] = json!(c);
    }
    if a.swa_window.is_some() {
        extra["swa_window_mode"] = json!(true);
    }
    if a.push_stream {
        extra["push_stream"] = json!(true);
    }
    if a.soak {
        // a registration with a dead P ends within a lease (not the default 480 s)
        extra["push_registration_timeout"] = json!(a.lease);
    }
    if a.insecure {
        extra["insecure"] = json!(true);
    }
    if let Some(m) = &a.metadata {
        extra["metadata_store"] = json!(m);
        extra["metadata_namespace"] = json!(metadata_namespace());
        extra["metadata_lease_ttl_s"] = json!(5);
    }
    let kv = json!({
        "kv_connector": if a.mode == Mode::Pull { "KvrailPullConnector" } else { "KvrailPushConnector" },
        "kv_role": role,
        "kv_buffer_device": "rbln",
        "engine_id": name,
        "kv_connector_extra_config": extra,
    });
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        // a soak's instances log errors only (each kill makes every peer warn)
        .args(a.soak.then_some("-q"))
        .args(["--backend", &format!("{:?}", a.backend).to_lowercase()])
        .args(["--block-size", &a.block_size.to_string()])
        .args(["--num-blocks", &a.num_blocks.to_string()])
        .args(["--layers", &a.layers.to_string()])
        .args(
            a.swa_window
                .map(|w| vec!["--swa-window".to_owned(), w.to_string()])
                .unwrap_or_default(),
        )
        .args(
            a.step_tokens
                .map(|t| vec!["--step-tokens".to_owned(), t.to_string()])
                .unwrap_or_default(),
        )
        .args([
            "instance",
            "--name",
            name,
            "--kv-config",
            &kv.to_string(),
            "--devices",
            devices,
        ])
        .envs(
            a.cluster_secret
                .as_ref()
                .map(|k| (kvrail::agent::SECRET_ENV, k)),
        )
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {name}: {e}"))?;
    let mut first = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?)
        .read_line(&mut first)
        .map_err(|e| e.to_string())?;
    let w: Vec<&str> = first.split_whitespace().collect();
    let (port, side) = match w.as_slice() {
        ["ready", port, "backend", _, "side", side] => (port.to_string(), side.to_string()),
        _ => return Err(format!("{name} did not start: {first:?}")),
    };
    let ctl = TcpStream::connect(format!("127.0.0.1:{port}")).map_err(|e| e.to_string())?;
    Ok(Inst {
        lines: BufReader::new(ctl.try_clone().map_err(|e| e.to_string())?),
        ctl,
        child,
        backend: w[3].to_owned(),
        side: side
            .parse()
            .map_err(|e| format!("{name}: side port {side:?}: {e}"))?,
        by_name: a.metadata.is_some(),
    })
}

/// The etcd namespace of this run's instances (`--metadata`).
fn metadata_namespace() -> String {
    format!("kvrail-demo-{}", std::process::id())
}

/// The header line that says how D finds P.
fn metadata_line(a: &Args) -> String {
    match &a.metadata {
        Some(m) => format!(
            "metadata: etcd at {m}, namespace {}; D finds P by engine name (no host or port in the transfer parameters)",
            metadata_namespace()
        ),
        None => "metadata: side channel (D finds P at the host and port in the transfer parameters)".into(),
    }
}

struct Req {
    id: String,
    seed: u64,
    tokens: u64,
}

fn requests(a: &Args) -> Vec<Req> {
    (0..a.requests)
        .map(|i| {
            let seed = 0x5eed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let span = a.max_tokens.saturating_sub(a.min_tokens) + 1;
            Req {
                id: format!("cmpl-demo{i:04}-0"),
                seed,
                tokens: a.min_tokens + (seed >> 33) % span,
            }
        })
        .collect()
}

fn prefill(p: &mut Inst, r: &Req) -> Result<Value, String> {
    Ok(prefill_at(p, r)?.0)
}

/// Prefill `r` on P: its transfer parameters for D, and when the prefill ended (µs).
fn prefill_at(p: &mut Inst, r: &Req) -> Result<(Value, u64), String> {
    p.send(json!({"cmd": "prefill", "id": r.id, "seed": r.seed, "tokens": r.tokens}))?;
    let v = p.recv()?;
    if let Some(e) = v.get("error") {
        return Err(format!("prefill {}: {e}", r.id));
    }
    Ok((
        p.params(v["params"].clone()),
        v["finished_at_us"].as_u64().unwrap_or(0),
    ))
}

/// Where D finds P for `r` before P's prefill ends (push: both legs go at once).
fn coordinates(p: &Inst, r: &Req) -> Value {
    p.params(
        json!({"do_remote_prefill": true, "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1", "remote_port": p.side, "remote_request_id": r.id,
        "tp_size": 1}),
    )
}

fn decode(d: &mut Inst, r: &Req, params: &Value) -> Result<(), String> {
    d.send(
        json!({"cmd": "decode", "id": r.id, "seed": r.seed, "tokens": r.tokens, "params": params}),
    )
}

/// Normal run: every request's KV crosses and is checked; P frees everything.
fn run(a: &Args, p: &mut Inst, d: &mut Inst) -> Result<(), String> {
    let reqs = requests(a);
    let t0 = Instant::now();
    let (mut next, mut inflight, mut ok, mut bytes) = (0usize, 0usize, 0u64, 0u64);
    let mut lat = Vec::new();
    // push: the proxy sends both legs at once (D registers while P prefills); the tail is
    // how long after P's prefill ended D had every byte
    let mut prefill_end = std::collections::HashMap::new();
    let mut tails = Vec::new();
    outln!(
        "{:<18} {:>7} {:>10} {:>12}",
        "request",
        "tokens",
        "KV bytes",
        "transfer ms"
    );
    while (ok as usize) < reqs.len() {
        while inflight < a.concurrency && next < reqs.len() {
            if a.mode == Mode::Push {
                decode(d, &reqs[next], &coordinates(p, &reqs[next]))?;
                let (_, end) = prefill_at(p, &reqs[next])?;
                prefill_end.insert(reqs[next].id.clone(), end);
            } else {
                let params = prefill(p, &reqs[next])?;
                decode(d, &reqs[next], &params)?;
            }
            next += 1;
            inflight += 1;
        }
        let v = d.recv()?;
        if v["ok"] != json!(true) {
            return Err(format!("{}: {}", v["id"], v["error"]));
        }
        let r = reqs
            .iter()
            .find(|r| v["id"] == json!(r.id))
            .ok_or("unknown id")?;
        let ms = v["ms"].as_f64().unwrap_or(0.0);
        let b = v["bytes"].as_u64().unwrap_or(0);
        outln!("{:<18} {:>7} {:>10} {:>12.2}", r.id, r.tokens, b, ms);
        lat.push(ms);
        if let (Some(end), Some(done)) = (prefill_end.get(&r.id), v["done_at_us"].as_u64()) {
            tails.push(done.saturating_sub(*end) as f64 / 1e3);
        }
        bytes += b;
        ok += 1;
        inflight -= 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    outln!(
        "{ok} requests, {:.1} MiB of KV blocks, every prompt token attention reads checked byte for byte, {:.2} s, {:.1} MB/s; transfer ms p50 {:.2} max {:.2}",
        bytes as f64 / (1 << 20) as f64,
        secs,
        bytes as f64 / secs / 1e6,
        lat[lat.len() / 2],
        lat[lat.len() - 1]
    );
    if !tails.is_empty() {
        tails.sort_by(f64::total_cmp);
        outln!(
            "tail after the prefill ended: p50 {:.2} ms, max {:.2} ms{}",
            tails[tails.len() / 2],
            tails[tails.len() - 1],
            if a.push_stream { " (push_stream)" } else { "" }
        );
    }
    let t = Instant::now();
    loop {
        let s = p.stats()?;
        if s["held"] == json!(0) {
            let moved = s["bytes_posted"].as_u64().unwrap_or(0)
                + d.stats()?["bytes_posted"].as_u64().unwrap_or(0);
            outln!(
                "moved over the fabric: {:.1} MiB ({:.0} % of the blocks)",
                moved as f64 / (1 << 20) as f64,
                moved as f64 * 100.0 / bytes.max(1) as f64
            );
            outln!(
                "P holds no blocks (freed {} requests on completion)",
                s["freed"]
            );
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(30) {
            return Err(format!("P still holds blocks: {s}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kill D mid-run: P must reclaim every block by lease expiry.
fn kill_d(a: &Args, p: &mut Inst, d: &mut Inst) -> Result<(), String> {
    let reqs = requests(a);
    for r in &reqs {
        let params = prefill(p, r)?;
        decode(d, r, &params)?;
    }
    // let the first few complete, then kill D with the rest in flight or waiting
    let _ = d.recv();
    d.child.kill().map_err(|e| e.to_string())?;
    let _ = d.child.wait();
    let killed = Instant::now();
    let s = p.stats()?;
    outln!("killed D; P holds {} requests' blocks", s["held"]);
    loop {
        let s = p.stats()?;
        if s["held"] == json!(0) {
            outln!(
                "P reclaimed every block {:.1} s after D died (lease {} s, extension {} s); free blocks {}",
                killed.elapsed().as_secs_f64(),
                a.lease,
                a.lease * 2 / 3,
                s["free_blocks"]
            );
            if s["free_blocks"] != json!(a.num_blocks) {
                return Err(format!("blocks leaked: {s}"));
            }
            return Ok(());
        }
        if killed.elapsed() > Duration::from_secs(a.lease + 30) {
            return Err(format!("P never reclaimed: {s}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kill P after its prefills: D must fail those requests cleanly, reporting none as done.
fn kill_p(a: &Args, p: &mut Inst, d: &mut Inst) -> Result<(), String> {
    let reqs = requests(a);
    let params: Vec<Value> = reqs
        .iter()
        .map(|r| prefill(p, r))
        .collect::<Result<_, _>>()?;
    p.child.kill().map_err(|e| e.to_string())?;
    let _ = p.child.wait();
    outln!("killed P after {} prefills", reqs.len());
    for (r, pr) in reqs.iter().zip(&params) {
        decode(d, r, pr)?;
    }
    let mut failed = 0;
    while failed < reqs.len() {
        let v = d.recv()?;
        if v["ok"] == json!(true) {
            return Err(format!("{} reported success with P dead", v["id"]));
        }
        outln!("{}: failed cleanly ({})", v["id"], v["error"]);
        failed += 1;
    }
    let s = d.stats()?;
    if s["free_blocks"] != json!(a.num_blocks) {
        return Err(format!("D leaked blocks: {s}"));
    }
    outln!("D failed all {failed} requests and holds no blocks");
    Ok(())
}

impl Args {
    /// The RDMA devices of P (`prefill`) or D: its own flag, else --devices.
    fn devices_of(&self, prefill: bool) -> &str {
        let own = if prefill {
            &self.p_devices
        } else {
            &self.d_devices
        };
        if own.is_empty() {
            &self.devices
        } else {
            own
        }
    }

    /// Refuse values that cannot run (they panicked or hung), naming the flag.
    fn validate(&self) -> Result<(), String> {
        let at_least_one = [
            ("--requests", self.requests),
            ("--concurrency", self.concurrency as u64),
            ("--min-tokens", self.min_tokens),
            ("--max-tokens", self.max_tokens),
            ("--block-size", self.block_size as u64),
            ("--num-blocks", self.num_blocks),
            ("--layers", self.layers as u64),
            ("--step-tokens", self.step_tokens.unwrap_or(1)),
            ("--chunk-tokens", self.chunk_tokens.unwrap_or(1)),
            ("--swa-window", self.swa_window.unwrap_or(1) as u64),
            ("--kill-every", self.kill_every),
        ];
        if let Some((flag, _)) = at_least_one.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{flag} must be at least 1"));
        }
        if self.soak && self.kill.is_some() {
            return Err("--soak kills at random: leave out --kill".into());
        }
        if let Some(m) = &self.metadata {
            kvrail::store::StoreConfig::from_url(m).map_err(|e| format!("--metadata {e}"))?;
        }
        if let Some(k) = &self.cluster_secret {
            kvrail::agent::ClusterSecret::new(k.as_bytes())
                .map_err(|e| format!("--cluster-secret: {e}"))?;
        }
        if self.min_tokens > self.max_tokens {
            return Err(format!(
                "--min-tokens {} is over --max-tokens {}",
                self.min_tokens, self.max_tokens
            ));
        }
        Ok(())
    }
}

fn main() -> std::process::ExitCode {
    if let Some(code) = cli::generate_if_asked(<Args as clap::CommandFactory>::command()) {
        return code;
    }
    let a = Args::parse();
    logging::init(&a.log);
    if let Err(e) = a.validate() {
        eprintln!("kvrail-demo: {e}");
        std::process::exit(2);
    }
    if let Some(Sub::FakeKv { seed, tokens, out }) = &a.instance {
        let s = shape(&a);
        let toks = model::tokens(*seed, *tokens);
        let blocks = (*tokens as usize).div_ceil(s.block_size);
        let mut bytes = Vec::new();
        for layer in 0..s.layers {
            for plane in 0..2 {
                for bi in 0..blocks {
                    bytes.extend(model::block(&s, &toks, layer, plane, bi));
                }
            }
        }
        if let Err(e) = std::fs::write(out, &bytes) {
            eprintln!("{}: {e}", out.display());
            std::process::exit(1);
        }
        return std::process::ExitCode::SUCCESS;
    }
    if let Some(Sub::Instance {
        name,
        kv_config,
        devices,
    }) = &a.instance
    {
        let inst = engine::Instance {
            name: name.clone(),
            kv_config: kv_config.clone(),
            backend: backend(a.backend),
            devices: devices
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            shape: shape(&a),
            step_tokens: a.step_tokens,
        };
        if let Err(e) = engine::serve(inst) {
            eprintln!("{name}: {e}");
            std::process::exit(1);
        }
        return std::process::ExitCode::SUCCESS;
    }
    if a.soak {
        if let Err(e) = soak::run(&a) {
            eprintln!("kvrail-demo: FAILED: {e}");
            std::process::exit(1);
        }
        return std::process::ExitCode::SUCCESS;
    }
    let res = (|| {
        let mut p = spawn(&a, "prefill-0", "kv_producer", a.devices_of(true))?;
        let mut d = spawn(&a, "decode-0", "kv_consumer", a.devices_of(false))?;
        let s = shape(&a);
        outln!(
            "kvrail-demo: {:?} mode, P on {}, D on {}; model {} layers x 8 KV heads x 128, fp16, block size {}; lease {} s",
            a.mode, p.backend, d.backend, s.layers, s.block_size, a.lease
        );
        outln!("{}", metadata_line(&a));
        let r = match a.kill {
            None => run(&a, &mut p, &mut d),
            Some(Kill::D) => kill_d(&a, &mut p, &mut d),
            Some(Kill::P) => kill_p(&a, &mut p, &mut d),
        };
        for i in [&mut p, &mut d] {
            let _ = i.send(json!({"cmd": "quit"}));
            let _ = i.child.wait();
        }
        r
    })();
    if let Err(e) = res {
        eprintln!("kvrail-demo: FAILED: {e}");
        std::process::exit(1);
    }
    std::process::ExitCode::SUCCESS
}
