//! Small TCP work in one send: a connection's writer gathers what is queued — small WRITEs
//! from host memory (each `WriteData` header, its payload and `WriteEnd`), READ requests and
//! notifications — and sends it with one `sendmsg` of an I/O vector whose payload entries
//! point into the registered buffers themselves (no copy of kvrail's). The buffers' CPU locks
//! are held, in address order, only for each non-blocking `sendmsg`, never while waiting
//! for the socket (the rule of `tcp_io`).

use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{sendmsg, MsgFlags};

use super::control::msg::{encode_into, Msg};
use super::control::work::Work;
use super::core::Core;
use super::region::Region;
use super::xfer::XferOp;
use crate::mem::HostBuffer;

/// A WRITE moves through the batch when its payload is at most this many bytes.
pub(crate) const SMALL: u64 = 64 << 10;
/// A batch is sent once it holds this many bytes …
const MAX_BYTES: usize = 1 << 20;
/// … or this many vector entries (under the kernel's `IOV_MAX`, 1024).
const MAX_SEGS: usize = 512;

/// One entry of the I/O vector: a range of the encoded headers, or registered memory.
enum Seg {
    Head(usize, usize),
    Mem(Arc<Region>, usize, usize),
}

/// What a writer gathered and not yet sent.
#[derive(Default)]
pub(crate) struct Batch {
    heads: Vec<u8>,
    segs: Vec<Seg>,
    bytes: usize,
    /// Payload bytes of WRITEs in it (counted as sent once the batch is).
    payload: u64,
    /// Bytes of it already sent (a caller's non-blocking send can leave the rest).
    done: usize,
}

impl Batch {
    pub(crate) fn is_empty(&self) -> bool {
        self.segs.is_empty()
    }

    /// Full: send it before taking more.
    pub(crate) fn full(&self) -> bool {
        self.bytes >= MAX_BYTES || self.segs.len() >= MAX_SEGS
    }

    fn head(&mut self, m: &Msg) -> io::Result<()> {
        let at = self.heads.len();
        encode_into(&mut self.heads, m)?;
        let n = self.heads.len() - at;
        // consecutive headers share one entry
        match self.segs.last_mut() {
            Some(Seg::Head(s, len)) if *s + *len == at => *len += n,
            _ => self.segs.push(Seg::Head(at, n)),
        }
        self.bytes += n;
        Ok(())
    }

    /// Take `w` into the batch when it is small work (a small WRITE from host memory, a READ
    /// request, a notification); otherwise hand it back.
    pub(crate) fn take(&mut self, core: &Core, w: Work) -> io::Result<Option<Work>> {
        match w {
            Work::Notif(b) => self.head(&Msg::Notif(b))?,
            Work::SeqNotif(seq, bytes) => self.head(&Msg::SeqNotif { seq, bytes })?,
            Work::Xfer {
                id,
                op: XferOp::Read,
                remote,
                grants,
                ..
            } => {
                for m in super::tcp::read_reqs(id, &remote, &grants) {
                    self.head(&m)?;
                }
            }
            Work::Xfer {
                id,
                op: XferOp::Write,
                local,
                remote,
                grants,
                notif,
            } if local.iter().all(|(r, _)| r.host().is_some())
                && local.iter().map(|(_, d)| d.len).sum::<u64>() <= SMALL
                && self.segs.len() + 2 * local.len() < MAX_SEGS =>
            {
                // as `tcp::send_write`: a header and its bytes per non-empty descriptor
                let parts = local.into_iter().zip(remote.iter()).enumerate();
                for (i, ((r, d), rd)) in parts.filter(|(_, ((_, d), _))| d.len > 0) {
                    let (off, len) = (d.offset, d.len);
                    self.head(&Msg::WriteData {
                        xfer: id,
                        region: rd.region.0,
                        offset: rd.offset,
                        len: len as u32,
                        grant: grants.get(i).copied().unwrap_or(0),
                    })?;
                    self.segs.push(Seg::Mem(r, off as usize, len as usize));
                    self.bytes += len as usize;
                    self.payload += len;
                }
                // its bytes go out before its end, in this batch: the peer's Ack may
                // complete it from now on
                core.xfer_end_sent(id);
                self.head(&Msg::WriteEnd { xfer: id, notif })?;
            }
            other => return Ok(Some(other)),
        }
        Ok(None)
    }

    /// Send everything gathered, in order, and empty the batch.
    ///
    /// # Errors
    /// The socket's; `InvalidInput` for a payload range outside its buffer.
    pub(crate) fn send(&mut self, core: &Core, sock: &TcpStream) -> io::Result<()> {
        self.send_from(core, sock, true).map(drop)
    }

    /// Send what the socket takes now, without waiting for room: true once all of it is
    /// sent (the batch is then empty); false leaves the rest for [`Batch::send`].
    ///
    /// # Errors
    /// As [`Batch::send`] (the batch is emptied).
    pub(crate) fn try_send(&mut self, core: &Core, sock: &TcpStream) -> io::Result<bool> {
        self.send_from(core, sock, false)
    }

    fn send_from(&mut self, core: &Core, sock: &TcpStream, block: bool) -> io::Result<bool> {
        let r = send_all(sock, &self.heads, &self.segs, &mut self.done, block);
        if let Ok(false) = r {
            return r;
        }
        if r.is_ok() {
            core.stats.tcp_bytes[super::stats::op_index(XferOp::Write)].add(self.payload);
        }
        self.heads.clear();
        self.segs.clear();
        self.bytes = 0;
        self.payload = 0;
        self.done = 0;
        r
    }
}

