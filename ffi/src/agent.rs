//! `kvrail_agent`: create / free, memory registration, metadata, peers, notifications.

use std::collections::VecDeque;
use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use kvrail::agent::metadata::BackendKind;
use kvrail::agent::{Agent, AgentConfig, AgentError, RegionId};

use crate::result::{kvrail_result, Failure};
use crate::util::{boundary, bytes_arg, null, put, str_arg, write_bytes};

/// An agent (opaque). Create with [`kvrail_agent_new`], free with [`kvrail_agent_free`].
pub struct kvrail_agent {
    _private: [u8; 0],
}

/// What a `kvrail_agent*` points at.
pub(crate) struct AgentHandle {
    pub(crate) agent: Arc<Agent>,
    /// Notifications taken from the agent and not yet handed out.
    notifs: Mutex<VecDeque<(String, Vec<u8>)>>,
}

impl AgentHandle {
    /// A new handle (owned by the caller) for `agent`.
    pub(crate) fn boxed(agent: Arc<Agent>) -> *mut kvrail_agent {
        Box::into_raw(Box::new(Self {
            agent,
            notifs: Mutex::new(VecDeque::new()),
        }))
        .cast()
    }
}

/// Remote access: peers may not touch the region.
pub const KVRAIL_ACCESS_NONE: u32 = 0;
/// Remote access: peers may READ the region.
pub const KVRAIL_ACCESS_READ: u32 = 1;
/// Remote access: peers may WRITE the region.
pub const KVRAIL_ACCESS_WRITE: u32 = 2;

/// Backend in use: TCP.
pub const KVRAIL_BACKEND_TCP: u32 = 0;
/// Backend in use: RDMA verbs.
pub const KVRAIL_BACKEND_VERBS: u32 = 1;

/// The agent configuration from JSON (keys as in [`kvrail_agent_new`]).
pub(crate) fn parse_config(json: &str) -> Result<AgentConfig, Failure> {
    AgentConfig::from_json(json)
        .map_err(|e| Failure::new(kvrail_result::InvalidConfig, e.to_string()))
}

/// # Safety
/// `p` is NULL or a pointer from [`kvrail_agent_new`] not yet freed.
pub(crate) unsafe fn handle<'a>(p: *const kvrail_agent) -> Result<&'a AgentHandle, Failure> {
    if p.is_null() {
        return Err(null("agent"));
    }
    // SAFETY: non-NULL pointers come from `kvrail_agent_new` (a leaked Box<AgentHandle>)
    // and stay valid until `kvrail_agent_free`, by the caller's promise.
    Ok(unsafe { &*p.cast::<AgentHandle>() })
}

/// Create an agent named `name`. `config_json` may be NULL or a JSON object with the keys
/// `listen` ("ip:port" for the side channel, default "0.0.0.0:0"), `side_channel_host` (the
/// address advertised to peers, default "127.0.0.1"), `backend` ("auto", "verbs", "tcp"),
/// `stripe_width` (null or 0), `devices` (RDMA devices to use), `numa` (the accelerator's
/// NUMA node, -1 any), `enforce_handshake_compat`, and what the compatibility hash covers:
/// `model`, `dtype`, `attn_backend`, `draft_model`, `kv_layout`, `block_size`; an unknown
/// key or bad value is [`kvrail_result::InvalidConfig`] naming the key.
///
/// # Safety
/// `name` and `config_json` (if not NULL) are NUL-terminated strings; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_new(
    name: *const c_char,
    config_json: *const c_char,
    out: *mut *mut kvrail_agent,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises, passed on.
        let name = unsafe { str_arg(name, "name") }?;
        let json = if config_json.is_null() {
            ""
        } else {
            // SAFETY: non-NULL and NUL-terminated by the caller's promise.
            unsafe { str_arg(config_json, "config_json") }?
        };
        if out.is_null() {
            return Err(null("out"));
        }
        let config = parse_config(json)?;
        let agent = Agent::new(name, config)?;
        let h = Box::new(AgentHandle {
            agent: Arc::new(agent),
            notifs: Mutex::new(VecDeque::new()),
        });
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out, Box::into_raw(h).cast::<kvrail_agent>(), "out") }
    })
}

/// Free an agent (NULL is ignored). Transfer handles still alive keep its internals until
/// they are freed too.
///
/// # Safety
/// `agent` is NULL or from [`kvrail_agent_new`], and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_free(agent: *mut kvrail_agent) {
    let _ = boundary(|| {
        if !agent.is_null() {
            // SAFETY: from `kvrail_agent_new` (Box::into_raw) and freed once.
            drop(unsafe { Box::from_raw(agent.cast::<AgentHandle>()) });
        }
        Ok(())
    });
}

