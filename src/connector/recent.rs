//! A bounded memory of request ids: the newest `cap` kept, the oldest forgotten first.

use std::collections::{HashSet, VecDeque};

/// The last `cap` request ids inserted.
pub(crate) struct Recent {
    cap: usize,
    order: VecDeque<String>,
    set: HashSet<String>,
}

impl Recent {
    /// An empty memory of at most `cap` ids.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            cap,
            order: VecDeque::new(),
            set: HashSet::new(),
        }
    }

    /// Remember `id` (forgetting the oldest past `cap`); whether it was new.
    pub(crate) fn insert(&mut self, id: &str) -> bool {
        if !self.set.insert(id.to_owned()) {
            return false;
        }
        self.order.push_back(id.to_owned());
        if self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    /// Whether `id` is remembered.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.set.contains(id)
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;

    #[test]
    fn keeps_the_newest_ids_up_to_its_cap() {
        let mut r = Recent::new(2);
        r.insert("a");
        r.insert("b");
        r.insert("a"); // already there: not newer
        r.insert("c");
        assert!(!r.contains("a") && r.contains("b") && r.contains("c"));
    }
}
