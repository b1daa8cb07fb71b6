//! `kvrail-rails`: which RDMA ports kvrail would use as rails, why the others are not
//! usable, and whether each pair of rails between two hosts really moves bytes.
//!
//! ```text
//! kvrail-rails list [--numa N | --accel BDF] [--devices D1,D2] [--json]
//! kvrail-rails explain DEV[/PORT] [--numa N | --accel BDF] [--json]
//! kvrail-rails gids [DEV[/PORT]] [--json]
//! kvrail-rails serve [--listen ADDR:PORT] [--devices ...]
//! kvrail-rails probe --peer HOST:PORT [--devices ...] [--all-pairs] [--json]
//! ```
//! Every subcommand takes `--sysfs-root DIR` (default `/`) so it runs on fixture trees.
//! Exit statuses: see [`fail`].

#[path = "../../cli.rs"]
mod cli;
#[macro_use]
#[path = "../../out.rs"]
mod out;
mod explain;
mod fail;
mod gids;
mod list;
#[path = "../../logging.rs"]
mod logging;
mod probe;
mod serve;
mod wire;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use fail::Fail;
use kvrail::rails::{discover, judge_all, pci_numa_node, AddrSource, SysfsRoot, Verdict};

#[derive(Parser, Debug)]
#[command(
    name = "kvrail-rails",
    version = cli::VERSION,
    about = "kvrail's rail diagnostics: list, explain, gids, serve, probe",
    after_help = concat!(
        "Examples:\n",
        "  kvrail-rails list --accel 0000:b1:00.0      # rails for the NPU at that PCI address\n",
        "  kvrail-rails explain mlx5_0/1 --numa 1      # why a port is (not) usable\n",
        "  kvrail-rails gids rxeA0                     # the GID table, kvrail's entry marked\n",
        "  kvrail-rails serve          # on host B, then on host A:\n",
        "  kvrail-rails probe --peer hostB:18515       # move bytes over every rail pair\n\n",
        "Exit status: 0 success; 1 nothing usable (no usable port among those asked about; ",
        "probe: a pair failed); 2 usage; 3 runtime error (discovery, sysfs, the network, the ",
        "peer); 4 no such device or port; 141 stdout closed."
    )
)]
struct Cli {
    #[command(flatten)]
    log: logging::LogArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// A table of every RDMA port with its verdict.
    List {
        #[command(flatten)]
        host: HostArgs,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Why a port is (not) usable, in plain words, with the command that checks each reason.
    Explain {
        /// DEVICE, DEVICE/PORT (as rdma(8) writes it) or DEVICE:PORT.
        target: String,
        /// Print JSON instead of the words.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        host: HostArgs,
    },
    /// Every GID table entry (index, GID, IPv4, RoCE version, netdev) like `show_gids`,
    /// with the entry kvrail's queue pairs use marked.
    Gids {
        /// DEVICE or DEVICE/PORT (default: every port).
        target: Option<String>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        host: HostArgs,
    },
    /// Answer probes from another host (one thread per prober).
    Serve {
        /// Address and port to listen on (the side channel).
        #[arg(long, default_value = "0.0.0.0:18515")]
        listen: String,
        #[command(flatten)]
        host: HostArgs,
    },
    /// Connect every pair of a local and a peer rail, move bytes, report per pair.
    Probe {
        /// The peer's `kvrail-rails serve` address.
        #[arg(long)]
        peer: String,
        /// Try every local × peer pair, not only those in the same IPv4 subnet.
        #[arg(long)]
        all_pairs: bool,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        host: HostArgs,
    },
}

/// Where to look and which NUMA node to judge for.
#[derive(Args, Debug, Clone)]
struct HostArgs {
    /// Root of the sysfs/procfs tree (fixture trees in tests).
    #[arg(long, default_value = "/")]
    sysfs_root: String,
    /// The accelerator's NUMA node (-1: any).
    #[arg(long, conflicts_with = "accel")]
    numa: Option<i32>,
    /// The accelerator's PCI address; its NUMA node is read from sysfs.
    #[arg(long)]
    accel: Option<String>,
    /// Only these RDMA devices (comma separated).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
}

impl HostArgs {
    fn root(&self) -> SysfsRoot {
        SysfsRoot::new(&self.sysfs_root)
    }

    fn numa(&self) -> Result<i32, Fail> {
        match (&self.accel, self.numa) {
            (Some(bdf), _) => Ok(pci_numa_node(&self.root(), bdf).map_err(|e| e.to_string())?),
            (None, Some(n)) => Ok(n),
            (None, None) => Ok(-1),
        }
    }

    /// The verdicts on the selected devices' ports.
    fn verdicts(&self) -> Result<(i32, Vec<Verdict>), Fail> {
        self.verdicts_in().map(|(n, v, _)| (n, v))
    }

    /// The verdicts, and where the devices were looked for.
    fn verdicts_in(&self) -> Result<(i32, Vec<Verdict>, String), Fail> {
        let root = self.root();
        let host = discover(&root, &AddrSource::for_root(&root))
            .map_err(|e| format!("discovery failed: {e}"))?;
        let numa = self.numa()?;
        let mut v = judge_all(&host, numa);
        if !self.devices.is_empty() {
            for d in &self.devices {
                if !v.iter().any(|v| &v.port.device == d) {
                    let e = format!("no RDMA device {d:?} under {}", host.searched);
                    return Err(Fail::not_found(e));
                }
            }
            v.retain(|v| self.devices.contains(&v.port.device));
        }
        Ok((numa, v, host.searched))
    }
}

fn main() -> ExitCode {
    if let Some(code) = cli::generate_if_asked(<Cli as clap::CommandFactory>::command()) {
        return code;
    }
    let cli = Cli::parse();
    logging::init(&cli.log);
    let res = match cli.cmd {
        Cmd::List { host, json } => list::run(&host, json),
        Cmd::Explain { target, json, host } => explain::run(&host, &target, json),
        Cmd::Gids { target, json, host } => gids::run(&host, target.as_deref(), json),
        Cmd::Serve { listen, host } => serve::run(&host, &listen),
        Cmd::Probe {
            peer,
            all_pairs,
            json,
            host,
        } => probe::run(&host, &peer, all_pairs, json),
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvrail-rails: {}", e.msg);
            ExitCode::from(e.code)
        }
    }
}
