//! The clock a kept block's expiry travels in (`remote_blocks_expiry_time`, seed 003's
//! bidirectional mode): seconds of the host's `CLOCK_MONOTONIC`, what Python's
//! `time.perf_counter` reads on Linux and NixlConnector sends. Two hosts' monotonic clocks
//! share no epoch, so the engine that reads the blocks back converts the expiry with an
//! offset it measured from a round trip to the keeper (the grant question and its answer,
//! which carries the keeper's clock).

use nix::time::{clock_gettime, ClockId};

/// This host's monotonic clock, in microseconds (0 if the kernel refuses, which Linux
/// does not).
pub(crate) fn now_us() -> i64 {
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() * 1_000_000 + t.tv_nsec() / 1000)
        .unwrap_or(0)
}

/// The keeper's clock against ours, from one round trip: the question left at `sent`, the
/// answer (stamped `remote` by the keeper between the two) came back at `received`, all in
/// microseconds. Returns (offset: remote minus local, at most this far off: half the round
/// trip).
pub(crate) fn offset(sent: i64, remote: i64, received: i64) -> (i64, i64) {
    // (saturating: `remote` is a peer's word, and may be anything)
    let trip = received.saturating_sub(sent);
    let mid = sent.saturating_add(trip / 2);
    (remote.saturating_sub(mid), trip.max(0) / 2 + 1)
}

/// Whether blocks kept until `expiry_us` (in the keeper's clock) may be gone before a read
/// that starts `now_us` (ours) ends: the expiry in our clock (`offset`, off by at most
/// `error`), less a `margin` for the read itself.
pub(crate) fn expired(
    expiry_us: i64,
    (offset, error): (i64, i64),
    now_us: i64,
    margin: i64,
) -> bool {
    now_us.saturating_add(margin).saturating_add(error) >= expiry_us.saturating_sub(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3_600_000_000;
    const S: i64 = 1_000_000;

    /// The keeper's clock skewed by an hour either way (and by nothing): the offset comes
    /// out within half the round trip, and a deadline 10 s ahead in the keeper's clock is
    /// 10 s ahead here too, whatever the skew.
    #[test]
    fn a_keeper_clock_skewed_by_an_hour_either_way_converts_to_ours() {
        let local = 500 * S;
        for skew in [-HOUR, 0, HOUR] {
            // the question leaves at `local`, the keeper stamps 3 ms later, the answer is back
            // 4 ms after that (an asymmetric round trip of 7 ms)
            let stamped = local + 3_000 + skew;
            let (off, err) = offset(local, stamped, local + 7_000);
            assert!(
                (off - skew).abs() <= err,
                "skew {skew}: offset {off} +- {err}"
            );
            assert!(err < 4_000);
            let expiry = local + skew + 10 * S; // the keeper's deadline, in its clock
            assert!(
                !expired(expiry, (off, err), local + 7_000, S),
                "skew {skew}"
            );
            assert!(
                expired(expiry, (off, err), local + 9_500_000, S),
                "skew {skew}"
            );
            assert!(
                expired(expiry, (off, err), local + 11 * S, 0),
                "skew {skew}"
            );
        }
    }

    /// Measured the wrong way round (an answer before the question, a broken clock): no
    /// negative error, so a deadline is never taken as later than it is by it.
    #[test]
    fn a_round_trip_that_runs_backwards_gives_no_negative_error() {
        let (_, err) = offset(1_000, 50, 900);
        assert!(err >= 1);
    }

    /// A peer's clock at either end of the range (a peer's word, anything): no overflow;
    /// its expiry a second ahead of its clock is still a second ahead here.
    #[test]
    fn a_clock_at_the_ends_of_the_range_does_not_overflow() {
        for remote in [i64::MIN, i64::MAX] {
            let o = offset(1_000, remote, 2_000);
            let _ = expired(remote, o, 1_500, S);
            let _ = expired(i64::MAX, o, i64::MAX, i64::MAX);
            let _ = expired(i64::MIN, o, i64::MIN, 0);
        }
        let o = offset(1_000, 1 << 62, 2_000);
        assert!(!expired((1 << 62) + 2 * S, o, 2_000, S / 2));
        assert!(expired((1 << 62) + S / 2, o, 2_000, S));
    }

    #[test]
    fn the_monotonic_clock_moves_forward() {
        let a = now_us();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(now_us() >= a + 2_000);
    }
}
