//! Device list, device contexts, and device / port / GID-table queries.

use std::ffi::CStr;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as ffi;

use super::error::{classify_device_list_errno, from_ret, last_os_error, Error, Unavailable};
use crate::rails::gid::{Gid, GidEntry, GidType, LinkLayer};

/// One RDMA device as `ibv_get_device_list` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID (host byte order).
    pub guid: u64,
}

/// The RDMA devices of this host.
///
/// # Errors
/// [`Error::Unavailable`] when libibverbs is absent (errno 95), the kernel has no RDMA
/// (errno 38) or the list is empty; [`Error::GetDeviceList`] for anything else.
pub fn devices() -> Result<Vec<DeviceInfo>, Error> {
    let list = DeviceList::get()?;
    let out: Vec<DeviceInfo> = list.iter().map(|d| d.info()).collect();
    if out.is_empty() {
        return Err(Error::Unavailable(Unavailable::NoDevice));
    }
    Ok(out)
}

/// An owned `ibv_get_device_list` result, freed on drop.
struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

#[derive(Clone, Copy)]
struct RawDevice(*mut ffi::ibv_device);

impl RawDevice {
    fn name(self) -> String {
        // SAFETY: the device pointer comes from a live device list; the name is a
        // NUL-terminated string owned by libibverbs for the list's lifetime.
        let p = unsafe { ffi::ibv_get_device_name(self.0) };
        if p.is_null() {
            return String::from("?");
        }
        // SAFETY: non-null, NUL-terminated (see above); copied out immediately.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn info(self) -> DeviceInfo {
        // SAFETY: live device pointer from the list.
        let guid = unsafe { ffi::ibv_get_device_guid(self.0) };
        DeviceInfo {
            name: self.name(),
            guid: u64::from_be(guid),
        }
    }
}

impl DeviceList {
    fn get() -> Result<Self, Error> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the dlopen shim returns NULL with errno
        // EOPNOTSUPP when libibverbs.so.1 is missing, never crashes.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        match NonNull::new(list) {
            Some(list) => Ok(Self {
                list,
                len: n.max(0) as usize,
            }),
            None => Err(classify_device_list_errno(
                last_os_error().raw_os_error().unwrap_or(0),
            )),
        }
    }

    fn iter(&self) -> impl Iterator<Item = RawDevice> + '_ {
        (0..self.len).map(|i| {
            // SAFETY: the list holds `len` valid entries (followed by NULL).
            RawDevice(unsafe { *self.list.as_ptr().add(i) })
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once; contexts opened
        // from it stay valid after the list is freed (man ibv_get_device_list).
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) };
    }
}

pub(crate) struct ContextInner {
    pub(crate) ctx: NonNull<ffi::ibv_context>,
    pub(crate) name: String,
}

// SAFETY: ibv_context is thread-safe for all verbs (libibverbs locks internally where the
// provider needs it); the pointer is only freed in Drop, when no other handle exists.
unsafe impl Send for ContextInner {}
// SAFETY: see Send; shared use goes through thread-safe verbs only.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child resource holds an Arc of this context, so none is left.
        let ret = unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
        if ret != 0 {
            tracing::error!(device = %self.name, "ibv_close_device failed: {}", from_ret(ret));
        }
    }
}

/// An open RDMA device.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.name)
            .finish()
    }
}

/// What kvrail uses of `ibv_device_attr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Largest work-request count per queue.
    pub max_qp_wr: u32,
    /// Largest scatter/gather count per work request.
    pub max_sge: u32,
    /// Largest CQ size.
    pub max_cqe: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Outstanding RDMA READs a QP may have as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Outstanding RDMA READs a QP may serve as responder.
    pub max_qp_rd_atom: u32,
}

/// The state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Link down.
    Down,
    /// Initializing.
    Init,
    /// Armed.
    Armed,
    /// Up and usable.
    Active,
    /// Active, deferred.
    ActiveDefer,
    /// Anything else (`NOP`, unknown values).
    Other(u32),
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Down => f.write_str("DOWN"),
            Self::Init => f.write_str("INIT"),
            Self::Armed => f.write_str("ARMED"),
            Self::Active => f.write_str("ACTIVE"),
            Self::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            Self::Other(v) => write!(f, "state {v}"),
        }
    }
}

