//! The sans-IO protocol core: rules as plain functions and state machines, with no sockets,
//! no threads, no clock reads and no unsafe code. Drivers feed it bytes and events and carry
//! out what it returns.
//!
//! - [`handshake`]: what two agents must agree on before one uses the other's metadata —
//!   the compatibility hash, KV layout, block size, layer membership — and the advertised
//!   address check.
//! - [`frame`]: the side channel's length-prefixed frames, decoded incrementally with a size
//!   bound, so garbage from the network is an error, never a panic or an unbounded buffer.

pub mod frame;
pub mod handshake;
