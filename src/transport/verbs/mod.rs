//! A small safe layer over raw ibverbs (`rdma-mummy-sys`, which dlopens `libibverbs.so.1`
//! so binaries load where rdma-core is absent).
//!
//! This is the only module of the crate with `unsafe` code; every block carries a
//! `// SAFETY:` line.
//!
//! # Resource model
//! Handles are cheap `Arc` clones; every resource holds `Arc`s of its parents
//! ([`Mr`] → [`Pd`] → [`Context`], [`Qp`] → [`Pd`] + its [`Cq`]s), so teardown happens in
//! dependency order whatever order handles are dropped in. `Drop` never panics: a failed
//! destroy verb is logged and the resource leaked.
//!
//! # In-flight memory
//! A posted work request keeps every memory region it names alive (and counted busy) until
//! its completion — or a later completion on the same queue — is polled. So posting is a
//! safe API, [`Mr::deregister`] refuses busy regions with [`Error::RegionBusy`], and memory
//! is never freed under the device.
//!
//! # Progress
//! [`Cq::with_channel`] gives a completion channel whose fd can be registered with mio;
//! [`Cq::wait`] sleeps in the kernel until a completion arrives (no spinning when idle).
//!
//! # Thread safety
//! All handles are `Send + Sync`. Posting on one QP from several threads is serialized by
//! a per-queue lock (which also keeps completion order and bookkeeping order the same).

mod cq;
mod device;
mod dmabuf;
mod error;
mod mr;
mod op;
mod pd;
mod qp;
mod range_key;
mod wc;
mod wr;

pub use crate::mem::HostBuffer;
pub use crate::rails::gid::{select_gid, Gid, GidChoice, GidEntry, GidType, LinkLayer};
pub use cq::{Completion, Cq};
pub use device::{devices, Context, DeviceAttr, DeviceInfo, Mtu, PortAttr, PortState};
pub use dmabuf::{probe_dmabuf, DmabufMr, DmabufSupport};
pub use error::{classify_device_list_errno, Error, Unavailable};
pub(crate) use mr::work_in_flight;
pub use mr::{Access, DeregisterError, Mr, RemoteRegion};
pub use pd::Pd;
pub use qp::{ConnectOptions, Endpoint, Qp, QpOptions, QpState};
pub use range_key::RangeKey;
pub use wc::WcError;
pub use wr::{OpKind, RecvWr, SendOp, SendWr, Sge, Sges};

impl Context {
    /// Choose the GID a queue pair on `port` uses (RoCEv2 + IPv4 on Ethernet, see
    /// [`select_gid`]), reading the port's link layer and GID table.
    ///
    /// # Errors
    /// Query errors, or [`Error::NoUsableGid`] with what the table holds.
    pub fn choose_gid(
        &self,
        port: u8,
        want_ip: Option<std::net::Ipv4Addr>,
    ) -> Result<GidChoice, Error> {
        let attr = self.query_port(port)?;
        let table = self.gid_table(port)?;
        select_gid(attr.link_layer, &table, want_ip).map_err(|reason| Error::NoUsableGid {
            device: self.name().to_owned(),
            port,
            reason,
        })
    }
}
