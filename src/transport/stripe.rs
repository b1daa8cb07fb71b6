//! The stripe planner (pure): turns one transfer — equal-length lists of local and remote
//! descriptors — into per-rail slices, and tracks the slices' completions to decide when the
//! transfer is done (and its notification may go) or has failed.
//!
//! - [`StripeMode::PerTransfer`] (`stripe_width` unset): the whole transfer on one rail, the
//!   one with the fewest bytes in flight (ties: round-robin), so transfers spread over rails.
//! - [`StripeMode::Striped`] (`stripe_width = 0`): the transfer's bytes cut into one
//!   contiguous share per rail (cuts on 4 KiB boundaries of the byte stream), using fewer
//!   rails when the transfer is too small to be worth cutting.
//!
//! A rail that fails mid-transfer: every slice it had that did not complete is handed back
//! ([`Progress::fail_rail`]) to be posted again on a surviving rail — one-sided READ and
//! WRITE of the same bytes are idempotent — so the transfer completes on the survivors or,
//! with none left, fails. It is never done with missing bytes: done means every slice
//! completed successfully.

use std::fmt;

use smallvec::SmallVec;

/// Rails a plan's small per-rail lists hold without the heap.
const RAILS_ON_STACK: usize = 8;
/// A list of rail indices (on the stack for up to [`RAILS_ON_STACK`] rails).
type Rails = SmallVec<[usize; RAILS_ON_STACK]>;

/// How transfers use the rails both sides share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StripeMode {
    /// Each transfer on one rail; transfers spread over the rails.
    PerTransfer,
    /// Each transfer sliced across all rails.
    Striped,
}

impl StripeMode {
    /// From the `stripe_width` setting: unset → per transfer, `0` → striped.
    ///
    /// # Errors
    /// [`StripeWidthError`] for any other value (the caller names the key).
    pub fn from_stripe_width(v: Option<i64>) -> Result<Self, StripeWidthError> {
        match v {
            None => Ok(Self::PerTransfer),
            Some(0) => Ok(Self::Striped),
            Some(n) => Err(StripeWidthError(n)),
        }
    }
}

/// A `stripe_width` other than unset or 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0} is not allowed: leave stripe_width unset (one rail per transfer) or set it to 0 \
     (stripe every transfer across all shared rails)"
)]
pub struct StripeWidthError(pub i64);

/// One descriptor pair of a transfer: `len` bytes at `local_off` of local region
/// `local_region`, and at `remote_off` of the peer's region `remote_region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescPair {
    /// Local region index.
    pub local_region: u32,
    /// Offset in it.
    pub local_off: u64,
    /// Remote region index.
    pub remote_region: u32,
    /// Offset in it.
    pub remote_off: u64,
    /// Bytes.
    pub len: u64,
}

/// A piece of one descriptor pair assigned to a rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slice {
    /// Index of the descriptor pair in the transfer.
    pub desc: usize,
    /// Local region index.
    pub local_region: u32,
    /// Local offset of the first byte.
    pub local_off: u64,
    /// Remote region index.
    pub remote_region: u32,
    /// Remote offset of the first byte.
    pub remote_off: u64,
    /// Bytes (> 0).
    pub len: u64,
}

/// Cuts in striped mode fall on multiples of this many bytes of the transfer's byte stream.
pub const STRIPE_ALIGN: u64 = 4096;
/// A rail gets a share only if the share is at least this large.
pub const MIN_STRIPE: u64 = 64 * 1024;

/// The slices of one transfer, by rail.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// `per_rail[r]`: the slices for rail `r`, in byte-stream order.
    pub per_rail: Vec<Vec<Slice>>,
}

impl Plan {
    /// Total slices.
    pub fn slices(&self) -> usize {
        self.per_rail.iter().map(Vec::len).sum()
    }

    /// Rails that got work.
    pub fn rails_used(&self) -> Vec<usize> {
        (0..self.per_rail.len())
            .filter(|&r| !self.per_rail[r].is_empty())
            .collect()
    }

    /// How many rails got work ([`Plan::rails_used`]'s length, without the list).
    pub fn rails_used_count(&self) -> usize {
        self.per_rail.iter().filter(|s| !s.is_empty()).count()
    }
}

