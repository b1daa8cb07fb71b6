//! Two ends of one lab rail opened through kvrail's verbs layer alone (no agent), for the
//! verbs-level tools (`kvrail-verbs-bw`, `kvrail-verbs-lat`): one device context, PD, CQ
//! and RC queue pair per end, connected to each other, in this process.

use kvrail::transport::verbs::{ConnectOptions, Context, Cq, Pd, Qp, QpOptions};

/// One end: its device context, protection domain, completion queue and queue pair.
pub(crate) struct Side {
    _ctx: Context,
    pub(crate) pd: Pd,
    pub(crate) cq: Cq,
    pub(crate) qp: Qp,
}

/// Queue sizes and inline data of both ends' queue pairs.
pub(crate) struct Shape {
    pub(crate) send: u32,
    pub(crate) recv: u32,
    pub(crate) inline: u32,
}

fn open(dev: &str, port: u8, shape: &Shape) -> Result<Side, String> {
    let ctx = Context::open(dev).map_err(|e| e.to_string())?;
    let gid = ctx.choose_gid(port, None).map_err(|e| e.to_string())?;
    eprintln!("# {dev} port {port}: {}", gid.reason);
    let pd = Pd::new(&ctx).map_err(|e| e.to_string())?;
    let cq = Cq::new(&ctx, (shape.send + shape.recv) * 2 + 16).map_err(|e| e.to_string())?;
    let mut o = QpOptions::new(port, gid.index);
    o.max_send_wr = shape.send;
    o.max_recv_wr = shape.recv;
    o.max_inline_data = shape.inline;
    let qp = Qp::new(&pd, &cq, &cq, &o).map_err(|e| e.to_string())?;
    Ok(Side {
        _ctx: ctx,
        pd,
        cq,
        qp,
    })
}

fn lab_dev(var: &str, rail: usize) -> Option<String> {
    std::env::var(var)
        .ok()?
        .split_whitespace()
        .nth(rail)
        .map(str::to_owned)
}

/// The devices and port of both ends, as the verbs-level tools take them.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PairArgs {
    /// Initiator device (default: the lab's host A device of --rail).
    #[arg(long)]
    pub(crate) dev_a: Option<String>,
    /// The other end's device (default: the lab's host B device of --rail).
    #[arg(long)]
    pub(crate) dev_b: Option<String>,
    /// Lab rail whose devices to use when --dev-a/--dev-b are not given.
    #[arg(long, default_value_t = 0)]
    pub(crate) rail: usize,
    /// Port on both devices.
    #[arg(long, default_value_t = 1)]
    pub(crate) port: u8,
}

impl PairArgs {
    /// The devices of both ends: as given, else the lab's host A and B devices of `rail`.
    pub(crate) fn devices(&self) -> Result<(String, String), String> {
        let a = (self.dev_a.clone())
            .or_else(|| lab_dev("LAB_A_DEVS", self.rail))
            .ok_or("no --dev-a and no lab topology")?;
        let b = (self.dev_b.clone())
            .or_else(|| lab_dev("LAB_B_DEVS", self.rail))
            .ok_or("no --dev-b and no lab topology")?;
        Ok((a, b))
    }
}

/// Open both ends and connect their queue pairs to each other.
pub(crate) fn connect(
    dev_a: &str,
    dev_b: &str,
    port: u8,
    shape: &Shape,
) -> Result<(Side, Side), String> {
    let (a, b) = (open(dev_a, port, shape)?, open(dev_b, port, shape)?);
    a.qp.connect(&b.qp.endpoint(), &ConnectOptions::default())
        .map_err(|e| e.to_string())?;
    b.qp.connect(&a.qp.endpoint(), &ConnectOptions::default())
        .map_err(|e| e.to_string())?;
    Ok((a, b))
}

/// A verbs tool's exit: 0 when `res` is Ok, else its error on stderr (named `tool`) and 1.
pub(crate) fn exit(tool: &str, res: Result<(), String>) -> std::process::ExitCode {
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{tool}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The bytes of test pattern `seed` (every byte depends on the seed and its offset).
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            ((i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ i as u8
        })
        .collect()
}
