//! The sans-IO protocol core: rules as plain functions and state machines, with no sockets,
//! no threads, no clock reads and no unsafe code. Drivers feed it bytes and events and carry
//! out what it returns.
//!
//! - [`handshake`]: what two agents must agree on before one uses the other's metadata —
//!   the compatibility hash, KV layout, block size, layer membership — and the advertised
//!   address check.
//! - [`frame`]: the side channel's length-prefixed frames, decoded incrementally with a size
//!   bound, so garbage from the network is an error, never a panic or an unbounded buffer.

//! - [`kvmsg`]: the P/D notifications (completion, `HB:`, `PUSH_REG:`) and base request ids.
//! - [`lease`]: P's leases and D's heartbeats.
//! - [`linkwatch`]: `link_down_exit_s`'s link-loss clock.
//! - [`push`]: P's push matching and D's receive accounting with its watchdog.
//! - [`select`]: which bytes cross and when (`chunk_mode`, `swa_window_mode`, `push_stream`).
//!
//! The P/D machines take `now` as an argument and report `poll_timeout()`; tests drive them
//! in virtual time (`pd_tests`), and a P/D pair with a fault script runs them together
//! (`pd_sim`).

pub mod frame;
pub mod handshake;
pub mod kvmsg;
pub mod lease;
pub mod linkwatch;
pub mod push;
pub mod select;

#[cfg(test)]
mod pd_sim;
#[cfg(test)]
mod pd_tests;
