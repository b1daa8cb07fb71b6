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

mod caches;
pub mod config;
mod fence;
mod layout;
pub mod linkwatch;
mod meta;
pub mod placement;
mod scheduler;
pub mod tp;
mod worker;
mod worker_stats;
mod writer;

pub use caches::KvCaches;
pub use layout::{BlockOrder, KvLayout};

use crate::agent::AgentConfig;

/// The agent settings a connector worker needs, on top of `base` (listen address, backend,
/// devices, model compatibility): the direction in the compatibility hash (pull and push
/// instances refuse to pair), block size, `stripe_width`, `enforce_handshake_compat`, and
/// on a producer the layers it owns — a pipeline-parallel stage then refuses a peer that
/// lacks one of them, and routes by layer name. A consumer (which holds every layer) does
/// not require its producers to hold all of them.
pub fn agent_config(
    cfg: &config::KvTransferConfig,
    layout: &KvLayout,
    base: AgentConfig,
) -> AgentConfig {
    let mut a = base;
    a.compat.direction = cfg.direction;
    a.block_size = layout.block_size;
    a.stripe_width = cfg.stripe_width;
    a.enforce_handshake_compat = cfg.enforce_handshake_compat;
    a.layers = layout.layers.clone();
    a.physical_per_logical = u32::try_from(layout.physical_per_logical.max(1)).unwrap_or(u32::MAX);
    a.require_layers = cfg.role != config::KvRole::Consumer;
    if cfg.cluster_secret.is_some() {
        a.cluster_secret.clone_from(&cfg.cluster_secret);
    }
    a.insecure |= cfg.insecure;
    if cfg.metadata_store.is_some() {
        a.metadata_store.clone_from(&cfg.metadata_store);
    }
    a
}
pub use meta::{
    ConnectorMetadata, EngineRequest, Finished, HeartbeatOut, KvTransferParams, RecvReq, SendReq,
    StreamReq,
};
pub use scheduler::Scheduler;
pub use worker::Worker;