/// Assigns transfers to rails and keeps the bytes in flight per rail.
#[derive(Debug, Clone)]
pub struct Planner {
    in_flight: Vec<u64>,
    up: Vec<bool>,
    next: usize,
}

impl Planner {
    /// A planner for `rails` rails, all up.
    pub fn new(rails: usize) -> Self {
        Self {
            in_flight: vec![0; rails],
            up: vec![true; rails],
            next: 0,
        }
    }

    /// Number of rails.
    pub fn rails(&self) -> usize {
        self.in_flight.len()
    }

    /// Mark a rail up or down; down rails get no new work.
    pub fn set_up(&mut self, rail: usize, up: bool) {
        if let Some(u) = self.up.get_mut(rail) {
            *u = up;
        }
    }

    /// Rails that are up.
    pub fn up_rails(&self) -> Vec<usize> {
        self.up_set().into_vec()
    }

    /// [`Planner::up_rails`] on the stack: every plan asks for it, and the plan's small lists
    /// were three of the ~16 allocations a verbs post made (callgrind, lab).
    fn up_set(&self) -> Rails {
        (0..self.rails()).filter(|&r| self.up[r]).collect()
    }

    /// Bytes planned on `rail` and not yet reported done.
    pub fn in_flight(&self, rail: usize) -> u64 {
        self.in_flight.get(rail).copied().unwrap_or(0)
    }

    /// Plan a transfer. Descriptors of length 0 produce no slice.
    ///
    /// # Errors
    /// When no rail is up.
    pub fn plan(&mut self, descs: &[DescPair], mode: StripeMode) -> Result<Plan, NoRail> {
        let up = self.up_set();
        if up.is_empty() {
            return Err(NoRail);
        }
        let total: u64 = descs.iter().map(|d| d.len).sum();
        let mut per_rail = vec![Vec::new(); self.rails()];
        let rails: Rails = match mode {
            StripeMode::PerTransfer => smallvec::smallvec![self.pick(&up)],
            StripeMode::Striped => {
                let n = usize::try_from((total / MIN_STRIPE).max(1))
                    .unwrap_or(usize::MAX)
                    .min(up.len());
                // start at the round-robin cursor so small striped transfers spread too
                let start = self.next % up.len();
                self.next = self.next.wrapping_add(1);
                (0..n).map(|i| up[(start + i) % up.len()]).collect()
            }
        };
        // Shares: equal parts of the byte stream, cut on STRIPE_ALIGN boundaries.
        let n = rails.len() as u64;
        // each rail gets about its share of the descriptors (one more where a cut splits
        // one): no vector grows while slices are pushed
        for &r in &rails {
            per_rail[r].reserve(descs.len() / rails.len() + 2);
        }
        let share = total.div_ceil(n).div_ceil(STRIPE_ALIGN) * STRIPE_ALIGN;
        // The stream only moves forward: rail k takes [k·share, (k+1)·share), the last one
        // the rest; the share ends are stepped over, not divided for per slice.
        let last = rails.len() - 1;
        let end_of = |k: usize| {
            if k == last {
                u64::MAX
            } else {
                (k as u64 + 1) * share
            }
        };
        let (mut k, mut share_end) = (0usize, end_of(0));
        let mut planned: SmallVec<[u64; RAILS_ON_STACK]> = smallvec::smallvec![0; rails.len()];
        let mut stream = 0u64; // byte-stream position of the current descriptor's start
        for (i, d) in descs.iter().enumerate() {
            let mut off = 0;
            while off < d.len {
                let pos = stream + off;
                while pos >= share_end {
                    k += 1;
                    share_end = end_of(k);
                }
                let len = (d.len - off).min(share_end - pos);
                per_rail[rails[k]].push(Slice {
                    desc: i,
                    local_region: d.local_region,
                    local_off: d.local_off + off,
                    remote_region: d.remote_region,
                    remote_off: d.remote_off + off,
                    len,
                });
                planned[k] += len;
                off += len;
            }
            stream += d.len;
        }
        for (k, b) in planned.into_iter().enumerate() {
            self.in_flight[rails[k]] += b;
        }
        Ok(Plan { per_rail })
    }

