//! Errors of the side channel's handshake steps, and reading a peer's answer to one.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::msg::{self, Msg, Reader};
use crate::agent::error::AgentError;

/// How long a handshake step waits for the peer's answer.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection error: `what` failed with the peer at `addr`.
pub(crate) fn conn_err(what: &'static str, addr: SocketAddr, message: impl ToString) -> AgentError {
    AgentError::Connection {
        what,
        addr: addr.to_string(),
        message: message.to_string(),
    }
}

/// A handshake read's error, a timeout said with its bound (a silent listener that is not
/// a kvrail agent, or one that hangs).
pub(super) fn no_answer(e: String) -> String {
    if e == msg::TIMED_OUT {
        format!(
            "timed out after {} s without an answer (is a kvrail agent listening there?)",
            HANDSHAKE_TIMEOUT.as_secs()
        )
    } else {
        e
    }
}

/// The peer's answer to one step of the attach handshake: `want` takes the expected
/// message (or hands it back); `Refused` and anything else are errors naming the step.
pub(crate) fn expect_reply<T>(
    reader: &mut Reader<TcpStream>,
    addr: SocketAddr,
    step: &'static str,
    refused: &'static str,
    want: impl FnOnce(Msg) -> Result<T, Msg>,
) -> Result<T, AgentError> {
    match reader.next() {
        Ok(Some(Msg::Refused { message })) => Err(conn_err(refused, addr, message)),
        Ok(Some(m)) => want(m)
            .map_err(|other| conn_err(step, addr, format!("unexpected reply {:?}", Some(other)))),
        Ok(None) => Err(conn_err(step, addr, "unexpected reply None")),
        Err(e) => Err(conn_err(step, addr, no_answer(e))),
    }
}
