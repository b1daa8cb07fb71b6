//! Every tool's log output: kvrail's `tracing` events on stderr, filtered by `RUST_LOG` when
//! set, else by `-v` (info, `-vv` debug, `-vvv` trace) or `-q` (errors only; default:
//! warnings), as text or (`--log-json`) one JSON object per line. kvrail-perf keeps `-q` for
//! perftest's meaning (queue pairs) and takes `--quiet` long only ([`PerfLogArgs`]).

use tracing_subscriber::EnvFilter;

/// The log flags of every tool.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct LogArgs {
    /// More log output on stderr: -v info, -vv debug, -vvv trace (RUST_LOG overrides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Log errors only.
    #[arg(short = 'q', long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Log lines as JSON objects (fields as keys).
    #[arg(long, global = true)]
    log_json: bool,
}

/// The log flags where `-q` means something else (kvrail-perf: perftest's queue pairs).
#[derive(clap::Args, Debug, Clone, Default)]
#[allow(dead_code)] // each tool uses one of the two
pub(crate) struct PerfLogArgs {
    /// More log output on stderr: -v info, -vv debug, -vvv trace (RUST_LOG overrides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Log errors only.
    #[arg(long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Log lines as JSON objects (fields as keys).
    #[arg(long, global = true)]
    log_json: bool,
}

#[allow(dead_code)] // each tool uses one of the two
impl From<&PerfLogArgs> for LogArgs {
    fn from(a: &PerfLogArgs) -> Self {
        Self {
            verbose: a.verbose,
            quiet: a.quiet,
            log_json: a.log_json,
        }
    }
}

/// Install the subscriber (once, at start).
pub(crate) fn init(a: &LogArgs) {
    let level = match (a.quiet, a.verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "info",
        (false, 2) => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let res = if a.log_json {
        fmt.json().try_init()
    } else {
        fmt.try_init()
    };
    if let Err(e) = res {
        eprintln!("logging: {e}");
    }
}
