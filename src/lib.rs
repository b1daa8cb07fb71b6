//! kvrail moves KV-cache blocks between the prefill (P) and decode (D) instances of a
//! disaggregated LLM serving deployment, directly on raw ibverbs RC queue pairs: NIXL's
//! semantics without libnixl and without UCX.
//!
//! What is here:
//! - [`agent`]: NIXL's semantics — registration of the engine's own memory (host, NPU),
//!   metadata exchanged over a side channel with handshake checks, one-sided READ/WRITE of
//!   descriptor lists with notifications after the data — on RDMA verbs (one rail per
//!   transfer or striped, rail failover) or TCP;
//! - [`connector`]: the P/D connector's scheduler and worker roles (pull, push, leases,
//!   heterogeneous TP), configured by `kv_transfer_config`, on the sans-IO rules of [`proto`];
//! - [`transport::verbs`], a safe layer over ibverbs (devices, GID choice, protection
//!   domains, memory regions that stay alive while work uses them, completion queues with
//!   event-driven waits, RC queue pairs, batched posting); [`rails`], which finds the RDMA
//!   ports of a host, judges each one usable as a data-plane rail or not (with every reason),
//!   and selects the rails for an accelerator's NUMA node; [`mem`] and [`bounce`] for
//!   accelerator memory; [`metrics`], the counters and gauges of an agent (a JSON snapshot
//!   and a Prometheus endpoint); [`store`], agent metadata in etcd for many hosts (publish
//!   under a lease, load peers by name, follow their restarts).
//!
//! # Layers
//!
//! Each module uses only the layers below its own; `tests/layers.rs` reads every path in
//! `src/` and fails on an import from a higher layer, and on files that import each other in
//! a circle across modules (a module split over its own files — a parent and its children —
//! is one module):
//!
//! | layer | modules | what they hold |
//! |---|---|---|
//! | 5 | [`connector`] | the P/D connector's scheduler and worker, on the agent |
//! | 4 | [`agent`] | the public `Agent`, a facade (`Shared`: configuration, peers, threads) over a core without I/O (`agent/core.rs`: registrations, the transfer table, grants and their fencing, notification order and routes, counters) and drivers that report to the core and ask the facade only through traits (`control::Host`, `verbs::Host`, `backend::Backend` / `DevicePath`, `core::NotifTap`): the TCP data path, the verbs lanes and pollers, the control channel, the host bounce `agent::bounce`, the metadata store |
//! | 3 | [`store`] | agent metadata in etcd (no knowledge of the agent) |
//! | 2 | [`transport`] | verbs (devices, memory regions, queue pairs), the stripe planner, the notification channel |
//! | 1 | [`proto`], [`mem`], [`rails`] | sans-IO protocol rules; host and NPU memory; RDMA port discovery and verdicts |
//! | 0 | [`metrics`], [`threads`], `idhash` | counters and gauges; threads kvrail starts; hashing |
//!
//! Outside the layers: `kvrail-ffi` (the C ABI), `python/` (the Python package), `tools/`.
//! Inside the agent, the arrows run one way too: the facade (`mod.rs` and its `*_api.rs`
//! method files) above the drivers, the drivers above the core, the core above the
//! vocabulary (`xfer.rs`, `error.rs`, `region.rs`, `table.rs`, `metadata.rs`).
//!
//! The C ABI is the `kvrail-ffi` crate; the Python package (`kvrail`, `kvrail.nixl`,
//! `kvrail.vllm`) is `python/`.
//!
//! What kvrail does not do: it runs no engine and owns no scheduler; the protocol rules in
//! [`proto`] own no threads and read no clock.
//!
//! # Cargo features
//! - `verbs` (default): the RDMA backend. It dlopens `libibverbs.so.1` at run time, so
//!   binaries load (and report RDMA as unavailable) on hosts without rdma-core. Building it
//!   needs `cmake` and `libclang-dev`.
//! - `etcd`: agent metadata through etcd ([`store`]): publish under a lease, load peers by
//!   name, watch them. Pulls in `etcd-client` and Tokio; building it needs `protoc`.
#![warn(missing_docs, unreachable_pub)]

pub mod agent;
/// The agent's host bounce (it lives in [`agent::bounce`]; this path stays for callers).
pub use agent::bounce;
pub mod connector;
mod idhash;
pub mod mem;
pub mod metrics;
pub mod proto;
pub mod rails;
pub mod store;
pub mod threads;
pub mod transport;

#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
