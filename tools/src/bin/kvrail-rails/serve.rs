//! `kvrail-rails serve`: the peer end of `probe`.

use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;

use kvrail::rails::Verdict;
use kvrail::transport::verbs::{Access, Context, Cq, Mr, Pd, Qp, QpOptions};

use super::probe::probe_connect_options;
use super::wire::{Channel, PortDesc, Request, Response, VERSION};
use super::HostArgs;

pub(crate) fn port_descs(v: &[Verdict]) -> Vec<PortDesc> {
    v.iter()
        .map(|v| PortDesc {
            name: v.port.name(),
            ipv4: v.port.ipv4.iter().map(|a| a.to_string()).collect(),
            usable: v.usable(),
            verdict: v.summary(),
        })
        .collect()
}

pub(crate) fn run(host: &HostArgs, listen: &str) -> Result<ExitCode, super::fail::Fail> {
    host.verdicts()?; // fail early on a bad root or device list
    let l = TcpListener::bind(listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    outln!(
        "kvrail-rails serve: listening on {}",
        l.local_addr().map_err(|e| e.to_string())?
    );
    for conn in l.incoming() {
        let Ok(conn) = conn else { continue };
        let host = host.clone();
        std::thread::spawn(move || {
            let who = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            if let Err(e) = session(&host, conn) {
                eprintln!("kvrail-rails serve: prober {who}: {e}");
            }
        });
    }
    Ok(ExitCode::SUCCESS)
}

struct Opened {
    _mr: Mr,
    _cq: Cq,
    qp: Qp,
    _pd: Pd,
}

fn session(host: &HostArgs, s: TcpStream) -> Result<(), String> {
    let mut ch = Channel::new(s).map_err(|e| e.to_string())?;
    let mut verdicts = Vec::new();
    let mut open: Option<Opened> = None;
    while let Some(req) = ch.recv::<Request>()? {
        let resp = match req {
            Request::Hello { version } if version != VERSION => Response::Error {
                message: format!("protocol version {version}, this side speaks {VERSION}"),
            },
            Request::Hello { .. } => match host.verdicts() {
                Ok((_, v)) => {
                    verdicts = v;
                    Response::Hello {
                        version: VERSION,
                        ports: port_descs(&verdicts),
                    }
                }
                Err(f) => Response::Error { message: f.msg },
            },
            Request::Open { name, size } => match open_port(&verdicts, &name, size) {
                Ok((o, resp)) => {
                    open = Some(o);
                    resp
                }
                Err(message) => Response::Error { message },
            },
            Request::Connect { endpoint } => match &open {
                None => Response::Error {
                    message: "connect before open".into(),
                },
                Some(o) => match o.qp.connect(&endpoint, &probe_connect_options()) {
                    Ok(()) => Response::Connected,
                    Err(e) => Response::Error {
                        message: e.to_string(),
                    },
                },
            },
        };
        ch.send(&resp)?;
    }
    Ok(())
}

fn open_port(verdicts: &[Verdict], name: &str, size: usize) -> Result<(Opened, Response), String> {
    const MAX: usize = 64 << 20;
    if size == 0 || size > MAX {
        return Err(format!("region size {size} outside 1..={MAX}"));
    }
    let v = verdicts
        .iter()
        .find(|v| v.port.name() == name)
        .ok_or_else(|| format!("no port {name} here"))?;
    let gid = v
        .gid
        .as_ref()
        .ok_or_else(|| format!("{name}: {}", v.summary()))?;
    let e = |e: kvrail::transport::verbs::Error| e.to_string();
    let ctx = Context::open(&v.port.device).map_err(e)?;
    let pd = Pd::new(&ctx).map_err(e)?;
    let mr = Mr::alloc(&pd, size, Access::REMOTE_READ | Access::REMOTE_WRITE).map_err(e)?;
    let cq = Cq::new(&ctx, 64).map_err(e)?;
    let mut o = QpOptions::new(v.port.port, gid.index);
    o.max_send_wr = 16;
    o.max_recv_wr = 16;
    let qp = Qp::new(&pd, &cq, &cq, &o).map_err(e)?;
    let resp = Response::Opened {
        endpoint: qp.endpoint(),
        region: mr.remote(),
    };
    Ok((
        Opened {
            _mr: mr,
            _cq: cq,
            qp,
            _pd: pd,
        },
        resp,
    ))
}
