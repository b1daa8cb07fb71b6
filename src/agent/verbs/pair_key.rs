//! The key of a queue pair in the engine's maps: (peer, local rail), with the peer name's
//! SipHash computed once, when the key is made.
//!
//! A transfer looked its pair up by (peer name, rail) six to eight times — planning, queueing,
//! posting, each completion, the pump after it — and each lookup hashed the name with
//! SipHash again: ~2,250 instructions of a 64 KiB transfer's ~12,300 (lab, callgrind).
//! The name is a peer's choice, so it keeps a keyed SipHash (as `crate::idhash` says of such
//! keys); the maps then mix that hash and the rail with `IdHasher`'s one multiplication.
//! A post makes one key (one hash) and changes only its rail; completions find the key,
//! shared, in the queue pair number map.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, OnceLock};

/// (peer, local rail), the peer's hash kept (see the module). `.0` the peer, `.1` the rail.
#[derive(Clone, Debug)]
pub(super) struct PairKey(pub(super) Arc<str>, pub(super) usize, u64);

/// One random SipHash key for every peer name of this process.
fn names() -> &'static std::collections::hash_map::RandomState {
    static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    KEYS.get_or_init(std::collections::hash_map::RandomState::new)
}

impl PairKey {
    /// The key of `peer`'s pair on local rail `rail`.
    pub(super) fn new(peer: &str, rail: usize) -> Self {
        Self::shared(peer.into(), rail)
    }

    /// [`PairKey::new`] with a name already shared (a transfer's: no copy of it made).
    pub(super) fn shared(peer: Arc<str>, rail: usize) -> Self {
        let h = names().hash_one(&*peer);
        Self(peer, rail, h)
    }

    /// Whether this is a pair to `peer`.
    pub(super) fn is(&self, peer: &str) -> bool {
        &*self.0 == peer
    }
}

impl PartialEq for PairKey {
    fn eq(&self, o: &Self) -> bool {
        self.1 == o.1 && self.2 == o.2 && self.0 == o.0
    }
}

impl Eq for PairKey {}

impl Hash for PairKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.2);
        state.write_usize(self.1);
    }
}

#[cfg(test)]
mod tests {
    use super::PairKey;
    use crate::idhash::IdMap;

    /// Keys are equal exactly when peer and rail are; a key whose rail was changed finds
    /// the entry of that rail; the same name hashes the same in every key.
    #[test]
    fn keys_find_their_pair_and_no_other() {
        let mut m: IdMap<PairKey, u32> = IdMap::default();
        for (i, peer) in ["a", "b", "ab", "ba", ""].iter().enumerate() {
            for rail in 0..3 {
                m.insert(PairKey::new(peer, rail), (i * 10 + rail) as u32);
            }
        }
        assert_eq!(m.len(), 15);
        let mut k = PairKey::new("ab", 0);
        assert_eq!(m.get(&k), Some(&20));
        k.1 = 2;
        assert_eq!(m.get(&k), Some(&22));
        assert!(!m.contains_key(&PairKey::new("abc", 0)));
        assert!(!m.contains_key(&PairKey::new("a", 3)));
        assert!(k.is("ab") && !k.is("a"));
        assert_ne!(PairKey::new("a", 0), PairKey::new("b", 0));
        assert_eq!(PairKey::new("a", 1), PairKey::new("a", 1));
    }
}
