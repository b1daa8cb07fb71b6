//! A peer connection's two threads — the writer, which sends this agent's transfers and
//! notifications in submission order, and the reader, which takes the peer's answers (each
//! handled by `answer`, which a driving caller shares: `driven`).

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use super::driven::Driven;
use super::msg::{send, Msg};
use super::Host;
use super::{lock, Group, Work};
use crate::agent::xfer::XferOp;

/// Sends this agent's transfers and notifications, in submission order. Small work queued
/// together goes out in one send (`tcp_batch`): what is queued is gathered until the queue
/// is empty, the batch is full, or other work comes (sent after the batch). While callers
/// drive the connection (`driven`) it sleeps, and then first finishes what they left.
pub(super) fn writer(shared: &dyn Host, d: &Driven, peer: &str, group: &Group) {
    let fail = |e: std::io::Error| {
        group.close();
        shared.fail_peer(peer, &format!("send failed: {e}"));
    };
    loop {
        d.park(true);
        let mut g = lock(&d.out);
        let o = &mut *g;
        d.taken(true);
        // what a caller left: the rest of its batch, then the work it took out after it
        if !o.batch.is_empty() {
            if let Err(e) = o.batch.send(shared, &o.w) {
                return fail(e);
            }
        }
        match o.held.take() {
            Some(Ok(work)) => {
                let res = send_one(shared, &mut o.w, work);
                d.sent.fetch_add(1, Ordering::Release);
                if let Err(e) = res {
                    return fail(e);
                }
            }
            Some(Err(e)) => return fail(e),
            None => {}
        }
        // then what is queued: the first item waited for with the lock held (no caller
        // drives the connection now, or it would not wait), the rest while there is any
        let Ok(first) = o.rx.recv() else { return };
        match drain(shared, o, first, &d.sent) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => return fail(e),
        }
    }
}

/// Send `first` and whatever is queued behind it, batching small work; false once every
/// sender is gone.
fn drain(
    shared: &dyn Host,
    o: &mut super::driven::Out,
    first: Work,
    sent: &std::sync::atomic::AtomicU64,
) -> std::io::Result<bool> {
    let mut next = Some(first);
    loop {
        let work = match next.take() {
            Some(w) => w,
            None => match o.rx.try_recv() {
                Ok(w) => w,
                Err(e) => {
                    if !o.batch.is_empty() {
                        o.batch.send(shared, &o.w)?;
                    }
                    return Ok(e == mpsc::TryRecvError::Empty);
                }
            },
        };
        match o.batch.take(shared, work)? {
            None => {
                sent.fetch_add(1, Ordering::Release);
                if o.batch.full() {
                    o.batch.send(shared, &o.w)?;
                }
            }
            Some(work) => {
                if !o.batch.is_empty() {
                    o.batch.send(shared, &o.w)?;
                }
                let res = send_one(shared, &mut o.w, work);
                sent.fetch_add(1, Ordering::Release);
                res?;
            }
        }
    }
}

/// Send one item that does not go through the batch.
fn send_one(shared: &dyn Host, w: &mut TcpStream, work: Work) -> std::io::Result<()> {
    match work {
        Work::Flush(done) => {
            let _ = done.send(());
            Ok(())
        }
        Work::Notif(b) => send(w, &Msg::Notif(b)),
        Work::SeqNotif(seq, bytes) => send(w, &Msg::SeqNotif { seq, bytes }),
        #[cfg(feature = "verbs")]
        Work::QpOpen(pairs) => send(w, &Msg::QpOpen { pairs }),
        #[cfg(feature = "verbs")]
        Work::ChanOpen(rail, ep) => send(
            w,
            &Msg::ChanOpen {
                rail,
                ep,
                frames: crate::transport::notif::FRAME_FORMAT,
            },
        ),
        Work::Xfer {
            id,
            op: XferOp::Write,
            local,
            remote,
            grants,
            notif,
        } => crate::agent::tcp::send_write(shared, w, id, &local, (&remote, &grants), notif),
        Work::Xfer {
            id,
            op: XferOp::Read,
            remote,
            grants,
            ..
        } => crate::agent::tcp::send_read(w, id, &remote, &grants),
    }
}

/// Reads the target's answers to this agent's transfers (sleeping while callers drive the
/// connection, then first what they left). Returns why the connection ended.
pub(super) fn initiator_reader(shared: &dyn Host, d: &Driven) -> String {
    loop {
        d.park(false);
        let mut g = lock(&d.inp);
        let i = &mut *g;
        d.taken(false);
        let m = match i.stash.take() {
            Some(m) => m,
            None => {
                i.r.next()
                    .and_then(|m| m.ok_or_else(|| "closed by the peer".to_string()))
            }
        };
        if let Err(why) =
            m.and_then(|m| super::answer::answer(shared, i.tx.as_ref(), &d.peer, m, &mut i.r))
        {
            i.tx = None;
            return why;
        }
    }
}
