//! A fixed amount of descriptor work, for instruction counting under callgrind (a stable
//! proxy on noisy machines): `desc_cost MODE N` runs N rounds of MODE on 1,000 descriptors.
//! `tools/callgrind-cost.sh` runs it with N = 0 and N = 50 and prints the difference per
//! descriptor. MODE: `validate` (create_xfer + release against a peer's advertised regions,
//! including the caller's copies of the two lists it hands over), `lists` (those copies
//! alone: what `validate` costs the caller, not kvrail) or `plan` (stripe planning over two
//! rails, striped).

use kvrail::agent::{Agent, AgentConfig, BackendChoice, Desc, RemoteAccess, XferOp};
use kvrail::transport::stripe::{DescPair, Planner, StripeMode};

const DESCS: u64 = 1000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "validate".into());
    let n: u64 = args.next().unwrap_or_else(|| "10".into()).parse()?;
    match mode.as_str() {
        "validate" | "lists" => {
            let cfg = || AgentConfig {
                listen: "127.0.0.1:0".parse().expect("address"),
                backend: BackendChoice::Tcp,
                ..AgentConfig::default()
            };
            let p = Agent::new("p", cfg())?;
            let d = Agent::new("d", cfg())?;
            let src = p.register((DESCS * 4096) as usize, RemoteAccess::READ, vec![])?;
            let dst = d.register((DESCS * 4096) as usize, RemoteAccess::NONE, vec![])?;
            let peer = d.load_remote(p.side_channel_addr())?;
            let local: Vec<Desc> = (0..DESCS).map(|i| Desc::new(dst, i * 4096, 4096)).collect();
            let remote: Vec<Desc> = (0..DESCS).map(|i| Desc::new(src, i * 4096, 4096)).collect();
            let lists_only = mode == "lists";
            for _ in 0..n {
                let (l, r) = (local.clone(), remote.clone());
                if lists_only {
                    std::hint::black_box((l, r));
                    continue;
                }
                let x = d.create_xfer(XferOp::Read, l, &peer, r, None)?;
                d.release(x)?;
            }
        }
        "plan" => {
            let descs: Vec<DescPair> = (0..DESCS)
                .map(|i| DescPair {
                    local_region: 1,
                    local_off: i * 16384,
                    remote_region: 1,
                    remote_off: i * 16384,
                    len: 16384,
                })
                .collect();
            let mut p = Planner::new(2);
            for _ in 0..n {
                let plan = p
                    .plan(&descs, StripeMode::Striped)
                    .map_err(|e| e.to_string())?;
                for r in 0..2 {
                    p.release(r, plan.per_rail[r].iter().map(|s| s.len).sum());
                }
                std::hint::black_box(plan);
            }
        }
        other => return Err(format!("unknown mode {other}: validate or plan").into()),
    }
    Ok(())
}
