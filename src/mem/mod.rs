//! Memory kvrail registers. [`HostBuffer`] is page-aligned host memory that the agent and
//! the verbs layer share; CPU access is by copy because a NIC may access it concurrently.
//! No `unsafe` here: the device reaches the pages through its registration (in
//! `transport::verbs`), the CPU through copies under a lock.

mod host;

pub use host::{HostBuffer, MemError};
