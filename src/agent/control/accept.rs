//! The listener: one mio event loop per agent accepts connections and reads each one's
//! first message under a deadline and a size bound. `GetMetadata` is answered from the loop
//! (the side channel never needs a thread per request); `Attach` hands the connection to a
//! thread of its own (a peer's data path), and so do `PutMetadata` and `Forget` (loading a
//! peer connects back to it); garbage, silence past [`FIRST_MESSAGE_TIMEOUT`]
//! and oversized frames close the connection with a log line. Nothing read from the network
//! can make the loop panic or grow without bound.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};

use super::auth::{self, Verdict};
use super::msg::Msg;
use super::Host;
use crate::proto::frame::PREFIX;

/// How long a new connection may take to send its first message.
pub(crate) const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest first message (GetMetadata and Attach are small).
const MAX_FIRST: usize = 64 << 10;
/// Connections waiting for their first message (or for the metadata to be written) at
/// once; beyond it the one waiting longest is closed.
const MAX_PENDING: usize = 256;
const LISTENER: Token = Token(0);

/// A connection the loop owns: reading its first frame, or writing the metadata.
struct Pending {
    s: TcpStream,
    /// The bytes of the frame being read (prefix, then body).
    got: Vec<u8>,
    /// An answer being written (an authentication challenge, or the metadata), how much of
    /// it is written, and whether the connection closes after it.
    out: Option<(Vec<u8>, usize, bool)>,
    /// Where authentication stands (a cluster secret is configured).
    auth: auth::Listen,
    deadline: Instant,
}

enum Step {
    /// Wait for more events.
    Wait,
    /// Done with it (answered, or dropped).
    Close,
    /// A peer attached, or sent its metadata or its leaving: hand the connection over,
    /// with its first message (answered on a thread of its own).
    Attach(Msg),
}

/// Run the loop until the agent shuts down. `attach` takes over attached connections.
pub(crate) fn run(
    shared: &Arc<dyn Host>,
    listener: TcpListener,
    mut attach: impl FnMut(Arc<dyn Host>, TcpStream, Msg),
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut poll = Poll::new()?;
    let lfd = listener.as_raw_fd();
    poll.registry()
        .register(&mut SourceFd(&lfd), LISTENER, Interest::READABLE)?;
    let mut pending: HashMap<usize, Pending> = HashMap::new();
    let mut next = 1usize;
    let mut events = Events::with_capacity(64);
    loop {
        let timeout = pending
            .values()
            .map(|p| p.deadline.saturating_duration_since(Instant::now()))
            .min();
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if shared.stopping() {
            return Ok(());
        }
        for ev in &events {
            if ev.token() == LISTENER {
                accept_all(&**shared, &listener, &poll, &mut pending, &mut next);
                continue;
            }
            let Token(t) = ev.token();
            let Some(p) = pending.get_mut(&t) else {
                continue;
            };
            match step(&**shared, p, &poll, t) {
                Step::Wait => {}
                Step::Close => {
                    if let Some(p) = pending.remove(&t) {
                        let _ = poll.registry().deregister(&mut SourceFd(&p.s.as_raw_fd()));
                    }
                }
                Step::Attach(m) => {
                    let Some(p) = pending.remove(&t) else {
                        continue;
                    };
                    let _ = poll.registry().deregister(&mut SourceFd(&p.s.as_raw_fd()));
                    if p.s.set_nonblocking(false).is_err() {
                        continue;
                    }
                    attach(shared.clone(), p.s, m);
                }
            }
        }
        let now = Instant::now();
        pending.retain(|_, p| {
            let keep = p.deadline > now;
            if !keep {
                tracing::warn!(agent = %shared.name, peer = ?p.s.peer_addr().ok(),
                    "side channel: no complete first message within {} s; connection closed",
                    FIRST_MESSAGE_TIMEOUT.as_secs());
                let _ = poll.registry().deregister(&mut SourceFd(&p.s.as_raw_fd()));
            }
            keep
        });
    }
}

fn accept_all(
    shared: &dyn Host,
    listener: &TcpListener,
    poll: &Poll,
    pending: &mut HashMap<usize, Pending>,
    next: &mut usize,
) {
    loop {
        let s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(agent = %shared.name, error = %e, "side channel: accept failed");
                return;
            }
        };
        if shared.stopping() {
            return;
        }
        if pending.len() >= MAX_PENDING {
            // make room by closing the one that has waited longest (a flood of silent
            // connections cannot lock out a peer that speaks at once)
            if let Some(old) = pending
                .iter()
                .min_by_key(|(_, p)| p.deadline)
                .map(|(t, _)| *t)
            {
                if let Some(p) = pending.remove(&old) {
                    tracing::warn!(agent = %shared.name, peer = ?p.s.peer_addr().ok(),
                        "side channel: {MAX_PENDING} connections waiting; closed the oldest");
                    let _ = poll.registry().deregister(&mut SourceFd(&p.s.as_raw_fd()));
                }
            }
        }
        if s.set_nonblocking(true).is_err() {
            continue;
        }
        s.set_nodelay(true).ok();
        let t = *next;
        *next = next.wrapping_add(1).max(1);
        if poll
            .registry()
            .register(&mut SourceFd(&s.as_raw_fd()), Token(t), Interest::READABLE)
            .is_err()
        {
            continue;
        }
        pending.insert(
            t,
            Pending {
                s,
                got: Vec::new(),
                out: None,
                auth: auth::Listen::start(shared.config().cluster_secret.as_ref()),
                deadline: Instant::now() + FIRST_MESSAGE_TIMEOUT,
            },
        );
    }
}

