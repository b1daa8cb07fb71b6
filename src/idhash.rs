//! A hasher for keys this process makes itself — transfer ids, connection ids, queue pair
//! numbers, rail indexes — on the per-completion and per-notification paths, where
//! SipHash's cost showed (about a tenth of a notification round trip's instructions under
//! callgrind). One multiplication per integer (Fibonacci hashing): nobody outside chooses
//! these keys, so nobody can make them collide. Keys a peer chooses (agent names, strings)
//! keep the standard SipHash maps.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes integers by one multiplication each (see the module).
#[derive(Default)]
pub(crate) struct IdHasher(u64);

/// 2^64 / φ, odd: spreads sequential keys over every bucket.
const K: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(K);
        }
    }

    /// As rustc's FxHash: the state turns by five bits before each word, so the words of a
    /// tuple key (a rail, then a queue pair number) do not cancel out in the low bits the
    /// table indexes with (without the turn, 1,024 such keys took 320 buckets of 1,024); a
    /// single word still hashes by the multiplication alone.
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A map keyed by this process's own integers (ids, queue pair numbers, rails).
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::IdHasher;

    /// Sequential ids spread over every bucket of a table their size (low bits: the bucket;
    /// high seven: the probe tag), and the hash is not the identity.
    #[test]
    fn sequential_ids_hash_to_distinct_buckets() {
        let h = BuildHasherDefault::<IdHasher>::default();
        for bits in [4u32, 10, 16] {
            let n = 1u64 << bits;
            let buckets: HashSet<u64> = (1..=n).map(|id| h.hash_one(id) & (n - 1)).collect();
            assert_eq!(buckets.len() as u64, n, "{n} ids into {n} buckets");
        }
        let tags: HashSet<u64> = (1..=1024u64).map(|id| h.hash_one(id) >> 57).collect();
        assert!(tags.len() > 100, "top-bit tags vary: {}", tags.len());
        assert_ne!(h.hash_one(7u64), 7);
    }

    /// (rail, queue pair number) keys as the engine makes them — a few rails, queue pair
    /// numbers in a run from one device — land in distinct buckets too, and the rail counts.
    #[test]
    fn rail_and_qpn_keys_spread() {
        let h = BuildHasherDefault::<IdHasher>::default();
        let keys: Vec<(usize, u32)> = (0..4usize)
            .flat_map(|rail| (0x11..0x11 + 256u32).map(move |qpn| (rail, qpn)))
            .collect();
        let buckets: HashSet<u64> = keys.iter().map(|k| h.hash_one(k) & 1023).collect();
        assert!(
            buckets.len() > 900,
            "1,024 keys into {} of 1,024 buckets",
            buckets.len()
        );
        assert_ne!(h.hash_one((0usize, 0x11u32)), h.hash_one((1usize, 0x11u32)));
        assert_ne!(h.hash_one(0x11u32), h.hash_one(0x12u32));
    }
}
