//! `kvrail-rails list`.

use std::process::ExitCode;

use kvrail::rails::{RailError, Verdict};
use serde::Serialize;

use super::fail::{usable, Fail};
use super::HostArgs;

/// One row of `list --json`.
#[derive(Serialize)]
pub(crate) struct Row<'a> {
    pub(crate) usable: bool,
    #[serde(flatten)]
    pub(crate) verdict: &'a Verdict,
}

#[derive(Serialize)]
struct Listing<'a> {
    numa: i32,
    ports: Vec<Row<'a>>,
}

/// Exit status: 0 when some port is usable, 1 when none is (the listing says why).
pub(crate) fn run(host: &HostArgs, json: bool) -> Result<ExitCode, Fail> {
    let (numa, verdicts, searched) = host.verdicts_in()?;
    let status = usable(verdicts.iter().any(|v| v.usable()));
    if json {
        let l = Listing {
            numa,
            ports: verdicts
                .iter()
                .map(|v| Row {
                    usable: v.usable(),
                    verdict: v,
                })
                .collect(),
        };
        outln!(
            "{}",
            serde_json::to_string_pretty(&l).map_err(|e| e.to_string())?
        );
        return Ok(status);
    }
    out!("{}", table(numa, &verdicts));
    if !verdicts.iter().any(|v| v.usable()) {
        let e = RailError::NoUsableNic {
            numa,
            verdicts: verdicts.clone(),
            searched,
        };
        outln!("# {}", e.to_string().replace('\n', "\n#"));
    }
    Ok(status)
}

/// The text table (also used by tests through the binary).
pub(crate) fn table(numa: i32, verdicts: &[Verdict]) -> String {
    let mut rows = vec![[
        "DEVICE", "PORT", "STATE", "LINK", "MTU", "NETDEV", "IPV4", "NUMA", "GID", "VERDICT",
    ]
    .map(String::from)];
    for v in verdicts {
        let p = &v.port;
        rows.push([
            p.device.clone(),
            p.port.to_string(),
            p.state.clone(),
            p.link_layer.clone(),
            p.active_mtu.map_or("-".into(), |m| m.to_string()),
            p.netdev.clone().unwrap_or_else(|| "-".into()),
            if p.ipv4.is_empty() {
                "-".into()
            } else {
                p.ipv4
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            },
            p.numa_node.map_or("none".into(), |n| n.to_string()),
            v.gid
                .as_ref()
                .map_or("-".into(), |g| format!("{} {}", g.index, g.gid)),
            v.summary(),
        ]);
    }
    let widths: Vec<usize> = (0..9)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = format!(
        "# rails for NUMA node {}\n",
        if numa < 0 {
            "any (no accelerator node given)".to_string()
        } else {
            numa.to_string()
        }
    );
    for r in &rows {
        for (c, w) in widths.iter().enumerate() {
            out.push_str(&format!("{:<w$}  ", r[c], w = *w));
        }
        out.push_str(&r[9]);
        out.push('\n');
    }
    let usable = verdicts.iter().filter(|v| v.usable()).count();
    out.push_str(&format!(
        "# {usable} of {} port(s) usable\n",
        verdicts.len()
    ));
    out
}
