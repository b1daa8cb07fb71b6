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
//!
//! Two engines in one process, pull on TCP: P finishes a prefill and keeps its blocks; D's
//! request arrives with P's parameters, D's worker READs the blocks, P frees them.
//!
//! ```
//! use std::{sync::Arc, time::{Duration, Instant}};
//! use kvrail::agent::{Agent, AgentConfig, BackendChoice};
//! use kvrail::connector::config::KvTransferConfig;
//! use kvrail::connector::{agent_config, EngineRequest, KvLayout, KvTransferParams, Scheduler, Worker};
//!
//! let layout = KvLayout {
//!     layers: vec!["layer.0".into(), "layer.1".into()],
//!     num_blocks: 8,
//!     block_bytes: 2 * 16 * 32 * 2, // K and V planes x 16 tokens x 32 head size x fp16
//!     planes: 2,
//!     block_size: 16,
//!     kv_heads: 1,
//!     sliding_windows: Default::default(),
//!     physical_per_logical: 1,
//!     block_stride: 0,
//!     inner: kvrail::connector::BlockOrder::Hnd,
//! };
//! let engine = |name: &str, role: &str| -> Result<(Scheduler, Worker), Box<dyn std::error::Error>> {
//!     let json = format!(r#"{{"kv_connector": "KvrailConnector", "kv_role": "{role}", "kv_buffer_device": "cpu"}}"#);
//!     let cfg = KvTransferConfig::from_json(&json)?;
//!     let base = AgentConfig { listen: "127.0.0.1:0".parse()?, backend: BackendChoice::Tcp, ..AgentConfig::default() };
//!     let agent = Arc::new(Agent::new(name, agent_config(&cfg, &layout, base))?);
//!     let sched = Scheduler::new(cfg.clone(), name, agent.side_channel_addr(), 1);
//!     Ok((sched, Worker::new(agent, cfg, layout.clone(), 1)?))
//! };
//! let (mut p_sched, mut p_worker) = engine("prefill", "kv_producer")?;
//! let (mut d_sched, mut d_worker) = engine("decode", "kv_consumer")?;
//! let now = Instant::now();
//! let request = |params| EngineRequest { request_id: "r1".into(), prompt_tokens: 40, params };
//!
//! // P: a 40-token prompt prefilled into blocks 1-3; they stay allocated under a lease
//! let remote_decode = KvTransferParams { do_remote_decode: true, ..Default::default() };
//! let (held, params) = p_sched.request_finished(&request(Some(remote_decode)), &[1, 2, 3]);
//! assert!(held);
//! p_worker.start_load_kv(&p_sched.build_connector_meta(now), now);
//!
//! // D: the request comes with P's parameters; its 40 tokens load into D's blocks 4-6
//! let r = request(params);
//! assert_eq!(d_sched.get_num_new_matched_tokens(&r, 0, now), (40, true));
//! d_sched.update_state_after_alloc(&r, vec![4, 5, 6], 40, now);
//! d_worker.start_load_kv(&d_sched.build_connector_meta(now), now);
//! let (mut loaded, mut freed) = (false, false);
//! while !(loaded && freed) {
//!     assert!(now.elapsed() < Duration::from_secs(30), "stuck");
//!     let d = d_worker.get_finished(Instant::now());
//!     assert!(d.failed_recving.is_empty());
//!     loaded |= d.recving.iter().any(|id| id == "r1");
//!     d_sched.update_connector_output(&d);
//!     let p = p_worker.get_finished(Instant::now());
//!     freed |= p.sending.iter().any(|id| id == "r1"); // P may give blocks 1-3 back
//!     p_sched.update_connector_output(&p);
//!     std::thread::sleep(Duration::from_millis(1));
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod caches;
mod clock;
pub mod config;
mod fence;
mod layout;
pub mod linkwatch;
mod meta;
pub mod placement;
mod recent;
mod scheduler;
pub mod tp;
mod worker;
mod worker_stats;
mod writer;

pub use caches::KvCaches;
pub use layout::{BlockOrder, KvLayout, LayoutError};

use crate::agent::AgentConfig;

/// The agent settings a connector worker needs, on top of `base` (listen address, backend,
/// devices, model compatibility): the direction in the compatibility hash (pull and push
/// instances refuse to pair), the KV layout found in the engine's cache (a peer whose
/// block bytes are in another order is refused, both named), block size, `stripe_width`, `enforce_handshake_compat`, and
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
    a.kv_layout = layout.handshake_name();
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
    ConnectorMetadata, EngineRequest, Finished, HeartbeatOut, KvTransferParams, MetaDecodeError,
    ParamsError, RecvReq, SendReq, StreamReq,
};
pub use scheduler::{RequestEnd, Scheduler};
pub use worker::Worker;