    /// The up rail with the fewest bytes in flight; ties go round-robin.
    fn pick(&mut self, up: &[usize]) -> usize {
        let start = self.next % up.len();
        self.next = self.next.wrapping_add(1);
        let mut best = up[start];
        for i in 1..up.len() {
            let r = up[(start + i) % up.len()];
            if self.in_flight[r] < self.in_flight[best] {
                best = r;
            }
        }
        best
    }

    /// `bytes` planned on `rail` are no longer in flight (done, failed or moved).
    pub fn release(&mut self, rail: usize, bytes: u64) {
        if let Some(f) = self.in_flight.get_mut(rail) {
            *f = f.saturating_sub(bytes);
        }
    }

    /// Re-plan slices of a failed rail on the rails still up (spread by load).
    ///
    /// # Errors
    /// When no rail is up.
    pub fn replan(&mut self, slices: &[Slice]) -> Result<Plan, NoRail> {
        let up = self.up_set();
        if up.is_empty() {
            return Err(NoRail);
        }
        let mut per_rail = vec![Vec::new(); self.rails()];
        for s in slices {
            let r = self.pick(&up);
            per_rail[r].push(*s);
            self.in_flight[r] += s.len;
        }
        Ok(Plan { per_rail })
    }
}

/// No rail is up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no rail is up: every rail to this peer has failed")]
pub struct NoRail;

/// The state of a transfer as its slices complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XferState {
    /// Slices are outstanding.
    InProgress,
    /// Every slice completed successfully: the data is in place; the notification may go.
    Done,
    /// The transfer failed (and will not complete).
    Failed(String),
}

impl fmt::Display for XferState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InProgress => f.write_str("in progress"),
            Self::Done => f.write_str("done"),
            Self::Failed(e) => write!(f, "failed: {e}"),
        }
    }
}

/// Completion bookkeeping of one planned transfer.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Slices posted on each rail and not yet completed, in post order.
    pending: Vec<Vec<Slice>>,
    failed: Option<String>,
}

/// Track `plan`, taking its lists (no copy of them: a post that is done with its plan).
impl From<Plan> for Progress {
    fn from(plan: Plan) -> Self {
        Self {
            pending: plan.per_rail,
            failed: None,
        }
    }
}

impl Progress {
    /// Track `plan`.
    pub fn new(plan: &Plan) -> Self {
        Self::from(plan.clone())
    }

    /// Slices still outstanding on `rail`.
    pub fn pending(&self, rail: usize) -> &[Slice] {
        self.pending.get(rail).map_or(&[], Vec::as_slice)
    }

    /// The oldest `n` outstanding slices on `rail` completed successfully (a queue pair
    /// completes in order). Returns their bytes.
    pub fn complete(&mut self, rail: usize, n: usize) -> u64 {
        let Some(p) = self.pending.get_mut(rail) else {
            return 0;
        };
        let n = n.min(p.len());
        p.drain(..n).map(|s| s.len).sum()
    }

    /// `rail` failed: everything outstanding on it is handed back to be re-planned.
    pub fn fail_rail(&mut self, rail: usize) -> Vec<Slice> {
        self.pending
            .get_mut(rail)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Add re-planned slices.
    pub fn add(&mut self, plan: &Plan) {
        for (r, s) in plan.per_rail.iter().enumerate() {
            if r >= self.pending.len() {
                self.pending.resize(r + 1, Vec::new());
            }
            self.pending[r].extend_from_slice(s);
        }
    }

    /// The transfer cannot complete (e.g. no rail left, or the peer's memory refused it).
    pub fn fail(&mut self, why: impl Into<String>) {
        self.failed.get_or_insert_with(|| why.into());
    }

    /// Where the transfer stands.
    pub fn state(&self) -> XferState {
        if let Some(e) = &self.failed {
            XferState::Failed(e.clone())
        } else if self.pending.iter().all(Vec::is_empty) {
            XferState::Done
        } else {
            XferState::InProgress
        }
    }
}

#[cfg(test)]
mod tests;
