//! Layer 7's key states: a sharded concurrent map (`dashmap`: a lookup
//! takes one shard's read lock, so requests of different keys, and of one
//! key, never wait on one another), bounded by the rule file's
//! `max_keys` with the kernel's rule: past it, keys *at rest* are
//! forgotten, least recently seen first, and a key still in debt never is.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::fast::RandomState;

use super::{State, StateKey};

pub(super) struct KeyStore {
    /// Hashed with a per-process random seed (foldhash). Its inputs are
    /// keyed 128-bit digests (header and custom keys) or addresses, which
    /// a client can only use by completing TCP handshakes from them.
    map: DashMap<StateKey, Arc<State>, RandomState>,
    /// Keys in the map (kept here: counting the shards would lock them).
    count: AtomicUsize,
    capacity: usize,
    /// One eviction scan at a time.
    evicting: Mutex<()>,
    /// No key kept can come to rest before this (monotonic ns), as the
    /// last scan found.
    no_rest_before: AtomicU64,
    /// New keys refused because every key kept was still in debt.
    pub(super) refused: AtomicU64,
}

impl KeyStore {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            map: DashMap::with_hasher(RandomState::default()),
            count: AtomicUsize::new(0),
            capacity,
            evicting: Mutex::new(()),
            no_rest_before: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Runs `f` on the key's state, created on first sight if there is
    /// room (`full` when there is not; `now` is read only then). `f` runs
    /// under the map shard's read lock, so a request meters its key without
    /// taking a reference to it (no count to raise and drop per request),
    /// and no eviction can take the key meanwhile; `f` must not use the
    /// store. `rest_ns` says when each rule's keys rest (see
    /// [`KeyStore::evict_at_rest`]). What `f` makes is returned as it is,
    /// not wrapped: a decision is a hundred bytes, and copying it out of
    /// an `Option` read back what `f` had just written in pieces (a stall,
    /// a fifth of a check's own time by `perf annotate`).
    pub(super) fn with<R>(
        &self,
        key: StateKey,
        now: impl Fn() -> u64,
        rest_ns: &[Option<u64>],
        f: impl FnOnce(&Arc<State>) -> R,
        full: impl FnOnce() -> R,
    ) -> R {
        if let Some(state) = self.map.get(&key) {
            return f(&state);
        }
        let now = now();
        if self.len() >= self.capacity {
            // A full scan only when it may free something: a flood of new
            // keys against a store full of keys in debt costs a compare.
            if now < self.no_rest_before.load(Ordering::Relaxed) {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return full();
            }
            {
                let _one = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
                if self.len() >= self.capacity {
                    let next = self.evict_at_rest(self.capacity / 2, now, rest_ns);
                    self.no_rest_before.store(next, Ordering::Relaxed);
                }
            }
            if self.len() >= self.capacity {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return full();
            }
        }
        // A key added since the last scan may come to rest before the keys
        // that scan saw.
        self.no_rest_before.fetch_min(
            // GCRA: at rest by its state, maybe at once (a lower bound).
            rest_ns[key.rule()].map_or(now, |ns| now.saturating_add(ns)),
            Ordering::Relaxed,
        );
        let state = match self.map.entry(key) {
            Entry::Occupied(entry) => entry.into_ref(),
            Entry::Vacant(entry) => {
                self.count.fetch_add(1, Ordering::Relaxed);
                let state = State::default();
                state.last_seen.store(now, Ordering::Relaxed);
                entry.insert(Arc::new(state))
            }
        };
        f(&state.downgrade())
    }

    /// Bounds memory without handing anyone a fresh burst: keys *at rest*
    /// (their meters whole again, so forgetting them gives nothing away:
    /// for GCRA, both theoretical arrival times passed, as the kernel's
    /// table decides; for windows and logs, unseen for as long as their
    /// counts take to expire) are forgotten, least recently seen first,
    /// down to `keep`. A key still in debt is never forgotten, as in the
    /// kernel's key table: when only such keys are left, the caller
    /// refuses the new key. A key whose state a request still holds (an
    /// upload's byte meter, a request in flight) is not at rest.
    /// Returns the earliest time a key kept could next come to rest:
    /// until then, no scan can free anything.
    fn evict_at_rest(&self, keep: usize, now: u64, rest_ns: &[Option<u64>]) -> u64 {
        let rests_at = |key: &StateKey, state: &State| {
            let meters = match rest_ns[key.rule()] {
                // GCRA: when every TAT has passed (0: never charged),
                // a third limit's (a daily quota, say) too.
                None => state
                    .cells
                    .iter()
                    .map(|c| c.load(Ordering::Acquire))
                    .max()
                    .unwrap_or(0),
                Some(ns) => state.last_seen().saturating_add(ns),
            };
            // A key blocked by escalation is kept until its block ends.
            meters.max(state.blocked_until.load(Ordering::Acquire))
        };
        let at_rest = |key: &StateKey, state: &Arc<State>| {
            rests_at(key, state) <= now && Arc::strong_count(state) == 1
        };
        let mut next_rest = u64::MAX;
        let mut resting: Vec<(u64, StateKey)> = Vec::new();
        for entry in self.map.iter() {
            let (key, state) = (entry.key(), entry.value());
            if at_rest(key, state) {
                resting.push((state.last_seen(), *key));
            } else {
                next_rest = next_rest.min(rests_at(key, state).max(now.saturating_add(1)));
            }
        }
        let n = self.len().saturating_sub(keep).min(resting.len());
        if n < resting.len() {
            resting.select_nth_unstable_by_key(n, |(seen, _)| *seen);
        }
        for (_, key) in &resting[..n] {
            // Unless a request took it up since.
            if self.map.remove_if(key, at_rest).is_some() {
                self.count.fetch_sub(1, Ordering::Relaxed);
            }
        }
        next_rest
    }

    /// Shares the states of the rules `kept` maps (this store's rule index
    /// to `next`'s) with `next`, where it has none of its own yet; the
    /// states it shared, by this store's rule index.
    pub(super) fn share_with(
        &self,
        next: &KeyStore,
        kept: &HashMap<usize, usize>,
    ) -> Vec<(usize, Arc<State>)> {
        let mut shared = Vec::new();
        for entry in self.map.iter() {
            let (key, state) = (*entry.key(), entry.value());
            let i = key.rule();
            if let Some(&j) = kept.get(&i)
                && let Entry::Vacant(vacant) = next.map.entry(key.new_rule(j))
            {
                vacant.insert(Arc::clone(state));
                next.count.fetch_add(1, Ordering::Relaxed);
                shared.push((i, Arc::clone(state)));
            }
        }
        next.refused
            .fetch_max(self.refused.load(Ordering::Relaxed), Ordering::Relaxed);
        shared
    }
}
