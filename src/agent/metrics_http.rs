//! The Prometheus endpoint (`AgentConfig::metrics_listen`): `GET /metrics` answers the
//! agent's registry in the text exposition format (0.0.4), one request per connection.
//! A thread blocked in `accept`; dropping the [`Endpoint`] (with the agent) wakes and ends
//! it. Requests are bounded (8 KiB, 2 s); anything but `GET /metrics` gets 404 or 405.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::metrics::Registry;

const MAX_REQUEST: usize = 8 << 10;

/// A running endpoint.
pub(crate) struct Endpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Endpoint {
    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // wake the accept; a wildcard address is reached through loopback
        let mut at = self.addr;
        if at.ip().is_unspecified() {
            at.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&at, Duration::from_millis(200));
    }
}

/// Listen on `at` and answer scrapes of `registry` until the endpoint is dropped.
pub(crate) fn serve(at: SocketAddr, registry: Weak<Registry>) -> std::io::Result<Endpoint> {
    let l = TcpListener::bind(at)?;
    let addr = l.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    crate::threads::spawn("kvrail-metrics", move || {
        for c in l.incoming() {
            if s.load(Ordering::Acquire) {
                return;
            }
            let Ok(c) = c else { continue };
            let Some(r) = registry.upgrade() else { return };
            if let Err(e) = answer(c, &r) {
                tracing::debug!(error = %e, "metrics request not answered");
            }
        }
    })?;
    Ok(Endpoint { addr, stop })
}

fn answer(mut c: TcpStream, r: &Registry) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    c.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < MAX_REQUEST {
        let n = c.read(&mut buf)?;
        if n == 0 {
            break;
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = req.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            r.render_prometheus(),
        ),
        ("GET", _) => ("404 Not Found", "text/plain", "try /metrics\n".to_owned()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics only\n".to_owned(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes())?;
    c.write_all(body.as_bytes())?;
    c.flush()
}
