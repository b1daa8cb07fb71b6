//! "Host B": a separate process that owns the peer's device, memory and queue pair, driven
//! by the test ("host A") with JSON lines over a TCP side channel. It checks received bytes
//! itself, so nothing is trusted that did not really land in its memory.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvrail::transport::verbs::{
    Access, Completion, ConnectOptions, Context, Cq, Endpoint, Mr, Pd, Qp, QpOptions, RecvWr,
    RemoteRegion, Sge,
};
use serde::{Deserialize, Serialize};

use super::{pattern, verify_region, Segment};

/// Environment variable that turns the test binary into the peer process.
pub const PEER_ENV: &str = "KVRAIL_LAB_PEER";

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Cmd {
    /// Open `dev`, make a PD, a `size`-byte region with `access` ("r", "w", "rw"), a CQ and
    /// an RC QP on `port` with send/recv depth `depth`.
    Setup {
        dev: String,
        port: u8,
        gid_index: u32,
        size: usize,
        access: String,
        depth: u32,
    },
    Connect {
        endpoint: Endpoint,
    },
    Fill {
        segments: Vec<Segment>,
    },
    /// The whole region must hold exactly these segments (zeros elsewhere).
    Verify {
        segments: Vec<Segment>,
    },
    /// Post `count` receives; receive i gets `[i*len, (i+1)*len)` (no buffer when len = 0).
    PostRecv {
        count: usize,
        len: usize,
    },
    WaitRecv {
        count: usize,
        timeout_s: u64,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Ready {
        endpoint: Endpoint,
        region: RemoteRegion,
    },
    Ok,
    Recvs(Vec<RecvDone>),
    Error(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecvDone {
    pub wr_id: u64,
    pub op: String,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub error: Option<String>,
}

impl From<&Completion> for RecvDone {
    fn from(c: &Completion) -> Self {
        Self {
            wr_id: c.wr_id,
            op: c.op.to_string(),
            byte_len: c.byte_len,
            imm: c.imm,
            error: c.status.as_ref().err().map(|e| e.to_string()),
        }
    }
}

pub fn parse_access(s: &str) -> Access {
    let mut a = Access::LOCAL_WRITE;
    if s.contains('r') {
        a = a | Access::REMOTE_READ;
    }
    if s.contains('w') {
        a = a | Access::REMOTE_WRITE;
    }
    a
}

struct State {
    mr: Mr,
    cq: Cq,
    qp: Qp,
    _pd: Pd,
}

/// The peer process: serve sessions until stdin closes (the test process ended).
pub fn serve() -> ! {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind side channel");
    println!("PORT {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    std::thread::spawn(|| {
        let mut s = String::new();
        while std::io::stdin()
            .read_line(&mut s)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
        std::process::exit(0);
    });
    for conn in listener.incoming() {
        match conn {
            Ok(c) => session(c),
            Err(e) => eprintln!("peer: accept failed: {e}"),
        }
    }
    std::process::exit(0)
}

fn session(stream: TcpStream) {
    let mut out = stream.try_clone().expect("clone stream");
    let reader = BufReader::new(stream);
    let mut st: Option<State> = None;
    for line in reader.lines() {
        let Ok(line) = line else { break };
        let reply = match serde_json::from_str::<Cmd>(&line) {
            Ok(cmd) => handle(&mut st, cmd).unwrap_or_else(Reply::Error),
            Err(e) => Reply::Error(format!("bad command {line:?}: {e}")),
        };
        let mut s = serde_json::to_string(&reply).unwrap();
        s.push('\n');
        if out.write_all(s.as_bytes()).is_err() {
            break;
        }
    }
}

fn handle(st: &mut Option<State>, cmd: Cmd) -> Result<Reply, String> {
    let e = |e: kvrail::transport::verbs::Error| e.to_string();
    if let Cmd::Setup {
        dev,
        port,
        gid_index,
        size,
        access,
        depth,
    } = cmd
    {
        let ctx = Context::open(&dev).map_err(e)?;
        let pd = Pd::new(&ctx).map_err(e)?;
        let mr = Mr::alloc(&pd, size, parse_access(&access)).map_err(e)?;
        let cq = Cq::with_channel(&ctx, depth * 2 + 16).map_err(e)?;
        let mut o = QpOptions::new(port, gid_index);
        o.max_send_wr = depth;
        o.max_recv_wr = depth;
        let qp = Qp::new(&pd, &cq, &cq, &o).map_err(e)?;
        let reply = Reply::Ready {
            endpoint: qp.endpoint(),
            region: mr.remote(),
        };
        *st = Some(State {
            mr,
            cq,
            qp,
            _pd: pd,
        });
        return Ok(reply);
    }
    let s = st.as_mut().ok_or("no setup yet")?;
    match cmd {
        Cmd::Setup { .. } => unreachable!(),
        Cmd::Connect { endpoint } => {
            s.qp.connect(&endpoint, &ConnectOptions::default())
                .map_err(e)?
        }
        Cmd::Fill { segments } => {
            for g in segments {
                let seed = g.seed.ok_or("fill needs a seed")?;
                s.mr.write(g.offset, &pattern(seed, g.len)).map_err(e)?;
            }
        }
        Cmd::Verify { segments } => {
            let mut buf = vec![0u8; s.mr.len()];
            s.mr.read(0, &mut buf).map_err(e)?;
            verify_region(&buf, &segments)?;
        }
        Cmd::PostRecv { count, len } => {
            let wrs: Vec<RecvWr<'_>> = (0..count)
                .map(|i| RecvWr {
                    wr_id: i as u64,
                    local: (len > 0)
                        .then(|| Sge::new(&s.mr, i * len, len))
                        .into_iter()
                        .collect(),
                })
                .collect();
            s.qp.post_recv(&wrs).map_err(e)?;
        }
        Cmd::WaitRecv { count, timeout_s } => {
            let got = wait_completions(&s.cq, count, Duration::from_secs(timeout_s))?;
            return Ok(Reply::Recvs(got.iter().map(RecvDone::from).collect()));
        }
    }
    Ok(Reply::Ok)
}

/// Wait (event-driven) for `count` reported completions.
pub fn wait_completions(
    cq: &Cq,
    count: usize,
    timeout: Duration,
) -> Result<Vec<Completion>, String> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "timed out after {timeout:?} with {} of {count} completions: {out:?}",
                out.len()
            ));
        }
        cq.wait(&mut out, Some(left)).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The test side's handle on the peer process.
