//! `kvrail-tcp-floor` — what one TCP connection on this host does for small transfers with no
//! engine at all: the floor under `kvrail-perf --transport tcp -s SIZE -t DEPTH`'s transfer
//! rate, measured in the same run (`python/bench-peers.py` prints both).
//!
//! Two processes, one thread each. The client keeps DEPTH messages (a 16-byte header — length,
//! id — and SIZE bytes from its own buffer) in flight and sends every new burst with one
//! `writev`; the server reads into a 256 KiB buffer, copies each payload out to a buffer of its
//! own, and answers everything one read brought with one `write` of 8-byte ids. No checks of
//! the bytes, no threads, no notifications: the kernel's socket work and two copies a message.
//!
//! ```text
//! kvrail-tcp-floor --server PORT                  # prints "READY", serves one client
//! kvrail-tcp-floor --client PORT SIZE DEPTH SECS  # prints "<transfers> per second"
//! ```

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Largest message the server takes (the client's SIZE).
const MAX_SIZE: usize = 64 << 10;
const HEADER: usize = 16;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, what: &str| -> Result<u64, String> {
        let a = args.get(i).ok_or(format!("missing {what}"))?;
        a.parse().map_err(|e| format!("{what} {a:?}: {e}"))
    };
    let res = match args.first().map(String::as_str) {
        Some("--server") => {
            num(1, "PORT").and_then(|p| server(port(p)?).map_err(|e| e.to_string()))
        }
        Some("--client") => (|| {
            let (p, size, depth, secs) = (
                num(1, "PORT")?,
                num(2, "SIZE")?,
                num(3, "DEPTH")?,
                num(4, "SECS")?,
            );
            if size == 0 || size as usize > MAX_SIZE || !(1..=1024).contains(&depth) {
                return Err(format!("SIZE 1..={MAX_SIZE}, DEPTH 1..=1024"));
            }
            let rate = client(
                port(p)?,
                size as usize,
                depth as usize,
                Duration::from_secs(secs),
            )
            .map_err(|e| e.to_string())?;
            println!("{rate:.0} per second");
            Ok(())
        })(),
        _ => Err("usage: kvrail-tcp-floor --server PORT | --client PORT SIZE DEPTH SECS".into()),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvrail-tcp-floor: {e}");
            ExitCode::FAILURE
        }
    }
}

fn port(p: u64) -> Result<u16, String> {
    u16::try_from(p).map_err(|_| format!("PORT {p} is not a port"))
}

fn server(port: u16) -> std::io::Result<()> {
    let l = TcpListener::bind(("127.0.0.1", port))?;
    println!("READY");
    std::io::stdout().flush()?;
    let (mut s, _) = l.accept()?;
    s.set_nodelay(true)?;
    let (mut buf, mut have) = (vec![0u8; 256 << 10], 0);
    let mut dst = vec![0u8; 32 * MAX_SIZE];
    let mut acks = Vec::new();
    loop {
        let n = s.read(&mut buf[have..])?;
        if n == 0 {
            return Ok(());
        }
        have += n;
        let mut at = 0;
        while have - at >= HEADER {
            let (len, id) = header(&buf[at..at + HEADER]);
            if len > MAX_SIZE {
                return Err(std::io::Error::other(format!("a message of {len} bytes")));
            }
            if have - at < HEADER + len {
                break;
            }
            let slot = (id % 32) as usize * MAX_SIZE;
            dst[slot..slot + len].copy_from_slice(&buf[at + HEADER..at + HEADER + len]);
            acks.extend_from_slice(&id.to_le_bytes());
            at += HEADER + len;
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if !acks.is_empty() {
            s.write_all(&acks)?;
            acks.clear();
        }
    }
}

fn header(h: &[u8]) -> (usize, u64) {
    let mut len = [0u8; 8];
    len.copy_from_slice(&h[..8]);
    let mut id = [0u8; 8];
    id.copy_from_slice(&h[8..16]);
    (u64::from_le_bytes(len) as usize, u64::from_le_bytes(id))
}

/// Transfers a second: DEPTH in flight for `secs`, each new burst in one `writev`.
fn client(port: u16, size: usize, depth: usize, secs: Duration) -> std::io::Result<f64> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let src = vec![7u8; size * depth];
    let mut heads = vec![[0u8; HEADER]; depth];
    let (mut next, mut done, mut burst) = (0u64, 0u64, depth);
    let (mut answers, mut have) = (vec![0u8; 8 * 4096], 0);
    let t0 = Instant::now();
    while t0.elapsed() < secs {
        for h in heads.iter_mut().take(burst) {
            h[..8].copy_from_slice(&(size as u64).to_le_bytes());
            h[8..].copy_from_slice(&next.to_le_bytes());
            next += 1;
        }
        let mut iov: Vec<IoSlice<'_>> = (heads.iter().take(burst).enumerate())
            .flat_map(|(k, h)| {
                [
                    IoSlice::new(h),
                    IoSlice::new(&src[k * size..(k + 1) * size]),
                ]
            })
            .collect();
        let mut left = &mut iov[..];
        while !left.is_empty() {
            let n = s.write_vectored(left)?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut left, n);
        }
        let n = s.read(&mut answers[have..])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        have += n;
        let got = have / 8;
        answers.copy_within(got * 8..have, 0);
        have -= got * 8;
        done += got as u64;
        burst = got;
    }
    Ok(done as f64 / t0.elapsed().as_secs_f64())
}
