//! The agent (NIXL's semantics): what an engine embeds instead of libnixl. So far: the
//! metadata an agent exports and a peer loads ([`metadata`]).

pub mod metadata;