pub struct PeerProcess {
    child: Child,
    port: u16,
}

impl PeerProcess {
    /// Start this test binary again as the peer.
    pub fn spawn() -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .env(PEER_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawn peer: {e}"))?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let port = line
            .strip_prefix("PORT ")
            .and_then(|p| p.trim().parse().ok())
            .ok_or_else(|| format!("peer said {line:?}"))?;
        Ok(Self { child, port })
    }

    /// A new session (its own device context, region and QP on the peer).
    pub fn connect(&self) -> Result<PeerConn, String> {
        let s = TcpStream::connect(("127.0.0.1", self.port))
            .map_err(|e| format!("side channel: {e}"))?;
        s.set_nodelay(true).ok();
        Ok(PeerConn {
            reader: BufReader::new(s.try_clone().map_err(|e| e.to_string())?),
            writer: s,
        })
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        // Closing its stdin asks the peer to exit by itself (tearing its RDMA resources down
        // the normal way); SIGKILL only if it has not exited after 10 s. Both waits are
        // bounded: a child stuck in the kernel must not hang the suite.
        drop(self.child.stdin.take());
        let pid = self.child.id();
        for (what, limit) in [("exit", 10u64), ("SIGKILL", 10)] {
            if what == "SIGKILL" {
                eprintln!(
                    "verbs_lab: peer process {pid} did not exit within {limit} s; killing it"
                );
                let _ = self.child.kill();
            }
            let deadline = Instant::now() + Duration::from_secs(limit);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        eprintln!("verbs_lab: peer process {pid} is still there after SIGKILL; leaving it");
    }
}

/// One session with the peer.
pub struct PeerConn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl PeerConn {
    pub fn call(&mut self, cmd: &Cmd) -> Result<Reply, String> {
        let mut s = serde_json::to_string(cmd).unwrap();
        s.push('\n');
        self.writer
            .write_all(s.as_bytes())
            .map_err(|e| format!("side channel write: {e}"))?;
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .map_err(|e| format!("side channel read: {e}"))?;
        if line.is_empty() {
            return Err("peer closed the side channel".into());
        }
        match serde_json::from_str(&line).map_err(|e| format!("bad reply {line:?}: {e}"))? {
            Reply::Error(e) => Err(format!("peer: {e}")),
            r => Ok(r),
        }
    }

    pub fn ok(&mut self, cmd: &Cmd) -> Result<(), String> {
        match self.call(cmd)? {
            Reply::Ok => Ok(()),
            r => Err(format!("unexpected reply {r:?}")),
        }
    }
}
