//! Bytes between a socket and host memory with no copy of kvrail's own: the kernel reads
//! from or writes into the registered buffer itself. The buffer's lock (which serializes CPU
//! access to it) is held only for a non-blocking `send`/`recv` of what the socket can take
//! or has (tried first; `poll` only after the socket said it would block): never while
//! waiting, so a peer that stalls cannot block the engine's own access,
//! and a transfer from a buffer into itself over the loopback cannot deadlock.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{recv, send, MsgFlags};

use crate::mem::{HostBuffer, MemError};

/// Block until `sock` is ready for `what`.
fn wait(sock: &TcpStream, what: PollFlags) -> io::Result<()> {
    let mut fds = [PollFd::new(sock.as_fd(), what)];
    loop {
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

fn mem(e: MemError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e.to_string())
}

/// Move `len` bytes between `sock` and `buf` at `offset` with `io` (a non-blocking `send` or
/// `recv` on the bytes left), waiting for `ready_for` only after the socket said it would
/// block; `io` moving nothing is `zero`.
fn pump(
    sock: &TcpStream,
    buf: &HostBuffer,
    (offset, len): (usize, usize),
    (ready_for, zero): (PollFlags, io::ErrorKind),
    mut io: impl FnMut(&mut [u8]) -> nix::Result<usize>,
) -> io::Result<()> {
    let mut at = 0;
    let mut ready = true; // try first; wait only when the socket could not
    while at < len {
        if !ready {
            wait(sock, ready_for)?;
        }
        let moved = buf
            .with_mut(offset + at, len - at, |b| Ok(io(b)))
            .map_err(mem)?;
        match moved {
            Ok(0) => return Err(zero.into()),
            Ok(n) => {
                at += n;
                ready = true;
            }
            Err(Errno::EAGAIN) => ready = false,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Receive exactly `len` bytes from `sock` into `dst` at `offset`.
///
/// # Errors
/// The socket's; `UnexpectedEof` when the peer closes first; `InvalidInput` for a range
/// outside the buffer.
pub(crate) fn recv_into(
    sock: &TcpStream,
    dst: &HostBuffer,
    offset: usize,
    len: usize,
) -> io::Result<()> {
    let fd = sock.as_raw_fd();
    let ready = (PollFlags::POLLIN, io::ErrorKind::UnexpectedEof);
    pump(sock, dst, (offset, len), ready, |b| {
        recv(fd, b, MsgFlags::MSG_DONTWAIT)
    })
}

/// Send `len` bytes of `src` at `offset` on `sock`.
///
/// # Errors
/// The socket's; `InvalidInput` for a range outside the buffer.
pub(crate) fn send_from(
    sock: &TcpStream,
    src: &HostBuffer,
    offset: usize,
    len: usize,
) -> io::Result<()> {
    let fd = sock.as_raw_fd();
    let ready = (PollFlags::POLLOUT, io::ErrorKind::WriteZero);
    pump(sock, src, (offset, len), ready, |b| {
        send(fd, b, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    #[test]
    fn bytes_go_straight_between_buffers_and_sockets() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let src = HostBuffer::new(8 << 20).unwrap();
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 + i / 4099) as u8).collect();
        src.write(0, &bytes).unwrap();
        let dst = HostBuffer::new(8 << 20).unwrap();
        let t = std::thread::spawn(move || recv_into(&b, &dst, 100, (8 << 20) - 200).map(|()| dst));
        send_from(&a, &src, 50, (8 << 20) - 200).unwrap();
        let dst = t.join().unwrap().unwrap();
        let mut got = vec![0u8; (8 << 20) - 200];
        dst.read(100, &mut got).unwrap();
        assert!(got == bytes[50..(8 << 20) - 150], "every byte");
        // outside the buffer: an error, nothing sent
        assert!(send_from(&a, &src, 8 << 20, 1).is_err());
        // the peer closing first is an error, not a hang
        let (c, _) = {
            let mut x = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let y = l.accept().unwrap();
            x.write_all(b"abc").unwrap();
            drop(x);
            y
        };
        let e = recv_into(&c, &src, 0, 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let mut rest = Vec::new();
        let _ = a.read_to_end(&mut rest);
    }
}
