//! Layer 7's key states: sharded concurrent maps (`dashmap`: a lookup
//! takes one shard's read lock, so requests of different keys, and of one
//! key, never wait on one another), bounded together by the rule file's
//! `max_keys` with the kernel's rule: past it, keys *at rest* are
//! forgotten, least recently seen first, and a key still in debt never is.
//!
//! The keys of plain rules by IPv4 client ([`PlainKeys`], the common
//! case) are kept apart from the rest, in entries a quarter the size.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::fast::RandomState;

use super::{identity::StateKey, state::State};

pub(super) struct KeyStore {
    /// Hashed with a per-process random seed (foldhash). Its inputs are
    /// keyed 128-bit digests (header and custom keys) or addresses, which
    /// a client can only use by completing TCP handshakes from them.
    map: DashMap<StateKey, Arc<State>, RandomState>,
    /// Keys in the map (kept here: counting the shards would lock them).
    count: AtomicUsize,
    /// Shared with the stores of the limiters reloads make from this one.
    pub(super) plain: Arc<PlainKeys>,
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
            plain: Arc::default(),
            capacity,
            evicting: Mutex::new(()),
            no_rest_before: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed) + self.plain.count.load(Ordering::Relaxed)
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
        // GCRA: at rest by its state, maybe at once (a lower bound).
        let rests_by = rest_ns[key.rule()].map_or(now, |ns| now.saturating_add(ns));
        if !self.room(now, rests_by, rest_ns) {
            return full();
        }
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

    /// With `f` on the state of `key`, if it has one.
    pub(super) fn get<R>(&self, key: &StateKey, f: impl FnOnce(&Arc<State>) -> R) -> Option<R> {
        self.map.get(key).map(|state| f(&state))
    }

    /// [`KeyStore::with`] for a plain rule's key by IPv4 client
    /// ([`PlainKeys::key`]). A key new to the plain keys is first looked
    /// for among the others (`elsewhere`: one a reload left there).
    #[inline]
    pub(super) fn with_plain<R>(
        &self,
        key: u64,
        now: impl Fn() -> u64,
        rest_ns: &[Option<u64>],
        f: impl FnOnce(&Plain) -> R,
        elsewhere: impl FnOnce() -> Option<R>,
        full: impl FnOnce() -> R,
    ) -> R {
        if let Some(state) = self.plain.map.get(&key) {
            return f(&state);
        }
        self.new_plain(key, now, rest_ns, f, elsewhere, full)
    }

    /// [`KeyStore::with_plain`] of a key not among the plain keys (out of
    /// line: a check of a known key is the one kept short).
    #[cold]
    #[inline(never)]
    fn new_plain<R>(
        &self,
        key: u64,
        now: impl Fn() -> u64,
        rest_ns: &[Option<u64>],
        f: impl FnOnce(&Plain) -> R,
        elsewhere: impl FnOnce() -> Option<R>,
        full: impl FnOnce() -> R,
    ) -> R {
        if let Some(judged) = elsewhere() {
            return judged;
        }
        let now = now();
        if !self.room(now, now, rest_ns) {
            return full();
        }
        let state = self.plain.map.entry(key).or_insert_with(|| {
            self.plain.count.fetch_add(1, Ordering::Relaxed);
            Plain {
                tat: AtomicU64::new(0),
                last_seen: AtomicU64::new(now),
            }
        });
        f(&state.downgrade())
    }

    /// Whether a new key, which may come to rest as soon as `rests_by`
    /// (monotonic ns), can be kept, forgetting keys at rest if the store
    /// is full (see [`KeyStore::evict_at_rest`]).
    fn room(&self, now: u64, rests_by: u64, rest_ns: &[Option<u64>]) -> bool {
        if self.len() >= self.capacity {
            // A full scan only when it may free something: a flood of new
            // keys against a store full of keys in debt costs a compare.
            if now < self.no_rest_before.load(Ordering::Relaxed) {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return false;
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
                return false;
            }
        }
        // A key added since the last scan may come to rest before the keys
        // that scan saw.
        self.no_rest_before.fetch_min(rests_by, Ordering::Relaxed);
        true
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
        let mut resting: Vec<(u64, Resting)> = Vec::new();
        for entry in self.map.iter() {
            let (key, state) = (entry.key(), entry.value());
            if at_rest(key, state) {
                resting.push((state.last_seen(), Resting::Key(*key)));
            } else {
                next_rest = next_rest.min(rests_at(key, state).max(now.saturating_add(1)));
            }
        }
        for entry in self.plain.map.iter() {
            let tat = entry.tat.load(Ordering::Acquire);
            if tat <= now {
                resting.push((entry.last_seen(), Resting::Plain(*entry.key())));
            } else {
                next_rest = next_rest.min(tat);
            }
        }
        let n = self.len().saturating_sub(keep).min(resting.len());
        if n < resting.len() {
            resting.select_nth_unstable_by_key(n, |(seen, _)| *seen);
        }
        for (_, key) in &resting[..n] {
            // Unless a request took it up since.
            match key {
                Resting::Key(key) => {
                    if self.map.remove_if(key, at_rest).is_some() {
                        self.count.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                Resting::Plain(key) => {
                    let at_rest = |_: &u64, p: &Plain| p.tat.load(Ordering::Acquire) <= now;
                    if self.plain.map.remove_if(key, at_rest).is_some() {
                        self.plain.count.fetch_sub(1, Ordering::Relaxed);
                    }
                }
            }
        }
        next_rest
    }

    /// Shares the states of the rules `kept` maps (this store's rule index
    /// to `next`'s) with `next`, where it has none of its own yet; the
    /// states it shared, by this store's rule index. A key `plain_key`
    /// names (by its new rule index and its state) is one of a rule that
    /// is plain now: its state is copied to the plain keys instead. This
    /// store's limiter goes on charging the original while it judges
    /// requests: where `folds` says so (by this store's rule index), a
    /// copy made already takes in the original's TAT if later.
    pub(super) fn share_with(
        &self,
        next: &KeyStore,
        kept: &HashMap<usize, usize>,
        plain_key: impl Fn(usize, &StateKey, &State) -> Option<u64>,
        folds: impl Fn(usize) -> bool,
    ) -> Vec<(usize, SharedState)> {
        let mut shared = Vec::new();
        for entry in self.map.iter() {
            let (key, state) = (*entry.key(), entry.value());
            let i = key.rule();
            let Some(&j) = kept.get(&i) else { continue };
            if let Some(plain) = plain_key(j, &key, state) {
                let made = || Plain {
                    tat: AtomicU64::new(state.cells[0].load(Ordering::Acquire)),
                    last_seen: AtomicU64::new(state.last_seen.load(Ordering::Relaxed)),
                };
                if next.plain.adopt(plain, made) {
                    shared.push((i, SharedState::Plain(Arc::clone(&next.plain), plain)));
                } else if folds(i) {
                    let tat = state.cells[0].load(Ordering::Acquire);
                    next.plain
                        .get(plain, |p| p.tat.fetch_max(tat, Ordering::AcqRel));
                }
            } else if let Entry::Vacant(vacant) = next.map.entry(key.new_rule(j)) {
                vacant.insert(Arc::clone(state));
                next.count.fetch_add(1, Ordering::Relaxed);
                shared.push((i, SharedState::Key(Arc::clone(state))));
            }
        }
        next.refused
            .fetch_max(self.refused.load(Ordering::Relaxed), Ordering::Relaxed);
        shared
    }

    /// Copies the plain keys of the rule in `slot` to `next`'s store,
    /// where it has none of its own yet, under the keys `key` makes of
    /// their addresses: a rule that is not plain any more. The states
    /// it made. With `folds`, a copy made already takes in the plain
    /// key's TAT if later (see [`KeyStore::share_with`]).
    pub(super) fn unplain(
        &self,
        slot: u32,
        next: &KeyStore,
        key: impl Fn(u32) -> StateKey,
        folds: bool,
    ) -> Vec<Arc<State>> {
        let mut made = Vec::new();
        self.plain.each_of(slot, |addr, plain| {
            let entry = next.map.entry(key(addr));
            if let Entry::Occupied(copy) = &entry
                && folds
            {
                let tat = plain.tat.load(Ordering::Acquire);
                copy.get().cells[0].fetch_max(tat, Ordering::AcqRel);
            }
            if let Entry::Vacant(vacant) = entry {
                let state = State::default();
                state.cells[0].store(plain.tat.load(Ordering::Acquire), Ordering::Relaxed);
                state
                    .last_seen
                    .store(plain.last_seen.load(Ordering::Relaxed), Ordering::Relaxed);
                let state = Arc::new(state);
                vacant.insert(Arc::clone(&state));
                next.count.fetch_add(1, Ordering::Relaxed);
                made.push(state);
            }
        });
        made
    }
}

/// A key's state a reload shared or copied: an `Arc` of a state, or a
/// plain key's (by its key: an entry is not held across a reload's work).
pub(super) enum SharedState {
    Key(Arc<State>),
    Plain(Arc<PlainKeys>, u64),
}

/// A key at rest that an eviction may forget.
#[derive(Clone, Copy)]
enum Resting {
    Key(StateKey),
    Plain(u64),
}

/// The keys of plain rules ([`super::classify::is_plain`]) by IPv4 client: the
/// common case, kept in 24-byte entries (the rule's slot and the address
/// in one word, then the key's [`Plain`] state), where any other key is a
/// 32-byte entry and a 64-byte state. At 10,000 keys these fit this
/// machine's 512 KiB L2 and the others do not: a check then takes no
/// miss to memory where it took one or two (`l7_counts`).
///
/// A rule's keys are found by its slot, not its index: a limiter and
/// those its reloads make share these keys, and a reload hands a rule's
/// slot on to the rule that keeps its state, so the limiters in use
/// during a swap charge the same cells, as they share the others'
/// `Arc`s.
#[derive(Default)]
pub(super) struct PlainKeys {
    map: DashMap<u64, Plain, RandomState>,
    /// Keys in the map.
    count: AtomicUsize,
    /// The slot the next plain rule gets.
    next_slot: AtomicU32,
}

/// A plain rule's key state: its GCRA request meter and when it was last
/// seen (see [`super::state::State`]'s fields of the same names).
pub(super) struct Plain {
    pub(super) tat: AtomicU64,
    pub(super) last_seen: AtomicU64,
}

impl Plain {
    pub(super) fn last_seen(&self) -> u64 {
        super::state::last_seen(&self.last_seen)
    }
}

impl PlainKeys {
    /// The key of the client `addr` (masked) under the rule in `slot`.
    pub(super) fn key(slot: u32, addr: u32) -> u64 {
        u64::from(slot) << 32 | u64::from(addr)
    }

    /// A slot no rule has had.
    pub(super) fn new_slot(&self) -> u32 {
        self.next_slot.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `f` on each key of the rule in `slot` (its address and state).
    pub(super) fn each_of(&self, slot: u32, mut f: impl FnMut(u32, &Plain)) {
        for entry in self.map.iter() {
            if (entry.key() >> 32) as u32 == slot {
                f(*entry.key() as u32, entry.value());
            }
        }
    }

    /// Gives `key` the state `made` makes, if it has none (a reload's key
    /// moved here from a rule that was not plain); whether it did.
    pub(super) fn adopt(&self, key: u64, made: impl FnOnce() -> Plain) -> bool {
        match self.map.entry(key) {
            Entry::Occupied(_) => false,
            Entry::Vacant(vacant) => {
                vacant.insert(made());
                self.count.fetch_add(1, Ordering::Relaxed);
                true
            }
        }
    }

    /// Keys kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// With `f` on the state of `key`, if it has one.
    pub(super) fn get<R>(&self, key: u64, f: impl FnOnce(&Plain) -> R) -> Option<R> {
        self.map.get(&key).map(|p| f(&p))
    }

    /// Forgets the keys of rules whose slot `live` does not name (rules a
    /// reload dropped).
    pub(super) fn keep_slots(&self, live: impl Fn(u32) -> bool) {
        self.map.retain(|key, _| {
            let keep = live((key >> 32) as u32);
            if !keep {
                self.count.fetch_sub(1, Ordering::Relaxed);
            }
            keep
        });
    }
}
