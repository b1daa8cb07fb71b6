//! Memory kvrail registers. [`HostBuffer`] is page-aligned host memory that the agent and
//! the verbs layer share; CPU access is by copy because a NIC may access it concurrently.
//! This module and `transport::verbs` are the only places with `unsafe` (raw copies here).

mod host;

pub use host::{HostBuffer, MemError};
