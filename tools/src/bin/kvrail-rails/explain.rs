//! `kvrail-rails explain DEV[:PORT]`.

use std::process::ExitCode;

use super::fail::{dev_port, usable, Fail};
use super::list::Row;
use super::HostArgs;

/// Exit status: 0 when a port asked about is usable, 1 when none is.
pub(crate) fn run(host: &HostArgs, target: &str, json: bool) -> Result<ExitCode, Fail> {
    let (dev, port) = dev_port(target)?;
    let (numa, verdicts) = host.verdicts()?;
    let all: Vec<String> = verdicts.iter().map(|v| v.port.name()).collect();
    let picked: Vec<_> = verdicts
        .iter()
        .filter(|v| v.port.device == dev && port.is_none_or(|p| v.port.port == p))
        .collect();
    if picked.is_empty() {
        return Err(Fail::not_found(format!(
            "no RDMA port {target} (ports: {})",
            if all.is_empty() {
                "none".into()
            } else {
                all.join(", ")
            }
        )));
    }
    let status = usable(picked.iter().any(|v| v.usable()));
    if json {
        let rows: Vec<Row<'_>> = (picked.iter())
            .map(|v| Row {
                usable: v.usable(),
                verdict: v,
            })
            .collect();
        let s = serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?;
        outln!("{s}");
        return Ok(status);
    }
    let node = if numa < 0 {
        "any NUMA node".to_string()
    } else {
        format!("NUMA node {numa}")
    };
    for v in picked {
        let p = &v.port;
        let nd = p
            .netdev
            .as_ref()
            .map(|n| format!(", netdev {n}"))
            .unwrap_or_default();
        let link = |p: &kvrail::rails::PortInfo| {
            if let Some(ph) = &p.phys_state {
                let mtu = p
                    .active_mtu
                    .map(|m| format!(", active MTU {m}"))
                    .unwrap_or_default();
                outln!("  link: port {}, physical {ph}{mtu}", p.state);
            }
        };
        if v.usable() {
            outln!("{}{nd}: USABLE as a data-plane rail for {node}", p.name());
            link(p);
            if let Some(g) = &v.gid {
                outln!("  queue pairs use {}", g.reason);
            }
        } else {
            outln!("{}{nd}: NOT USABLE for {node}:", p.name());
            link(p);
            for r in &v.reasons {
                outln!("  - {r}");
                outln!("    check: {}", r.check_command(p));
            }
        }
        for n in &v.notes {
            outln!("  note: {n}");
        }
    }
    Ok(status)
}
