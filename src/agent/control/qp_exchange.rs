//! Queue pairs exchanged over the control channel: the initiator
//! opens one queue pair per paired rail and the notification channel while attaching to a
//! peer; the target answers `QpOpen` and `ChanOpen` with its endpoints (or a refusal). The
//! control channel carries the messages; the verbs lanes make and keep the queue pairs.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};

use super::msg::{send, Msg, Reader};
use super::reply::{conn_err, expect_reply};
use super::Host;
use crate::agent::error::AgentError;
use crate::agent::metadata::{AgentMetadata, BackendKind};
use crate::agent::verbs::{chan_connect_options, Verbs};
use crate::transport::notif::FRAME_FORMAT;
use crate::transport::verbs::{Access, ConnectOptions, Endpoint, Qp};

/// Initiator, while attaching: one queue pair per paired rail (endpoints exchanged on the
/// attach connection), then the notification channel on the first pair. Nothing to do
/// unless both sides run verbs.
pub(crate) fn open_qps(
    shared: &dyn Host,
    w: &mut TcpStream,
    reader: &mut Reader<TcpStream>,
    (addr, peer): (SocketAddr, &str),
    meta: &AgentMetadata,
) -> Result<(), AgentError> {
    let Some(v) = shared.verbs() else {
        return Ok(());
    };
    if meta.backend != BackendKind::Verbs {
        return Ok(());
    }
    let mut qps = Vec::new();
    let mut req = Vec::new();
    for (mine, theirs) in v.pairs_with(meta) {
        let qp = v.new_qp(mine, Access::NONE)?;
        req.push((mine as u32, theirs as u32, qp.endpoint()));
        qps.push((mine, theirs, qp));
    }
    let step = "queue pair exchange with";
    send(w, &Msg::QpOpen { pairs: req }).map_err(|e| conn_err(step, addr, e))?;
    let eps = expect_reply(
        reader,
        addr,
        step,
        "peer could not open queue pairs at",
        |m| match m {
            Msg::QpOpened { endpoints } if endpoints.len() == qps.len() => Ok(endpoints),
            m => Err(m),
        },
    )?;
    for ((rail, _, qp), ep) in qps.iter().zip(&eps) {
        qp.connect(ep, &ConnectOptions::default()).map_err(|e| {
            let why = format!("{}: {e}", v.rails[*rail].name);
            conn_err("connecting the queue pair on", addr, why)
        })?;
    }
    tracing::info!(agent = %shared.name, peer, pairs = qps.len(), "verbs queue pairs connected");
    let first = qps.first().map(|(mine, theirs, _)| (*mine, *theirs));
    v.add_peer(peer, qps);
    if let Some(pair) = first {
        open_chan(v, w, reader, (addr, peer), pair)?;
    }
    Ok(())
}

/// Initiator: the notification channel to the peer, on rail pair `(mine, theirs)`.
fn open_chan(
    v: &Verbs,
    w: &mut TcpStream,
    reader: &mut Reader<TcpStream>,
    (addr, peer): (SocketAddr, &str),
    (mine, theirs): (usize, usize),
) -> Result<(), AgentError> {
    let step = "notification channel to";
    let (qp, ch) = v.new_chan(mine).map_err(|e| conn_err(step, addr, e))?;
    let rail = theirs as u32;
    send(
        w,
        &Msg::ChanOpen {
            rail,
            ep: qp.endpoint(),
            frames: FRAME_FORMAT,
        },
    )
    .map_err(|e| conn_err(step, addr, e))?;
    let (ep, frames) =
        expect_reply(
            reader,
            addr,
            step,
            "notification channel refused by",
            |m| match m {
                Msg::ChanOpened { ep, frames } => Ok((ep, frames)),
                m => Err(m),
            },
        )?;
    frames_agree(frames).map_err(|e| conn_err(step, addr, e))?;
    qp.connect(&ep, &chan_connect_options())
        .map_err(|e| conn_err(step, addr, e))?;
    v.add_out_chan(peer, mine, &qp, ch);
    Ok(())
}

/// Whether a peer's notification frames (layout `theirs`) are laid out as ours (see
/// [`FRAME_FORMAT`]); if not, why a channel must not open.
pub(crate) fn frames_agree(theirs: u8) -> Result<(), String> {
    if theirs == FRAME_FORMAT {
        return Ok(());
    }
    Err(format!(
        "notification frames of layout {theirs} there and {FRAME_FORMAT} here: \
         a channel between these kvrail builds would lose notifications; run one build on both"
    ))
}

/// Target: the queue pairs one attached initiator asked for; they live as long as its
/// connection, and a rebuilt one replaces the old one of its initiator rail.
#[derive(Default)]
pub(crate) struct TargetQps {
    qps: HashMap<u32, Qp>,
}

impl TargetQps {
    /// Answer a control message about queue pairs from initiator `from` on connection
    /// `conn`; `None` when `m` is not one.
    pub(crate) fn answer(
        &mut self,
        shared: &dyn Host,
        conn: u64,
        from: &str,
        m: &Msg,
    ) -> Option<Msg> {
        let tcp = || Msg::Refused {
            message: "this agent runs on TCP".into(),
        };
        Some(match m {
            Msg::ChanOpen { rail, ep, frames } => match shared.verbs() {
                None => tcp(),
                Some(v) => match frames_agree(*frames)
                    .and_then(|()| v.accept_chan(conn, from, *rail, ep))
                {
                    Ok(ep) => Msg::ChanOpened {
                        ep,
                        frames: FRAME_FORMAT,
                    },
                    Err(message) => Msg::Refused { message },
                },
            },
            Msg::QpOpen { pairs } => match shared.verbs() {
                None => tcp(),
                Some(v) => match open_target_qps(v, pairs) {
                    Ok((new, endpoints)) => {
                        self.qps.extend(pairs.iter().map(|p| p.0).zip(new));
                        Msg::QpOpened { endpoints }
                    }
                    Err(message) => Msg::Refused { message },
                },
            },
            _ => return None,
        })
    }
}

/// The target side: queue pairs the initiator asked for, connected to its endpoints.
fn open_target_qps(
    verbs: &Verbs,
    pairs: &[(u32, u32, Endpoint)],
) -> Result<(Vec<Qp>, Vec<Endpoint>), String> {
    let mut qps = Vec::new();
    let mut eps = Vec::new();
    for &(_, mine, ep) in pairs {
        let rail = mine as usize;
        if rail >= verbs.rails.len() {
            return Err(format!("no rail {rail} here"));
        }
        let qp = verbs
            .new_qp(rail, Access::REMOTE_READ | Access::REMOTE_WRITE)
            .map_err(|e| e.to_string())?;
        qp.connect(&ep, &ConnectOptions::default())
            .map_err(|e| e.to_string())?;
        eps.push(qp.endpoint());
        qps.push(qp);
    }
    Ok((qps, eps))
}
