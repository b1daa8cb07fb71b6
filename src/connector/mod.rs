//! The P/D connector (SPEC §3–4): the engine-facing API in two roles, as in the engine's KV
//! connector interface, connected by a serializable [`ConnectorMetadata`]:
//! - [`Scheduler`] (one per engine): `get_num_new_matched_tokens`,
//!   `update_state_after_alloc`, `build_connector_meta`, `request_finished`,
//!   `update_connector_output`;
//! - [`Worker`] (one per TP rank): `start_load_kv`, `wait_for_layer_load`, `save_kv_layer`,
//!   `wait_for_save`, `get_finished`; in push mode with its writer thread.
//!
//! Pull: P holds finished blocks under a lease; D READs them and sends
//! `<request_id>:<tp_size>`; P frees on it. Push: D registers its blocks (`PUSH_REG`); P's
//! writer matches and WRITEs, then D gets `<d_request_id>:<tp_size>`. Heartbeats renew P's
//! leases from the moment a request enters D's scheduler. The rules are the sans-IO machines
//! of [`crate::proto`]; this module only drives them. Configured by [`config`].

pub mod config;
mod layout;
mod meta;
mod scheduler;
mod worker;
mod writer;

pub use layout::KvLayout;
pub use meta::{
    ConnectorMetadata, EngineRequest, Finished, HeartbeatOut, KvTransferParams, RecvReq,
};
pub use scheduler::Scheduler;
pub use worker::Worker;
