//! The README's Rust example, whole: D WRITEs 4 KiB into P's registered memory with a
//! notification; P gets the notification after the bytes. `tools/check-front-door.sh` checks
//! that every line of the README's example is here, in order, and CI runs it.
//!
//! ```sh
//! cargo run --example readme
//! ```

use kvrail::agent::{Agent, AgentConfig, Desc, RemoteAccess, XferOp, XferStatus};
use std::time::Duration;

#[rustfmt::skip] // laid out as the README shows it
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = || AgentConfig { listen: "127.0.0.1:0".parse().unwrap(), ..AgentConfig::default() };
    let (p, d) = (Agent::new("prefill-0", cfg())?, Agent::new("decode-0", cfg())?);
    let kv = p.register(1 << 20, RemoteAccess::WRITE, vec![])?; // P's KV blocks
    let src = d.register(1 << 20, RemoteAccess::NONE, vec![])?;
    d.write_region(src, 0, &[7u8; 4096])?;
    let peer = d.load_remote(p.side_channel_addr())?; // metadata over P's side channel
    let x = d.create_xfer(XferOp::Write, vec![Desc::new(src, 0, 4096)], &peer,
                          vec![Desc::new(kv, 0, 4096)], Some(b"req-1 done".to_vec()))?;
    d.post(x)?;
    assert_eq!(d.wait(x, Duration::from_secs(10))?, XferStatus::Done);
    // P's notification arrives after every byte it names
    let mut notes = Vec::new();
    while notes.is_empty() && p.wait_for_notifs(Duration::from_secs(10)) {
        notes = p.get_new_notifs();
    }
    assert_eq!(notes, [("decode-0".to_string(), b"req-1 done".to_vec())]);
    let mut landed = vec![0u8; 4096];
    p.read_region(kv, 0, &mut landed)?;
    assert!(landed.iter().all(|&b| b == 7), "every byte landed");
    println!("README example: 4096 bytes written and the notification after them");
    Ok(())
}
