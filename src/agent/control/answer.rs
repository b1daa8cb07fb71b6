//! The handling of one answer from the target on a peer connection: an Ack, a Fail, a
//! READ's bytes, or the verbs set-up's replies. The connection's reader thread (`io`) and a
//! caller driving the connection itself (`driven`) both take answers through it.

use std::net::TcpStream;
use std::sync::mpsc;

use super::msg::{Msg, Reader};
use super::Host;
use super::{lock, Work};
use crate::agent::error::XferError;
use crate::agent::table::Ack;

/// Handle one message from the target on `peer`'s connection; `Err` ends the connection
/// with its reason.
pub(super) fn answer(
    shared: &dyn Host,
    tx: Option<&mpsc::Sender<Work>>,
    peer: &str,
    m: Msg,
    r: &mut Reader<TcpStream>,
) -> Result<(), String> {
    // answers are taken only about transfers posted on this connection: another peer
    // must not complete, fail or fill this one's (its ids are guessable)
    if let Msg::Ack { xfer } | Msg::Fail { xfer, .. } | Msg::ReadData { xfer, .. } = &m {
        if lock(&shared.xfers).belongs_elsewhere(*xfer, peer) {
            return Err(format!(
                "protocol error: an answer about transfer {xfer}, which was not posted to {peer}"
            ));
        }
    }
    match m {
        Msg::Ack { xfer } => {
            let why = match lock(&shared.xfers).ack(xfer) {
                Ack::Stale => return Ok(()),
                Ack::Complete => None,
                Ack::NotAWrite => Some("an Ack for a READ (its bytes complete it)"),
                Ack::Early => Some("an Ack for a WRITE whose end was not sent yet"),
            };
            let Some(why) = why else {
                shared.finish(xfer, Ok(()));
                return Ok(());
            };
            // nothing after it on this connection can be trusted: the transfer fails as
            // the peer's protocol error, then the connection ends (failing the rest)
            let why = format!("protocol error: {peer} sent {why}, transfer {xfer}");
            shared.finish(xfer, Err(XferError::Protocol(why.clone())));
            return Err(why);
        }
        Msg::Fail { xfer, message } => {
            let e = match message.strip_prefix(crate::agent::grant::REVOKED) {
                Some(why) => XferError::GrantRevoked {
                    peer: peer.to_owned(),
                    why: why.to_owned(),
                },
                None => XferError::Peer {
                    peer: peer.to_owned(),
                    message,
                },
            };
            shared.finish(xfer, Err(e));
        }
        Msg::ReadData { xfer, idx, at, len } => {
            let tx = tx.ok_or("the connection's reader ended")?;
            crate::agent::tcp::on_read_data(shared, tx, peer, (xfer, idx, at, len), r)?;
        }
        #[cfg(feature = "verbs")]
        Msg::QpOpened { endpoints } => {
            if let Some(v) = shared.verbs() {
                v.rebuilt(peer, Ok(endpoints));
            }
        }
        #[cfg(feature = "verbs")]
        Msg::ChanOpened { ep, frames } => {
            if let Some(v) = shared.verbs() {
                let answer = super::qp_exchange::frames_agree(frames).map(|()| ep);
                v.chan_rebuilt(peer, answer);
            }
        }
        #[cfg(feature = "verbs")]
        Msg::Refused { message } => {
            if let Some(v) = shared.verbs() {
                v.rebuilt(peer, Err(message));
            }
        }
        other => return Err(format!("protocol error: unexpected {other:?}")),
    }
    Ok(())
}
