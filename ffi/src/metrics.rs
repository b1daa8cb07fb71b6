//! The agent's counters and gauges (its connector worker's too): a JSON snapshot, and the
//! Prometheus text the `metrics_listen` endpoint serves.

use crate::agent::{handle, kvrail_agent};
use crate::result::kvrail_result;
use crate::util::{boundary, write_bytes};

/// Every counter and gauge of `agent` now, as JSON text into `buf`:
/// `[{"name": "kvrail_transfers_total", "kind": "counter", "labels": {"agent": "d", "op":
/// "read", "outcome": "done"}, "value": 3.0}, …]`; [`kvrail_result::BufferTooSmall`] if it
/// does not fit (`kvrail_last_error` says how many bytes are needed).
///
/// # Safety
/// `agent` from `kvrail_agent_new`; `buf` valid for `len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_metrics(
    agent: *const kvrail_agent,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let h = unsafe { handle(agent) }?;
        let text = h.agent.metrics().to_json().to_string();
        // SAFETY: the caller's promises.
        unsafe { write_bytes(text.as_bytes(), buf, len, out_len) }
    })
}

/// The same series in the Prometheus text exposition format (0.0.4) into `buf`, for an
/// engine that serves its own `/metrics`; [`kvrail_result::BufferTooSmall`] as above.
///
/// # Safety
/// As [`kvrail_agent_metrics`].
#[no_mangle]
pub unsafe extern "C" fn kvrail_agent_metrics_prometheus(
    agent: *const kvrail_agent,
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let h = unsafe { handle(agent) }?;
        let text = h.agent.metrics().render_prometheus();
        // SAFETY: the caller's promises.
        unsafe { write_bytes(text.as_bytes(), buf, len, out_len) }
    })
}