/// `sendmsg` the vector from byte `done` on until every byte is out (true), the buffers
/// locked (address order) for each non-blocking attempt; when the socket is full, `poll`
/// for room with none held (`block`) or return false with `done` where it stopped.
fn send_all(
    sock: &TcpStream,
    heads: &[u8],
    segs: &[Seg],
    done: &mut usize,
    block: bool,
) -> io::Result<bool> {
    // the distinct buffers, in address order, and each payload entry's buffer among them;
    // the distinct regions, whose gates each attempt enters
    let mut bufs: Vec<&HostBuffer> = Vec::new();
    let mut regions: Vec<&Region> = Vec::new();
    for s in segs {
        if let Seg::Mem(r, off, len) = s {
            let b = host(r)?;
            if off.checked_add(*len).is_none_or(|end| end > b.len()) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("[{off}, +{len}) is outside its buffer of {} bytes", b.len()),
                ));
            }
            if !bufs.iter().any(|x| std::ptr::eq(*x, b)) {
                bufs.push(b);
            }
            if !regions.iter().any(|x| std::ptr::eq(*x, &**r)) {
                regions.push(r);
            }
        }
    }
    bufs.sort_by_key(|b| std::ptr::from_ref::<HostBuffer>(*b) as usize);
    let mut which = Vec::with_capacity(segs.len());
    for s in segs {
        if let Seg::Mem(r, _, _) = s {
            let b = host(r)?;
            which.push(bufs.iter().position(|x| std::ptr::eq(*x, b)).unwrap_or(0));
        }
    }
    let total: usize = segs
        .iter()
        .map(|s| match s {
            Seg::Head(_, n) | Seg::Mem(_, _, n) => *n,
        })
        .sum();
    while *done < total {
        // a source deregistered with its bytes still here (its transfer ended early: only a
        // broken peer or a lost connection does that) is never read: the connection ends
        let inside = (regions.iter())
            .map(|r| r.gate.enter())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                io::Error::other("a WRITE's source was deregistered before it was sent")
            })?;
        let mut guards: Vec<_> = bufs.iter().map(|b| b.locked()).collect();
        let whole: Vec<&[u8]> = guards.iter_mut().map(|g| g.bytes()).collect();
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(segs.len());
        let (mut skip, mut m) = (*done, 0);
        for s in segs {
            let bytes: &[u8] = match s {
                Seg::Head(at, n) => &heads[*at..at + n],
                Seg::Mem(_, off, n) => {
                    m += 1;
                    &whole[which[m - 1]][*off..off + n]
                }
            };
            if skip >= bytes.len() {
                skip -= bytes.len();
                continue;
            }
            iov.push(IoSlice::new(&bytes[skip..]));
            skip = 0;
        }
        let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
        let sent = sendmsg::<()>(sock.as_raw_fd(), &iov, &[], flags, None);
        drop(iov);
        drop(whole);
        drop(guards);
        drop(inside);
        match sent {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *done += n,
            Err(Errno::EAGAIN) if !block => return Ok(false),
            Err(Errno::EAGAIN) => {
                let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLOUT)];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

fn host(r: &Region) -> io::Result<&HostBuffer> {
    r.host()
        .map(|b| &**b)
        .ok_or_else(|| io::Error::other("a batched payload is not host memory"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::metadata::MemKind;
    use crate::agent::region::{Layers, RegionMemory};
    use crate::agent::{region::RegionId, region::RemoteAccess};
    use std::io::Read;
    use std::net::TcpListener;

    fn region(id: u32, bytes: &[u8]) -> Arc<Region> {
        let b = HostBuffer::new(bytes.len()).unwrap();
        b.write(0, bytes).unwrap();
        Arc::new(Region::new(
            RegionId(id),
            RegionMemory::Host(b),
            MemKind::Host,
            0,
            RemoteAccess::NONE,
            Layers::default(),
        ))
    }

    /// Headers and payloads of two buffers (one named twice), through a socket whose send
    /// buffer is small and a reader that starts late: every byte, in vector order, across
    /// the partial sends and waits.
    #[test]
    fn a_gathered_vector_arrives_whole_and_in_order() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        nix::sys::socket::setsockopt(&a, nix::sys::socket::sockopt::SndBuf, &4096).unwrap();
        let x: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let y: Vec<u8> = (0..200_000u32).map(|i| (i * 13 + 5) as u8).collect();
        let (rx, ry) = (region(1, &x), region(2, &y));
        let heads = b"head-one|head-two|tail".to_vec();
        let segs = vec![
            Seg::Head(0, 9),
            Seg::Mem(rx.clone(), 1000, 150_000),
            Seg::Head(9, 9),
            Seg::Mem(ry, 0, 200_000),
            Seg::Mem(rx, 0, 10),
            Seg::Head(18, 4),
        ];
        let mut want = b"head-one|".to_vec();
        want.extend_from_slice(&x[1000..151_000]);
        want.extend_from_slice(b"head-two|");
        want.extend_from_slice(&y);
        want.extend_from_slice(&x[..10]);
        want.extend_from_slice(b"tail");
        let n = want.len();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let mut got = vec![0u8; n];
            b.read_exact(&mut got).unwrap();
            got
        });
        // what a non-blocking attempt leaves (the reader sleeps: the socket fills), then the rest
        let mut done = 0;
        assert!(!send_all(&a, &heads, &segs, &mut done, false).unwrap());
        assert!(
            done > 0 && done < n,
            "{done} of {n} sent before the socket was full"
        );
        assert!(send_all(&a, &heads, &segs, &mut done, true).unwrap());
        assert!(t.join().unwrap() == want, "every byte in order");
        // a payload range outside its buffer is refused before anything is sent
        let bad = vec![Seg::Mem(region(3, &[1, 2, 3]), 2, 2)];
        let e = send_all(&a, &[], &bad, &mut 0, true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
