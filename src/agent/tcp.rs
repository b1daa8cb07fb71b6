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

use super::control::msg::{send, send_data, Msg, Reader, CHUNK};
use super::control::work::Work;
use super::core::Core;
use super::region::Region;
use super::table::Arrival;
use super::tcp_io;
use super::{error::XferError, xfer::Desc};
use std::sync::Arc;

/// Initiator: send WRITE `id`'s bytes (`local` region, offset, length per descriptor, into
/// `remote`) and its end. A local copy that fails fails the transfer and sends nothing more.
///
/// # Errors
/// The socket's.
pub(crate) fn send_write(
    core: &Core,
    w: &mut TcpStream,
    id: u64,
    local: &[(Arc<Region>, Desc)],
    (remote, grants): (&[Desc], &[u64]),
    notif: Option<Vec<u8>>,
) -> std::io::Result<()> {
    let mut frame = Vec::new();
    for (i, ((r, d), rd)) in local.iter().zip(remote).enumerate() {
        let (off, len) = (d.offset, d.len);
        let grant = grants.get(i).copied().unwrap_or(0);
        let mut at = 0;
        while at < len {
            let n = (len - at).min(CHUNK as u64);
            // a transfer that ended meanwhile (failed: the connection is going, the peer was
            // invalidated) reads no more of its source: the engine may reuse it
            if !core.xfer_in_progress(id) {
                return send(
                    w,
                    &Msg::WriteEnd {
                        xfer: id,
                        notif: None,
                    },
                );
            }
            let header = Msg::WriteData {
                xfer: id,
                region: rd.region.0,
                offset: rd.offset + at,
                len: n as u32,
                grant,
            };
            let sent = if let Some(host) = r.host() {
                // host memory: the kernel sends from the buffer itself, inside the region's
                // gate (a deregistration waits for the chunk)
                r.enter().map(|_in| {
                    send(w, &header)?;
                    tcp_io::send_from(w, host, (off + at) as usize, n as usize)
                })
            } else {
                send_data(w, &mut frame, &header, n as usize, |out| {
                    r.read(off + at, out)
                })?
                .map(|()| {
                    core.count_copy(n);
                    Ok(())
                })
            };
            match sent {
                Ok(res) => res?,
                Err(e) => {
                    core.finish(id, Err(XferError::Memory(e.to_string())));
                    return send(
                        w,
                        &Msg::WriteEnd {
                            xfer: id,
                            notif: None,
                        },
                    );
                }
            }
            at += n;
            core.stats.tcp_bytes[super::stats::op_index(super::xfer::XferOp::Write)].add(n);
        }
    }
    // every byte is sent: from now on the peer's Ack completes the transfer
    core.xfer_end_sent(id);
    send(w, &Msg::WriteEnd { xfer: id, notif })
}

/// Initiator: ask for READ `id`'s bytes, one request per non-empty descriptor.
///
/// # Errors
/// The socket's.
pub(crate) fn send_read(
    w: &mut TcpStream,
    id: u64,
    remote: &[Desc],
    grants: &[u64],
) -> std::io::Result<()> {
    for m in read_reqs(id, remote, grants) {
        send(w, &m)?;
    }
    Ok(())
}

/// READ `id`'s requests: one per non-empty descriptor, with the grant it goes through.
pub(crate) fn read_reqs<'a>(
    id: u64,
    remote: &'a [Desc],
    grants: &'a [u64],
) -> impl Iterator<Item = Msg> + 'a {
    (remote.iter().enumerate())
        .filter(|(_, d)| d.len > 0)
        .map(move |(i, rd)| Msg::ReadReq {
            xfer: id,
            idx: i as u32,
            region: rd.region.0,
            offset: rd.offset,
            len: rd.len,
            grant: grants.get(i).copied().unwrap_or(0),
        })
}