/// A path MTU as the verbs encode it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the verbs enum value.
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            3 => Self::Mtu1024,
            4 => Self::Mtu2048,
            5 => Self::Mtu4096,
            _ => return None,
        })
    }

    /// Bytes.
    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }

    /// From bytes: 256, 512, 1024, 2048 or 4096.
    pub fn from_bytes(b: u32) -> Option<Self> {
        (1..=5).filter_map(Self::from_raw).find(|m| m.bytes() == b)
    }
}

/// What kvrail uses of `ibv_port_attr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    /// Port number (1-based).
    pub port: u8,
    /// Port state.
    pub state: PortState,
    /// Active MTU (the path MTU of a QP is the smaller of both ends' values).
    pub active_mtu: Option<Mtu>,
    /// Largest MTU the port supports.
    pub max_mtu: Option<Mtu>,
    /// LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// GID table length.
    pub gid_tbl_len: u32,
}

impl Context {
    /// Open the device called `name`.
    ///
    /// # Errors
    /// [`Error::Unavailable`] / [`Error::GetDeviceList`] as [`devices`];
    /// [`Error::NoSuchDevice`]; [`Error::OpenDevice`].
    pub fn open(name: &str) -> Result<Self, Error> {
        let list = DeviceList::get()?;
        let Some(dev) = list.iter().find(|d| d.name() == name) else {
            let available: Vec<String> = list.iter().map(|d| d.name()).collect();
            return Err(Error::NoSuchDevice {
                name: name.to_owned(),
                available: if available.is_empty() {
                    "none".into()
                } else {
                    available.join(", ")
                },
            });
        };
        // SAFETY: `dev` is a live entry of `list`, which outlives this call.
        let ctx = unsafe { ffi::ibv_open_device(dev.0) };
        let ctx = NonNull::new(ctx).ok_or_else(|| Error::OpenDevice {
            device: name.to_owned(),
            source: last_os_error(),
        })?;
        tracing::debug!(device = name, "opened RDMA device");
        Ok(Self {
            inner: Arc::new(ContextInner {
                ctx,
                name: name.to_owned(),
            }),
        })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// `ibv_query_device`.
    ///
    /// # Errors
    /// [`Error::QueryDevice`].
    pub fn query_device(&self) -> Result<DeviceAttr, Error> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut a: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let ret = unsafe { ffi::ibv_query_device(self.raw(), &mut a) };
        if ret != 0 {
            return Err(Error::QueryDevice {
                device: self.inner.name.clone(),
                source: from_ret(ret),
            });
        }
        // SAFETY: fw_ver is a NUL-terminated C string inside the struct (zeroed first).
        let fw = unsafe { CStr::from_ptr(a.fw_ver.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok(DeviceAttr {
            fw_ver: fw,
            phys_port_cnt: a.phys_port_cnt,
            max_qp_wr: a.max_qp_wr.max(0) as u32,
            max_sge: a.max_sge.max(0) as u32,
            max_cqe: a.max_cqe.max(0) as u32,
            max_mr_size: a.max_mr_size,
            max_qp_init_rd_atom: a.max_qp_init_rd_atom.max(0) as u32,
            max_qp_rd_atom: a.max_qp_rd_atom.max(0) as u32,
        })
    }

    /// `ibv_query_port`.
    ///
    /// # Errors
    /// [`Error::QueryPort`].
    pub fn query_port(&self, port: u8) -> Result<PortAttr, Error> {
        // SAFETY: plain old data; zeroed is valid.
        let mut a: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer of the full (extended) struct size.
        let ret = unsafe { ffi::ibv_query_port(self.raw(), port, &mut a) };
        if ret != 0 {
            return Err(Error::QueryPort {
                device: self.inner.name.clone(),
                port,
                source: from_ret(ret),
            });
        }
        Ok(PortAttr {
            port,
            state: match a.state {
                ffi::ibv_port_state::IBV_PORT_DOWN => PortState::Down,
                ffi::ibv_port_state::IBV_PORT_INIT => PortState::Init,
                ffi::ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
                ffi::ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
                ffi::ibv_port_state::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
                v => PortState::Other(v),
            },
            active_mtu: Mtu::from_raw(a.active_mtu),
            max_mtu: Mtu::from_raw(a.max_mtu),
            lid: a.lid,
            link_layer: match a.link_layer {
                ffi::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                ffi::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                _ => LinkLayer::Unspecified,
            },
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
        })
    }

    /// The GID table of a port: its non-empty entries, from `ibv_query_gid_table`, or entry
    /// by entry ([`Context::gid_entry`]) where that verb is missing (rdma-core < 32).
    ///
    /// # Errors
    /// [`Error::QueryPort`], [`Error::QueryDevice`], [`Error::QueryGid`].
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>, Error> {
        let attr = self.query_port(port)?;
        // The table covers all ports; size it for every port's entries.
        let ports = self.query_device()?.phys_port_cnt.max(1) as usize;
        let cap = (attr.gid_tbl_len as usize).max(1) * ports;
        let mut raw: Vec<ffi::ibv_gid_entry> = Vec::with_capacity(cap);
        // SAFETY: the buffer has room for `cap` entries; the call writes at most that many
        // and returns how many it wrote.
        let n = unsafe { ffi::ibv_query_gid_table(self.raw(), raw.as_mut_ptr(), cap, 0) };
        if n == -(libc::EOPNOTSUPP as isize) {
            let mut out = Vec::new();
            for index in 0..attr.gid_tbl_len {
                if let Some(e) = self.gid_entry(port, index)? {
                    out.push(e);
                }
            }
            return Ok(out);
        }
        if n < 0 {
            return Err(Error::QueryGid {
                device: self.inner.name.clone(),
                port,
                source: std::io::Error::from_raw_os_error((-n) as i32),
            });
        }
        // SAFETY: the first `n` entries were initialized by ibv_query_gid_table.
        unsafe { raw.set_len((n as usize).min(cap)) };
        Ok(raw
            .iter()
            .filter(|e| e.port_num == u32::from(port))
            .map(|e| GidEntry {
                index: e.gid_index,
                // SAFETY: `raw` is the active member of the GID union.
                gid: Gid(unsafe { e.gid.raw }),
                gid_type: match e.gid_type {
                    ffi::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
                    ffi::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
                    _ => GidType::Ib,
                },
                ndev_ifindex: e.ndev_ifindex,
            })
            .collect())
    }

    /// One GID table entry (`ibv_query_gid` + `ibv_query_gid_type`); `None` for an empty
    /// slot. `ndev_ifindex` is not known this way and is 0.
    ///
    /// # Errors
    /// [`Error::QueryPort`], [`Error::QueryGid`].
    pub fn gid_entry(&self, port: u8, index: u32) -> Result<Option<GidEntry>, Error> {
        let err = |source| Error::QueryGid {
            device: self.inner.name.clone(),
            port,
            source,
        };
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: live context, valid out-pointer.
        let ret = unsafe { ffi::ibv_query_gid(self.raw(), port, index as i32, &mut gid) };
        if ret != 0 {
            return Err(err(from_ret(ret)));
        }
        // SAFETY: `raw` is the union member ibv_query_gid wrote.
        let gid = Gid(unsafe { gid.raw });
        if gid.is_zero() {
            return Ok(None);
        }
        let mut t: ffi::ibv_gid_type_sysfs = 0;
        // SAFETY: live context, valid out-pointer.
        let ret = unsafe { ffi::ibv_query_gid_type(self.raw(), port, index, &mut t) };
        if ret != 0 {
            return Err(err(from_ret(ret)));
        }
        let ethernet = self.query_port(port)?.link_layer == LinkLayer::Ethernet;
        let gid_type = match (t, ethernet) {
            (ffi::IBV_GID_TYPE_SYSFS_ROCE_V2, _) => GidType::RoceV2,
            (_, true) => GidType::RoceV1,
            (_, false) => GidType::Ib,
        };
        Ok(Some(GidEntry {
            index,
            gid,
            gid_type,
            ndev_ifindex: 0,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_values() {
        assert_eq!(Mtu::from_raw(5).map(Mtu::bytes), Some(4096));
        assert_eq!(Mtu::from_raw(1).map(Mtu::bytes), Some(256));
        assert_eq!(Mtu::from_raw(0), None);
        assert_eq!(Mtu::from_raw(6), None);
        assert!(Mtu::Mtu1024 < Mtu::Mtu4096, "path MTU = min of both ends");
    }

    #[test]
    fn port_state_names() {
        assert_eq!(PortState::Active.to_string(), "ACTIVE");
        assert_eq!(PortState::Other(9).to_string(), "state 9");
    }
}
