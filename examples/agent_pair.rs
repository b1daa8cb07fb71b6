//! Two agents in one process — a prefill side that owns KV blocks and a decode side that
//! pulls them — on the best backend available here (verbs on an RDMA rail, else TCP):
//! register, load the peer's metadata, READ a descriptor list with a notification, WRITE
//! an answer back, check every byte.
//!
//! ```sh
//! cargo run --example agent_pair
//! ```

use std::time::{Duration, Instant};

use kvrail::agent::{
    Agent, AgentConfig, AgentError, Desc, RemoteAccess, XferId, XferOp, XferStatus,
};

const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 16;

fn wait(a: &Agent, x: XferId) -> Result<(), Box<dyn std::error::Error>> {
    let t = Instant::now();
    loop {
        match a.status(x)? {
            XferStatus::Done => return Ok(()),
            XferStatus::Error(e) => return Err(e.into()),
            _ if t.elapsed() > Duration::from_secs(60) => return Err("transfer timed out".into()),
            _ => std::thread::sleep(Duration::from_micros(100)),
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = || AgentConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        ..AgentConfig::default()
    };
    let prefill = Agent::new("prefill-0", cfg())?;
    let decode = Agent::new("decode-0", cfg())?;
    println!("backend: {:?}", prefill.metadata().backend);

    // P's KV blocks (readable by peers), D's destination and an answer region on P
    let kv = prefill.register((BLOCK * BLOCKS) as usize, RemoteAccess::READ, vec![])?;
    let answer = prefill.register(4096, RemoteAccess::WRITE, vec![])?;
    let blocks: Vec<u8> = (0..BLOCK * BLOCKS).map(|i| (i * 7 % 251) as u8).collect();
    prefill.write_region(kv, 0, &blocks)?;
    let dst = decode.register((BLOCK * BLOCKS) as usize, RemoteAccess::NONE, vec![])?;

    // D loads P's metadata (over P's side channel) and pulls the even blocks
    let p = decode.load_remote(prefill.side_channel_addr())?;
    let even: Vec<u64> = (0..BLOCKS).step_by(2).collect();
    let x = decode.create_xfer(
        XferOp::Read,
        even.iter()
            .map(|b| Desc::new(dst, b * BLOCK, BLOCK))
            .collect(),
        &p,
        even.iter()
            .map(|b| Desc::new(kv, b * BLOCK, BLOCK))
            .collect(),
        Some(b"req-1:1".to_vec()),
    )?;
    decode.post(x)?;
    wait(&decode, x)?;
    let mut got = vec![0u8; (BLOCK * BLOCKS) as usize];
    decode.read_region(dst, 0, &mut got)?;
    for b in &even {
        let r = (b * BLOCK) as usize..((b + 1) * BLOCK) as usize;
        if got[r.clone()] != blocks[r] {
            return Err(format!("block {b} differs").into());
        }
    }
    decode.release(x)?;
    println!(
        "decode READ {} blocks of {} KiB, byte-exact",
        even.len(),
        BLOCK >> 10
    );

    // P hears about it (the notification comes after the bytes)
    let t = Instant::now();
    let n = loop {
        let n = prefill.get_new_notifs();
        if !n.is_empty() {
            break n;
        }
        if t.elapsed() > Duration::from_secs(30) {
            return Err("no notification".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    println!(
        "prefill got {:?} from {}",
        String::from_utf8_lossy(&n[0].1),
        n[0].0
    );

    // D WRITEs an answer into P's answer region
    decode.write_region(dst, 0, b"thanks")?;
    let p = decode.load_remote(prefill.side_channel_addr())?; // P registered more since
    let x = decode.create_xfer(
        XferOp::Write,
        vec![Desc::new(dst, 0, 6)],
        &p,
        vec![Desc::new(answer, 0, 6)],
        None,
    )?;
    decode.post(x)?;
    wait(&decode, x)?;
    let mut a = [0u8; 6];
    prefill.read_region(answer, 0, &mut a)?;
    if &a != b"thanks" {
        return Err(AgentError::Unsupported("answer differs".into()).into());
    }
    println!(
        "decode WROTE its answer; prefill read {:?}",
        String::from_utf8_lossy(&a)
    );
    Ok(())
}