/// Initiator: `len` bytes for descriptor `idx` of READ `xfer`, at `at` of it, follow on
/// `r` from `peer`: received into host memory in place (inside the region's gate), or
/// through `r`'s buffer. Bytes of a transfer that ended are read and dropped; bytes the
/// transfer did not ask for there fail it as a protocol error, which ends the connection.
///
/// # Errors
/// The connection's (the stream cannot continue), or the peer's protocol error.
pub(crate) fn on_read_data(
    core: &Core,
    tx: &mpsc::Sender<Work>,
    peer: &str,
    (xfer, idx, at, len): (u64, u32, u64, u32),
    r: &mut Reader<TcpStream>,
) -> Result<(), String> {
    let n = u64::from(len);
    let arrival = core.read_arrival(xfer, (idx, at), n);
    let target = match arrival {
        Arrival::Unasked => {
            let why = format!(
                "protocol error: {peer} sent {n} bytes at {at} of descriptor #{idx} of transfer \
                 {xfer}, which did not ask for them there"
            );
            core.finish(xfer, Err(XferError::Protocol(why.clone())));
            return Err(why);
        }
        Arrival::Stale => None,
        Arrival::More | Arrival::Complete => core.read_target(xfer, idx),
    };
    let Some((region, off, _)) = target else {
        r.payload(len)?; // a transfer that ended: its bytes go nowhere
        return Ok(());
    };
    let landed = match region.host() {
        Some(host) => match region.enter() {
            Ok(_in) => {
                let copied = r.payload_into(len, host, (off + at) as usize)?;
                core.count_copy(copied);
                Ok(())
            }
            Err(e) => {
                r.payload(len)?;
                Err(e)
            }
        },
        None => {
            let data = r.payload(len)?;
            let res = region.write(off + at, data);
            core.count_copy(n);
            res
        }
    };
    if let Err(e) = landed {
        core.finish(xfer, Err(XferError::Memory(e.to_string())));
        return Ok(());
    }
    core.stats.tcp_bytes[super::stats::op_index(super::xfer::XferOp::Read)].add(n);
    // after the last byte its notification is queued (on `tx`) before the transfer is done
    // — an engine that sees it done may release it at once
    if arrival == Arrival::Complete {
        if let Some((_, n)) = core.xfer_notif(xfer) {
            let _ = tx.send(Work::Notif(n));
        }
        core.finish(xfer, Ok(()));
    }
    Ok(())
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
        core: &Core,
        xfer: u64,
        (region, offset, grant): (u32, u64, u64),
        data: &[u8],
    ) {
        if let std::collections::hash_map::Entry::Vacant(v) = self.failed.entry(xfer) {
            if let Err(e) = apply_write(core, (region, offset, grant), data) {
                v.insert(e);
            }
        }
    }

    /// A chunk of WRITE `xfer` (`len` bytes for `region` at `offset`, through `grant`)
    /// follows on `r`. Host memory that allows remote WRITE and is not fenced receives it in
    /// place, inside the region's gate (fenced bytes are copied under their grant's gate,
    /// never while waiting on the socket); the rest goes through [`Writes::chunk`], which
    /// says what is wrong. A region deregistered meanwhile takes nothing.
    ///
    /// # Errors
    /// The connection's (the stream cannot continue).
    pub(crate) fn data(
        &mut self,
        core: &Core,
        r: &mut Reader<TcpStream>,
        xfer: u64,
        (region, offset, len, grant): (u32, u64, u32, u64),
    ) -> Result<(), String> {
        let inside = |r: &Region| {
            offset
                .checked_add(u64::from(len))
                .is_some_and(|e| e <= r.len())
        };
        let in_place = (!self.failed.contains_key(&xfer))
            .then(|| core.region(region).ok())
            .flatten()
            .filter(|r| r.access.write && !r.fenced && inside(r) && r.host().is_some());
        if let Some((reg, host)) = in_place.as_ref().and_then(|r| Some((r, r.host()?))) {
            if let Ok(_in) = reg.enter() {
                let copied = r.payload_into(len, host, offset as usize)?;
                core.count_copy(copied);
                return Ok(());
            }
        }
        let data = r.payload(len)?;
        self.chunk(core, xfer, (region, offset, grant), data);
        Ok(())
    }

    /// The initiator's end of WRITE `xfer`: its notification (delivered now, after every
    /// byte) and the answer to send.
    pub(crate) fn end(
        &mut self,
        core: &Core,
        from: &str,
        xfer: u64,
        notif: Option<Vec<u8>>,
    ) -> Msg {
        match self.failed.remove(&xfer) {
            Some(message) => Msg::Fail { xfer, message },
            None => {
                if let Some(n) = notif {
                    core.deliver_notif(from, n);
                }
                Msg::Ack { xfer }
            }
        }
    }
}

fn apply_write(
    core: &Core,
    (region, offset, grant): (u32, u64, u64),
    data: &[u8],
) -> Result<(), String> {
    let r = core.region(region).map_err(|e| e.to_string())?;
    if !r.access.write {
        return Err(format!("region {region} does not allow remote WRITE"));
    }
    if r.fenced {
        let span = (region, offset, data.len() as u64);
        core.under_grant(grant, span, true, || r.write(offset, data))?
    } else {
        r.write(offset, data)
    }
    .map_err(|e| e.to_string())?;
    core.count_copy(data.len() as u64);
    Ok(())
}

/// Target: serve one READ request, chunk by chunk (or its failure).
///
/// # Errors
/// The socket's.
pub(crate) fn serve_read(
    core: &Core,
    w: &mut TcpStream,
    (xfer, idx): (u64, u32),
    (region, offset, len): (u32, u64, u64),
    grant: u64,
) -> std::io::Result<()> {
    let fail = |w: &mut TcpStream, message: String| send(w, &Msg::Fail { xfer, message });
    let r = match core.region(region) {
        Ok(r) if r.access.read => r,
        Ok(_) => return fail(w, format!("region {region} does not allow remote READ")),
        Err(e) => return fail(w, e.to_string()),
    };
    if offset.checked_add(len).is_none_or(|e| e > r.len()) {
        return fail(
            w,
            format!(
                "[{offset}, {offset}+{len}) is outside region {region} ({} bytes)",
                r.len()
            ),
        );
    }
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
        // each chunk inside the region's gate: once its owner deregistered it, no more
        let Ok(_in) = r.enter() else {
            return fail(
                w,
                format!("region {region} was deregistered by its owner during the READ"),
            );
        };
        if r.fenced {
            // copied out under the grant's gate: revocation never waits on the socket
            let span = (region, offset + at, n);
            let filled = send_data(w, &mut frame, &header, n as usize, |out| {
                core.under_grant(grant, span, false, || r.read(offset + at, out))
                    .and_then(|res| res.map_err(|e| e.to_string()))
            })?;
            if let Err(why) = filled {
                return fail(w, why);
            }
            core.count_copy(n);
        } else if let Some(host) = r.host() {
            send(w, &header)?;
            tcp_io::send_from(w, host, (offset + at) as usize, n as usize)?;
        } else {
            if let Err(e) = send_data(w, &mut frame, &header, n as usize, |out| {
                r.read(offset + at, out)
            })? {
                return fail(w, e.to_string());
            }
            core.count_copy(n);
        }
        at += n;
    }
    Ok(())
}
