//! The P/D connector (SPEC §3–4). So far: the `kv_transfer_config` it is configured with
//! ([`config`]). The engine API and the push / pull protocol drivers build on
//! [`crate::proto`].

pub mod config;
