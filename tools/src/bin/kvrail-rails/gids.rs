//! `kvrail-rails gids [DEV[/PORT]]`: every GID table entry, the way `show_gids` prints it
//! (device, port, index, GID, IPv4, RoCE version, netdev), with the entry kvrail's queue
//! pairs use marked.

use std::fmt::Write as _;
use std::process::ExitCode;

use kvrail::rails::gid::{Gid, GidType};
use kvrail::rails::Verdict;
use serde::Serialize;

use super::fail::{dev_port, usable, Fail};
use super::HostArgs;

/// One row of `gids --json`.
#[derive(Serialize, Debug, PartialEq, Eq)]
pub(crate) struct GidRow {
    pub(crate) device: String,
    pub(crate) port: u8,
    pub(crate) index: u32,
    pub(crate) gid: String,
    pub(crate) ipv4: Option<String>,
    /// `v1`, `v2` (RoCE) or `IB`.
    pub(crate) version: &'static str,
    pub(crate) netdev: Option<String>,
    /// kvrail's queue pairs on this port use this entry.
    pub(crate) chosen: bool,
}

/// The GID as sysfs and `show_gids` write it: eight groups of four hex digits.
fn sysfs_form(g: &Gid) -> String {
    let groups: Vec<String> = (g.0.chunks(2))
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect();
    groups.join(":")
}

fn rows(verdicts: &[&Verdict]) -> Vec<GidRow> {
    let mut out = Vec::new();
    for v in verdicts {
        let p = &v.port;
        for g in &p.gids {
            out.push(GidRow {
                device: p.device.clone(),
                port: p.port,
                index: g.index,
                gid: sysfs_form(&g.gid),
                ipv4: g.gid.ipv4().map(|ip| ip.to_string()),
                version: match g.gid_type {
                    GidType::RoceV2 => "v2",
                    GidType::RoceV1 => "v1",
                    GidType::Ib => "IB",
                },
                netdev: p.gid_ndevs.get(&g.index).cloned(),
                chosen: v.gid.as_ref().is_some_and(|c| c.index == g.index),
            });
        }
    }
    out
}

/// Exit status: 0 when an entry is chosen on some port asked about, 1 when none is.
pub(crate) fn run(host: &HostArgs, target: Option<&str>, json: bool) -> Result<ExitCode, Fail> {
    let (_, verdicts) = host.verdicts()?;
    let picked: Vec<&Verdict> = match target {
        None => verdicts.iter().collect(),
        Some(t) => {
            let (dev, port) = dev_port(t)?;
            let v: Vec<&Verdict> = (verdicts.iter())
                .filter(|v| v.port.device == dev && port.is_none_or(|p| v.port.port == p))
                .collect();
            if v.is_empty() {
                return Err(Fail::not_found(format!("no RDMA port {t}")));
            }
            v
        }
    };
    let rows = rows(&picked);
    let status = usable(rows.iter().any(|r| r.chosen));
    if json {
        let s = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
        outln!("{s}");
        return Ok(status);
    }
    let mut t = String::new();
    let mut line = |l: String| {
        let _ = writeln!(t, "{}", l.trim_end());
    };
    line(format!(
        "{:<10} {:<4} {:<5} {:<39} {:<15} {:<3} {:<10}",
        "DEV", "PORT", "INDEX", "GID", "IPv4", "VER", "NETDEV"
    ));
    line("-".repeat(93));
    for r in &rows {
        line(format!(
            "{:<10} {:<4} {:<5} {:<39} {:<15} {:<3} {:<10}{}",
            r.device,
            r.port,
            r.index,
            r.gid,
            r.ipv4.as_deref().unwrap_or(""),
            r.version,
            r.netdev.as_deref().unwrap_or(""),
            if r.chosen { " *" } else { "" }
        ));
    }
    line(format!(
        "n_gids_found={} (* = the entry kvrail's queue pairs use)",
        rows.len()
    ));
    out!("{t}");
    Ok(status)
}