/// The backend the agent runs on: [`KVRAIL_BACKEND_TCP`] or [`KVRAIL_BACKEND_VERBS`].
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_backend(
    agent: *const kvrail_agent,
    out: *mut u32,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { handle(agent) }?;
        let b = match h.agent.metadata().backend {
            BackendKind::Verbs => KVRAIL_BACKEND_VERBS,
            _ => KVRAIL_BACKEND_TCP,
        };
        // SAFETY: the caller's promise.
        unsafe { put(out, b, "out") }
    })
}

/// Register `len` bytes of zeroed host memory with remote `access` (a `KVRAIL_ACCESS_*`
/// bitmask); its id goes to `*out_region`.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `out_region` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_register(
    agent: *const kvrail_agent,
    len: usize,
    access: u32,
    out_region: *mut u32,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { handle(agent) }?;
        if out_region.is_null() {
            return Err(null("out_region"));
        }
        let access = crate::memory::access(access)?;
        let id = h.agent.register(len, access, vec![])?;
        // SAFETY: checked non-NULL; writable by the caller's promise.
        unsafe { put(out_region, id.0, "out_region") }
    })
}

/// Deregister a region ([`kvrail_result::RegionBusy`] while this agent's transfers use it).
/// When it returns 0 nothing of kvrail's reads or writes the memory any more: peers'
/// transfers of it that were moving have stopped (and fail), and on verbs its keys are
/// deregistered. [`kvrail_result::Timeout`] when peers' transfers still reached it after
/// `deregister_wait_ms` (default 10000; the region stays registered).
///
/// # Safety
/// `agent` from [`kvrail_agent_new`].
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_deregister(
    agent: *const kvrail_agent,
    region: u32,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { handle(agent) }?;
        Ok(h.agent.deregister(RegionId(region))?)
    })
}

/// Copy `len` bytes from `data` into `region` at `offset`.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `data` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_write_region(
    agent: *const kvrail_agent,
    region: u32,
    offset: u64,
    data: *const u8,
    len: usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, data) = unsafe { (handle(agent)?, bytes_arg(data, len, "data")?) };
        Ok(h.agent.write_region(RegionId(region), offset, data)?)
    })
}

/// Copy `len` bytes at `offset` of `region` into `out`.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `out` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_read_region(
    agent: *const kvrail_agent,
    region: u32,
    offset: u64,
    out: *mut u8,
    len: usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { handle(agent) }?;
        if len == 0 {
            return Ok(());
        }
        if out.is_null() {
            return Err(null("out"));
        }
        // the range is checked before anything is allocated: a huge `len` is "out of range"
        let size = h.agent.region_len(RegionId(region))?;
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(AgentError::OutOfRange {
                region,
                offset,
                len: len as u64,
                size,
            }
            .into());
        }
        let mut tmp = vec![0u8; len];
        h.agent.read_region(RegionId(region), offset, &mut tmp)?;
        // SAFETY: `out` is valid for `len` bytes by the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, len) };
        Ok(())
    })
}

/// The side channel's address ("ip:port", no NUL) into `buf`; its length into `*out_len`.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `buf` valid for `len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_side_channel_addr(
    agent: *const kvrail_agent,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        unsafe {
            let h = handle(agent)?;
            write_bytes(
                h.agent.side_channel_addr().to_string().as_bytes(),
                buf,
                len,
                out_len,
            )
        }
    })
}

/// The agent's metadata (opaque bytes for a peer's [`kvrail_agent_load_remote_metadata`])
/// into `buf`; [`kvrail_result::BufferTooSmall`] if it does not fit (`kvrail_last_error`
/// says how many bytes are needed).
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `buf` valid for `len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_metadata(
    agent: *const kvrail_agent,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let h = unsafe { handle(agent) }?;
        let md = h
            .agent
            .metadata()
            .encode()
            .map_err(|e| Failure::new(kvrail_result::Metadata, e.to_string()))?;
        // SAFETY: the caller's promises.
        unsafe { write_bytes(&md, buf, len, out_len) }
    })
}

/// Load peer `name` by its name from the metadata store (the agent's JSON had
/// `metadata_store`), check the handshake and connect; the store's watch then invalidates it
/// when its key goes and loads a restarted incarnation. The name goes to `name_buf`.
/// Errors: `UNSUPPORTED` without a store, `CONNECTION` when etcd does not answer,
/// `UNKNOWN_PEER` when no agent of that name is published.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `name` NUL-terminated; `name_buf` valid for
/// `name_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_load_by_name(
    agent: *const kvrail_agent,
    name: *const c_char,
    name_buf: *mut u8,
    name_len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, name) = unsafe { (handle(agent)?, str_arg(name, "name")?) };
        let got = h.agent.load_by_name(name)?;
        // SAFETY: the caller's promises.
        unsafe { write_bytes(got.as_bytes(), name_buf, name_len, out_len) }
    })
}

