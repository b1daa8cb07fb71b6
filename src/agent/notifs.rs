//! Notification delivery in send order. Notifications that carry a sequence number (the
//! verbs channel, and TCP once a channel failed) may arrive on two paths for one connection;
//! each is delivered once, in sequence order: duplicates are dropped and early ones wait
//! for the gap to fill.

use std::collections::BTreeMap;

use smallvec::{smallvec, SmallVec};

/// Most notifications held back waiting for an earlier one, per connection. A correct peer
/// has at most a channel's worth in flight; more is a broken peer, and its extra ones drop.
const MAX_HELD: usize = 1 << 16;
/// Most bytes held back that way, per connection (a correct peer's gap is a channel's
/// window: kilobytes, or one large notification's fragments).
const MAX_HELD_BYTES: usize = 64 << 20;

/// The delivery state of one connection's numbered notifications.
#[derive(Default)]
pub(crate) struct Ordered {
    next: u64,
    held: BTreeMap<u64, Vec<u8>>,
    held_bytes: usize,
}

impl Ordered {
    /// Take message `seq`; returns the messages now deliverable, in order (almost always
    /// just this one: kept off the heap).
    pub(crate) fn take(&mut self, seq: u64, bytes: Vec<u8>) -> SmallVec<[Vec<u8>; 1]> {
        if seq < self.next {
            return SmallVec::new(); // delivered already (sent again after a channel failed)
        }
        if seq > self.next {
            if self.held.contains_key(&seq) {
                return SmallVec::new(); // held already (sent again after a channel failed)
            }
            if self.held.len() < MAX_HELD && self.held_bytes + bytes.len() <= MAX_HELD_BYTES {
                self.held_bytes += bytes.len();
                self.held.insert(seq, bytes);
            } else {
                tracing::warn!(
                    seq,
                    next = self.next,
                    held = self.held.len(),
                    held_bytes = self.held_bytes,
                    "too many notifications (or bytes) out of order; dropped"
                );
            }
            return SmallVec::new();
        }
        let mut out: SmallVec<[Vec<u8>; 1]> = smallvec![bytes];
        self.next += 1;
        while let Some(b) = self.held.remove(&self.next) {
            self.held_bytes -= b.len();
            out.push(b);
            self.next += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Ordered;

    #[test]
    fn in_order_once_each() {
        let mut o = Ordered::default();
        assert_eq!(o.take(0, b"a".to_vec()).as_slice(), [b"a".to_vec()]);
        assert!(o.take(2, b"c".to_vec()).is_empty());
        assert!(o.take(0, b"a".to_vec()).is_empty(), "duplicate");
        assert_eq!(
            o.take(1, b"b".to_vec()).as_slice(),
            [b"b".to_vec(), b"c".to_vec()]
        );
        assert!(o.take(2, b"c".to_vec()).is_empty(), "resent after delivery");
        assert_eq!(o.take(3, b"d".to_vec()).as_slice(), [b"d".to_vec()]);
    }

    #[test]
    fn held_bytes_are_bounded() {
        let mut o = Ordered::default();
        let big = vec![7u8; 4 << 20];
        // a broken peer skips message 0 and sends 100 large ones: at most 64 MiB wait
        for seq in 1..=100 {
            assert!(o.take(seq, big.clone()).is_empty());
        }
        assert!(o.held_bytes <= super::MAX_HELD_BYTES, "{}", o.held_bytes);
        assert_eq!(o.held.len(), 16);
        // the gap fills: the held ones come out in order, and their bytes are given back
        let out = o.take(0, b"a".to_vec());
        assert_eq!(out.len(), 17);
        assert_eq!((o.held_bytes, o.held.len()), (0, 0));
    }
}
