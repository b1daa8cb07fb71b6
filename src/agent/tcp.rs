//! The TCP data path: a transfer's bytes as messages on the peer connection the control
//! channel (`super::control`) keeps. The initiator sends a WRITE's bytes in `Write` chunks
//! (`WriteData` headers, each followed by its bytes raw) and `WriteEnd` (with the
//! notification), or asks for a READ's with one `ReadReq` per descriptor and places each
//! `ReadData`'s bytes; the target applies the writes in order (the first
//! failure of a transfer is kept and answered at its `WriteEnd`), delivers the notification
//! only after every byte was copied into its memory, and serves reads chunk by chunk. Every
//! copy between registered memory and a message is counted (`Agent::payload_bytes_copied`).

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::mpsc;

use super::control::msg::{send, send_data, Msg, CHUNK};
use super::control::Work;
use super::region::Region;
use super::{Desc, Shared, XferError};
use std::sync::Arc;

/// Initiator: send WRITE `id`'s bytes (`local` region, offset, length per descriptor, into
/// `remote`) and its end. A local copy that fails fails the transfer and sends nothing more.
///
/// # Errors
/// The socket's.
pub(crate) fn send_write(
    shared: &Shared,
    w: &mut TcpStream,
    id: u64,
    local: &[(Arc<Region>, u64, u64)],
    remote: &[Desc],
    notif: Option<Vec<u8>>,
) -> std::io::Result<()> {
    let mut frame = Vec::new();
    for ((r, off, len), rd) in local.iter().zip(remote) {
        let mut at = 0;
        while at < *len {
            let n = (*len - at).min(CHUNK as u64);
            let header = Msg::WriteData {
                xfer: id,
                region: rd.region.0,
                offset: rd.offset + at,
                len: n as u32,
            };
            let filled = send_data(w, &mut frame, &header, n as usize, |out| {
                r.read(off + at, out)
            })?;
            if let Err(e) = filled {
                shared.finish(id, Err(XferError::Memory(e.to_string())));
                return Ok(());
            }
            shared.count_copy(n);
            at += n;
        }
    }
    send(w, &Msg::WriteEnd { xfer: id, notif })
}

/// Initiator: ask for READ `id`'s bytes, one request per non-empty descriptor.
///
/// # Errors
/// The socket's.
pub(crate) fn send_read(w: &mut TcpStream, id: u64, remote: &[Desc]) -> std::io::Result<()> {
    for (i, rd) in remote.iter().enumerate().filter(|(_, d)| d.len > 0) {
        send(
            w,
            &Msg::ReadReq {
                xfer: id,
                idx: i as u32,
                region: rd.region.0,
                offset: rd.offset,
                len: rd.len,
            },
        )?;
    }
    Ok(())
}

/// Initiator: `data` for descriptor `idx` of READ `xfer`, at `at` of it, came from `peer`.
/// When it was the last byte, the notification is queued (on `tx`) before the transfer is
/// done — an engine that sees it done may release it at once.
pub(crate) fn on_read_resp(
    shared: &Shared,
    tx: &mpsc::Sender<Work>,
    peer: &str,
    (xfer, idx, at): (u64, u32, u64),
    data: &[u8],
) {
    let Some((region, off, len)) = shared.read_target(xfer, idx) else {
        return;
    };
    let n = data.len() as u64;
    if at.checked_add(n).is_none_or(|e| e > len) {
        let why = format!("{peer} sent bytes outside descriptor #{idx}");
        shared.finish(xfer, Err(XferError::Protocol(why)));
        return;
    }
    if let Err(e) = region.write(off + at, data) {
        shared.finish(xfer, Err(XferError::Memory(e.to_string())));
        return;
    }
    shared.count_copy(n);
    if shared.read_arrived(xfer, n) {
        if let Some((_, n)) = shared.xfer_notif(xfer) {
            let _ = tx.send(Work::Notif(n));
        }
        shared.finish(xfer, Ok(()));
    }
}

/// Target: the WRITEs of one attached initiator, in order.
#[derive(Default)]
pub(crate) struct Writes {
    /// Transfers whose bytes could not all be applied: the first reason.
    failed: HashMap<u64, String>,
}

impl Writes {
    /// Apply a chunk (nothing more of a transfer that failed already).
    pub(crate) fn chunk(
        &mut self,
        shared: &Shared,
        xfer: u64,
        region: u32,
        offset: u64,
        data: &[u8],
    ) {
        if let std::collections::hash_map::Entry::Vacant(v) = self.failed.entry(xfer) {
            if let Err(e) = apply_write(shared, region, offset, data) {
                v.insert(e);
            }
        }
    }

    /// The initiator's end of WRITE `xfer`: its notification (delivered now, after every
    /// byte) and the answer to send.
    pub(crate) fn end(
        &mut self,
        shared: &Shared,
        from: &str,
        xfer: u64,
        notif: Option<Vec<u8>>,
    ) -> Msg {
        match self.failed.remove(&xfer) {
            Some(message) => Msg::Fail { xfer, message },
            None => {
                if let Some(n) = notif {
                    shared.deliver_notif(from, n);
                }
                Msg::Ack { xfer }
            }
        }
    }
}

fn apply_write(shared: &Shared, region: u32, offset: u64, data: &[u8]) -> Result<(), String> {
    let r = shared.region(region).map_err(|e| e.to_string())?;
    if !r.access.write {
        return Err(format!("region {region} does not allow remote WRITE"));
    }
    r.write(offset, data).map_err(|e| e.to_string())?;
    shared.count_copy(data.len() as u64);
    Ok(())
}

/// Target: serve one READ request, chunk by chunk (or its failure).
///
/// # Errors
/// The socket's.
pub(crate) fn serve_read(
    shared: &Shared,
    w: &mut TcpStream,
    (xfer, idx): (u64, u32),
    region: u32,
    offset: u64,
    len: u64,
) -> std::io::Result<()> {
    let fail = |w: &mut TcpStream, message: String| send(w, &Msg::Fail { xfer, message });
    let r = match shared.region(region) {
        Ok(r) if r.access.read => r,
        Ok(_) => return fail(w, format!("region {region} does not allow remote READ")),
        Err(e) => return fail(w, e.to_string()),
    };
    let mut frame = Vec::new();
    let mut at = 0;
    while at < len {
        let n = (len - at).min(CHUNK as u64);
        let header = Msg::ReadData {
            xfer,
            idx,
            at,
            len: n as u32,
        };
        if let Err(e) = send_data(w, &mut frame, &header, n as usize, |out| {
            r.read(offset + at, out)
        })? {
            return fail(w, e.to_string());
        }
        shared.count_copy(n);
        at += n;
    }
    Ok(())
}