/// Fetch the metadata of the peer whose side channel is at `addr` ("ip:port"), check the
/// handshake and connect; the peer's name goes to `name_buf` (length in `*out_len`).
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `addr` NUL-terminated; `name_buf` valid for
/// `name_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_load_remote(
    agent: *const kvrail_agent,
    addr: *const c_char,
    name_buf: *mut u8,
    name_len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, addr) = unsafe { (handle(agent)?, str_arg(addr, "addr")?) };
        let addr = addr.parse().map_err(|e| {
            Failure::new(
                kvrail_result::InvalidArgument,
                format!("addr {addr:?}: {e}"),
            )
        })?;
        let name = h.agent.load_remote(addr)?;
        // SAFETY: the caller's promises.
        unsafe { write_bytes(name.as_bytes(), name_buf, name_len, out_len) }
    })
}

/// Load a peer's metadata given as bytes (from its [`kvrail_agent_metadata`]) and connect;
/// the peer's name goes to `name_buf`.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `metadata` valid for `metadata_len` bytes; `name_buf`
/// valid for `name_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_load_remote_metadata(
    agent: *const kvrail_agent,
    metadata: *const u8,
    metadata_len: usize,
    name_buf: *mut u8,
    name_len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, md) = unsafe {
            (
                handle(agent)?,
                bytes_arg(metadata, metadata_len, "metadata")?,
            )
        };
        let name = h.agent.load_remote_metadata(md, None)?;
        // SAFETY: the caller's promises.
        unsafe { write_bytes(name.as_bytes(), name_buf, name_len, out_len) }
    })
}

/// Send a notification (`len` bytes) to `peer`.
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; `peer` NUL-terminated; `data` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_send_notif(
    agent: *const kvrail_agent,
    peer: *const c_char,
    data: *const u8,
    len: usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let (h, peer, data) = unsafe {
            (
                handle(agent)?,
                str_arg(peer, "peer")?,
                bytes_arg(data, len, "data")?,
            )
        };
        Ok(h.agent.send_notif(peer, data.to_vec())?)
    })
}

/// Take the oldest received notification: its sender's name into `peer_buf` (length in
/// `*out_peer_len`) and its bytes into `buf` (length in `*out_len`); `*out_got` is false
/// (and nothing else written) when there is none. If either buffer is too small the
/// notification stays queued ([`kvrail_result::BufferTooSmall`]).
///
/// # Safety
/// `agent` from [`kvrail_agent_new`]; buffers valid for their lengths; the out-pointers
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_get_notif(
    agent: *const kvrail_agent,
    peer_buf: *mut u8,
    peer_len: usize,
    out_peer_len: *mut usize,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
    out_got: *mut bool,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promise.
        let h = unsafe { handle(agent) }?;
        if out_got.is_null() || out_peer_len.is_null() || out_len.is_null() {
            return Err(null("out_got, out_peer_len or out_len"));
        }
        let mut q = h.notifs.lock().unwrap_or_else(|p| p.into_inner());
        q.extend(h.agent.get_new_notifs());
        let Some((from, bytes)) = q.front() else {
            // SAFETY: checked non-NULL; writable by the caller's promise.
            return unsafe { put(out_got, false, "out_got") };
        };
        if from.len() > peer_len || bytes.len() > len {
            return Err(Failure::new(
                kvrail_result::BufferTooSmall,
                format!(
                    "the notification needs {} bytes for the peer name and {} for the data \
                     (buffers: {peer_len}, {len})",
                    from.len(),
                    bytes.len()
                ),
            ));
        }
        // SAFETY: the caller's promises; both fit (checked above).
        unsafe {
            write_bytes(from.as_bytes(), peer_buf, peer_len, out_peer_len)?;
            write_bytes(bytes, buf, len, out_len)?;
            put(out_got, true, "out_got")?;
        }
        q.pop_front();
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_keys_are_named_in_errors() {
        assert!(parse_config("").is_ok());
        let c = parse_config(r#"{"backend":"tcp","listen":"127.0.0.1:0","stripe_width":0}"#)
            .unwrap_or_else(|f| panic!("{}", f.1));
        assert_eq!(c.backend, kvrail::agent::BackendChoice::Tcp);
        for (json, key) in [
            (r#"{"bakend":"tcp"}"#, "bakend"),
            (r#"{"backend":"ucx"}"#, "backend"),
            (r#"{"listen":"nowhere"}"#, "listen"),
            (r#"{"side_channel_host":"x"}"#, "side_channel_host"),
        ] {
            let Err(Failure(code, msg)) = parse_config(json) else {
                panic!("{json} accepted")
            };
            assert_eq!(code, kvrail_result::InvalidConfig);
            assert!(msg.contains(key), "{msg}");
        }
    }
}
