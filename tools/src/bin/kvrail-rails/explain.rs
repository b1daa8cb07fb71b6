//! `kvrail-rails explain DEV[:PORT]`.

use std::process::ExitCode;

use super::HostArgs;

pub(crate) fn run(host: &HostArgs, target: &str) -> Result<ExitCode, String> {
    // DEV/PORT as rdma(8) writes it, or DEV:PORT
    let (dev, port) = match target.split_once(['/', ':']) {
        Some((d, p)) => (
            d,
            Some(
                p.parse::<u8>()
                    .map_err(|_| format!("{target:?}: port must be a number"))?,
            ),
        ),
        None => (target, None),
    };
    let (numa, verdicts) = host.verdicts()?;
    let all: Vec<String> = verdicts.iter().map(|v| v.port.name()).collect();
    let picked: Vec<_> = verdicts
        .iter()
        .filter(|v| v.port.device == dev && port.is_none_or(|p| v.port.port == p))
        .collect();
    if picked.is_empty() {
        return Err(format!(
            "no RDMA port {target} (ports: {})",
            if all.is_empty() {
                "none".into()
            } else {
                all.join(", ")
            }
        ));
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
        if v.usable() {
            println!("{}{nd}: USABLE as a data-plane rail for {node}", p.name());
            if let Some(g) = &v.gid {
                println!("  queue pairs use {}", g.reason);
            }
        } else {
            println!("{}{nd}: NOT USABLE for {node}:", p.name());
            for r in &v.reasons {
                println!("  - {r}");
                println!("    check: {}", r.check_command(p));
            }
        }
        for n in &v.notes {
            println!("  note: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