/// Make progress on one connection.
fn step(shared: &dyn Host, p: &mut Pending, poll: &Poll, t: usize) -> Step {
    loop {
        if let Some((out, at, close)) = &mut p.out {
            match write_out(&mut p.s, out, at) {
                Some(step) => return step,
                None if *close => return Step::Close,
                None => {
                    p.out = None;
                    let _ = poll.registry().reregister(
                        &mut SourceFd(&p.s.as_raw_fd()),
                        Token(t),
                        Interest::READABLE,
                    );
                }
            }
        }
        let m = match read_frame(shared, p) {
            Ok(m) => m,
            Err(Step::Close) if matches!(p.auth, auth::Listen::Proof { .. }) => {
                // challenged, and gone without a proof: a peer whose secret did not match
                // ours (it checks our proof first)
                refused(
                    shared,
                    p,
                    "left during authentication (another cluster_secret?)",
                );
                return Step::Close;
            }
            Err(step) => return step,
        };
        if let Some(why) = protected(shared, p) {
            refuse(&mut p.s, why);
            return Step::Close;
        }
        let m = match p.auth.take(shared.config().cluster_secret.as_ref(), m) {
            Verdict::NotMine(m) => m,
            Verdict::Passed => continue,
            Verdict::Answer(a) => {
                answer(p, poll, t, &a, false);
                continue;
            }
            Verdict::Refuse(why) => {
                refused(shared, p, why);
                refuse(&mut p.s, why);
                return Step::Close;
            }
        };
        return match m {
            Msg::GetMetadata => {
                let Some(meta) = shared.metadata().encode().ok() else {
                    return Step::Close;
                };
                answer(p, poll, t, &Msg::Metadata(meta), true);
                continue;
            }
            m @ (Msg::Attach { .. } | Msg::PutMetadata { .. } | Msg::Forget { .. }) => {
                Step::Attach(m)
            }
            other => {
                tracing::warn!(agent = %shared.name, "side channel: unexpected first message {other:?}");
                refuse(
                    &mut p.s,
                    "expected GetMetadata, Attach, PutMetadata or Forget",
                );
                Step::Close
            }
        };
    }
}

/// Protected mode: an agent with no `cluster_secret` that is not `insecure` serves only
/// peers on loopback. A peer beyond it is refused (counted, logged once per address, with
/// the ways out); `None` lets the connection on.
fn protected(shared: &dyn Host, p: &Pending) -> Option<&'static str> {
    if shared.config().cluster_secret.is_some() || shared.config().insecure {
        return None;
    }
    let ip = p.s.peer_addr().ok()?.ip();
    if auth::is_loopback(ip) {
        return None;
    }
    if shared.count_protected_refusal(ip) {
        tracing::warn!(agent = %shared.name, peer = %ip,
            "side channel: refused a peer beyond loopback: {}", auth::PROTECTED);
    }
    Some(auth::PROTECTED)
}

/// A peer failed authentication: counted and logged with its address.
fn refused(shared: &dyn Host, p: &Pending, why: &str) {
    shared.count_auth_refusal();
    tracing::warn!(agent = %shared.name, peer = ?p.s.peer_addr().ok(),
        error = %why, "side channel: authentication refused");
}

/// Read one whole frame (the prefix, then the body it announces) and decode it; `Err` says
/// what the loop does instead (wait for more bytes, or close).
fn read_frame(shared: &dyn Host, p: &mut Pending) -> Result<Msg, Step> {
    loop {
        let want = if p.got.len() < PREFIX {
            PREFIX
        } else {
            let len = u32::from_be_bytes([p.got[0], p.got[1], p.got[2], p.got[3]]) as usize;
            if len > MAX_FIRST {
                tracing::warn!(agent = %shared.name, "side channel: first frame of {len} bytes refused");
                return Err(Step::Close);
            }
            PREFIX + len
        };
        if p.got.len() == want && want > PREFIX {
            break;
        }
        let mut buf = vec![0u8; want - p.got.len()];
        match p.s.read(&mut buf) {
            Ok(0) => return Err(Step::Close),
            Ok(n) => p.got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Err(Step::Wait),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(Step::Close),
        }
    }
    let m = rmp_serde::from_slice(&p.got[PREFIX..]).map_err(|e| {
        tracing::warn!(agent = %shared.name, error = %e, "side channel: malformed first message");
        Step::Close
    });
    p.got.clear();
    m
}

/// Queue `m` to be written (then close, or read on).
fn answer(p: &mut Pending, poll: &Poll, t: usize, m: &Msg, close: bool) {
    let mut bytes = Vec::new();
    let _ = super::msg::encode_into(&mut bytes, m); // on an error: nothing to write
    p.out = Some((bytes, 0, close));
    let _ = poll.registry().reregister(
        &mut SourceFd(&p.s.as_raw_fd()),
        Token(t),
        Interest::WRITABLE,
    );
}

/// Tell the peer why it is refused (best effort: the connection closes either way).
fn refuse(s: &mut TcpStream, why: &str) {
    let mut r = Vec::new();
    let refused = Msg::Refused {
        message: why.into(),
    };
    if super::msg::encode_into(&mut r, &refused).is_ok() {
        let _ = s.write(&r);
    }
}

/// Write what is left of `out`: `None` once all of it is written.
fn write_out(s: &mut TcpStream, out: &[u8], at: &mut usize) -> Option<Step> {
    while *at < out.len() {
        match s.write(&out[*at..]) {
            Ok(0) => return Some(Step::Close),
            Ok(n) => *at += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Some(Step::Wait),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Some(Step::Close),
        }
    }
    None
}
