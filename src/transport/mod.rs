//! Transports. [`verbs`] is the RDMA layer (RC queue pairs over RoCEv2 / InfiniBand);
//! [`stripe`] plans how a transfer uses the rails and when it is done.

#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;

pub mod notif;
pub mod stripe;
