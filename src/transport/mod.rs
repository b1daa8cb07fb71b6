//! Transports. [`verbs`] is the RDMA layer (RC queue pairs over RoCEv2 / InfiniBand).

#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;
