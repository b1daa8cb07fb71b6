//! The agent's counters and gauges (its connector worker's too): a JSON snapshot, and the
//! Prometheus text the `metrics_listen` endpoint serves.

use kvrail::metrics::Registry;

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
    // SAFETY: the caller's promises, passed on.
    unsafe { render(agent, (buf, len, out_len), |r| r.to_json().to_string()) }
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
    // SAFETY: the caller's promises, passed on.
    unsafe { render(agent, (buf, len, out_len), Registry::render_prometheus) }
}

/// `agent`'s registry as `text` makes it, into the caller's buffer.
///
/// # Safety
/// As [`kvrail_agent_metrics`].
unsafe fn render(
    agent: *const kvrail_agent,
    (buf, len, out_len): (*mut u8, usize, *mut usize),
    text: impl Fn(&Registry) -> String,
) -> kvrail_result {
    boundary(|| {
        // SAFETY: the caller's promises.
        let h = unsafe { handle(agent) }?;
        let t = text(&h.agent.metrics());
        // SAFETY: the caller's promises.
        unsafe { write_bytes(t.as_bytes(), buf, len, out_len) }
    })
}
