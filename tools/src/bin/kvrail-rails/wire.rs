//! The serve/probe side channel: one JSON object per line over TCP, lines bounded in size;
//! anything else is an error, never a panic.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use kvrail::transport::verbs::{Endpoint, RemoteRegion};
use serde::{Deserialize, Serialize};

/// Protocol version; both sides must agree.
pub(crate) const VERSION: u32 = 1;
/// Longest line accepted.
const MAX_LINE: u64 = 64 * 1024;

/// A port as one side describes it to the other.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PortDesc {
    /// `device:port`.
    pub(crate) name: String,
    /// IPv4 addresses with prefix (`a.b.c.d/p`).
    pub(crate) ipv4: Vec<String>,
    /// The verdict: usable or not.
    pub(crate) usable: bool,
    /// `usable` or the reasons.
    pub(crate) verdict: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum Request {
    Hello {
        version: u32,
    },
    /// Create a region of `size` bytes and a QP on port `name`.
    Open {
        name: String,
        size: usize,
    },
    Connect {
        endpoint: Endpoint,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub(crate) enum Response {
    Hello {
        version: u32,
        ports: Vec<PortDesc>,
    },
    Opened {
        endpoint: Endpoint,
        region: RemoteRegion,
    },
    Connected,
    Error {
        message: String,
    },
}

/// One end of the side channel.
pub(crate) struct Channel {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Channel {
    pub(crate) fn new(s: TcpStream) -> std::io::Result<Self> {
        Ok(Self {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        })
    }

    pub(crate) fn send<T: Serialize>(&mut self, m: &T) -> Result<(), String> {
        let mut line = serde_json::to_string(m).map_err(|e| e.to_string())?;
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .map_err(|e| format!("side channel write: {e}"))
    }

    /// The next message; `Ok(None)` at a clean end of stream.
    pub(crate) fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> Result<Option<T>, String> {
        let mut buf = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| format!("side channel read: {e}"))?;
        if n == 0 {
            return Ok(None);
        }
        if buf.last() != Some(&b'\n') {
            return Err(if n as u64 > MAX_LINE {
                format!("side channel message longer than {MAX_LINE} bytes")
            } else {
                "side channel closed mid-message".into()
            });
        }
        serde_json::from_slice(&buf)
            .map(Some)
            .map_err(|e| format!("malformed side channel message: {e}"))
    }
}
