//! Work completions' failures, and the state a queue pair shares with the completion queues
//! that retire its work (its work queues and the first cause of its failure). Apart from
//! both so that neither names the other: a completion queue retires into this state, and a
//! queue pair is made on completion queues.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use rdma_mummy_sys as ffi;

use super::wr::{OpKind, WorkQueue};

/// A failed work completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WcError {
    /// The operation that failed.
    pub op: OpKind,
    /// The caller's wr_id.
    pub wr_id: u64,
    /// Queue pair number.
    pub qpn: u32,
    /// `ibv_wc_status` value.
    pub status: u32,
    /// Its symbolic name, e.g. `IBV_WC_REM_ACCESS_ERR`.
    pub status_name: &'static str,
    /// libibverbs' description (`ibv_wc_status_str`).
    pub text: String,
    /// Vendor error code.
    pub vendor_err: u32,
}

impl WcError {
    /// True for `IBV_WC_WR_FLUSH_ERR`: the request was never executed because the queue
    /// pair had already failed.
    pub fn is_flush(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    /// True for `IBV_WC_REM_ACCESS_ERR`: the peer's NIC refused the key or the range (a
    /// revoked grant's key, say).
    pub fn is_remote_access(&self) -> bool {
        self.status == ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }

    /// True when the request itself is wrong (lengths, keys, protections, remote access):
    /// it would fail on any rail. False for the path's faults — retries exhausted, flushes,
    /// a local queue-pair error when the link went away (what rxe reports), fatal errors —
    /// after which the work can move to another rail.
    pub fn is_request_fault(&self) -> bool {
        use ffi::ibv_wc_status as S;
        [
            S::IBV_WC_LOC_LEN_ERR,
            S::IBV_WC_LOC_PROT_ERR,
            S::IBV_WC_LOC_ACCESS_ERR,
            S::IBV_WC_REM_INV_REQ_ERR,
            S::IBV_WC_REM_ACCESS_ERR,
            S::IBV_WC_REM_OP_ERR,
            S::IBV_WC_REM_INV_RD_REQ_ERR,
        ]
        .contains(&self.status)
    }
}

impl fmt::Display for WcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (wr_id {}) on qpn {} failed: {} ({}, vendor_err {:#x})",
            self.op, self.wr_id, self.qpn, self.text, self.status_name, self.vendor_err
        )
    }
}

impl std::error::Error for WcError {}

/// State shared between a QP and the CQs its completions land on.
pub(crate) struct QpShared {
    send: Mutex<WorkQueue>,
    recv: Mutex<WorkQueue>,
    error: Mutex<Option<String>>,
    /// `error` holds a cause: every post looks at this first, without the lock and the copy
    /// of the cause (a lock and an `Option<String>` clone per post before).
    failed: AtomicBool,
}

impl QpShared {
    /// Work queues of `send_wr` and `recv_wr` entries, no error yet.
    pub(crate) fn new(send_wr: usize, recv_wr: usize) -> Self {
        Self {
            send: Mutex::new(WorkQueue::new(send_wr)),
            recv: Mutex::new(WorkQueue::new(recv_wr)),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
        }
    }

    pub(crate) fn queue(&self, recv: bool) -> MutexGuard<'_, WorkQueue> {
        let m = if recv { &self.recv } else { &self.send };
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn record_error(&self, e: &WcError) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        // Keep the first real cause; flushes only follow it.
        if g.is_none()
            || (!e.is_flush()
                && g.as_deref()
                    .is_some_and(|c| c.contains("IBV_WC_WR_FLUSH_ERR")))
        {
            *g = Some(e.to_string());
            self.failed.store(true, Ordering::Release);
        }
    }

    /// The first real cause of the queue pair's failure, once one was recorded.
    pub(crate) fn error(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
