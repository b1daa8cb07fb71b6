//! Exit statuses of `kvrail-rails`, each distinct (documented in `--help` and the README):
//! 0 success; 1 nothing usable (list, explain, gids: no usable port among those asked
//! about; probe: a pair failed); 2 usage (clap's, and argument values that do not parse);
//! 3 runtime error (discovery, sysfs, the network, the peer); 4 no such device or port.

use std::process::ExitCode;

/// No usable port among those asked about, or a probed pair failed.
pub(crate) const NOTHING_USABLE: u8 = 1;
/// The command line is wrong.
pub(crate) const USAGE: u8 = 2;
/// Something failed while running.
pub(crate) const RUNTIME: u8 = 3;
/// A named device or port does not exist.
pub(crate) const NOT_FOUND: u8 = 4;

/// A failed subcommand: its exit status and message.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) code: u8,
    pub(crate) msg: String,
}

impl Fail {
    pub(crate) fn usage(msg: impl Into<String>) -> Self {
        Self {
            code: USAGE,
            msg: msg.into(),
        }
    }

    pub(crate) fn not_found(msg: impl Into<String>) -> Self {
        Self {
            code: NOT_FOUND,
            msg: msg.into(),
        }
    }
}

/// Any other error is a runtime error.
impl From<String> for Fail {
    fn from(msg: String) -> Self {
        Self { code: RUNTIME, msg }
    }
}

/// 0, or 1 when nothing is usable.
pub(crate) fn usable(any: bool) -> ExitCode {
    if any {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(NOTHING_USABLE)
    }
}

/// `DEV`, `DEV/PORT` (as rdma(8) writes it) or `DEV:PORT` (the older form).
pub(crate) fn dev_port(target: &str) -> Result<(&str, Option<u8>), Fail> {
    match target.split_once(['/', ':']) {
        Some((d, p)) => p
            .parse::<u8>()
            .map(|p| (d, Some(p)))
            .map_err(|_| Fail::usage(format!("{target:?}: port must be a number"))),
        None => Ok((target, None)),
    }
}
