//! A new rule file for a running layer-7 limiter without losing buckets:
//! the limiter it makes shares, for every rule whose fingerprint (match,
//! key, limits) is unchanged, the old one's key states, aggregate state
//! and counters; rules added or changed start afresh, as the kernel's do.
//! [`Reloadable`] is what a server holds to swap limiters between two
//! requests: a request is judged whole by the limiter it started with.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use arc_swap::{ArcSwap, Guard};

use super::Limiter;
use crate::{
    fleet::{Enforcer, Grant, RuleCounts, RuleRef},
    rules::RuleSet,
};

impl Limiter {
    /// A limiter for `rules` that keeps this one's state of the rules it
    /// shares with it (by fingerprint); (kept, new) rules.
    pub fn reloaded(&self, rules: RuleSet) -> (Limiter, usize) {
        let (next, kept) = self.sharing_with(rules);
        (next, kept.len())
    }

    /// [`Limiter::reloaded`], and the rules it kept (old index to new).
    fn sharing_with(&self, rules: RuleSet) -> (Limiter, HashMap<usize, usize>) {
        let mut next = Limiter::new(rules, Arc::clone(&self.clock));
        next.digest = Arc::clone(&self.digest);
        let old: HashMap<u64, usize> = self
            .rules
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| (r.fingerprint(), i))
            .collect();
        let kept: HashMap<usize, usize> = next
            .rules
            .rules
            .iter()
            .enumerate()
            .filter_map(|(j, r)| old.get(&r.fingerprint()).map(|&i| (i, j)))
            .collect();
        for (&i, &j) in &kept {
            next.aggregates[j] = Arc::clone(&self.aggregates[i]);
            next.counters[j] = Arc::clone(&self.counters[i]);
        }
        self.keys.share_with(&next.keys, &kept);
        (next, kept)
    }
}

/// The limiter in force, swapped whole by a reload. Reading it is a few
/// nanoseconds and never waits (`arc-swap`): every request reads it.
pub struct Reloadable {
    current: ArcSwap<Limiter>,
    /// One reload at a time.
    reloading: Mutex<()>,
}

impl Reloadable {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self {
            current: ArcSwap::new(limiter),
            reloading: Mutex::new(()),
        }
    }

    /// The limiter in force now, to keep.
    pub fn current(&self) -> Arc<Limiter> {
        self.current.load_full()
    }

    /// The limiter in force now, for the moment (a request's decision).
    pub fn load(&self) -> Guard<Arc<Limiter>> {
        self.current.load()
    }

    /// Puts `rules` in force, keeping the state of unchanged rules; how
    /// many rules kept their state.
    pub fn reload(&self, rules: RuleSet) -> usize {
        let _one = self.reloading.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.current.load_full();
        let (next, kept) = old.sharing_with(rules);
        let next = Arc::new(next);
        self.current.store(Arc::clone(&next));
        // Keys the old limiter made while the new one was being built.
        old.keys.share_with(&next.keys, &kept);
        kept.len()
    }
}

/// The fleet loops enforce on whichever limiter is in force.
impl Enforcer for Reloadable {
    fn counts(&self, rule: &RuleRef) -> anyhow::Result<RuleCounts> {
        self.current().counts(rule)
    }

    fn enforce(&self, rule: &RuleRef, grant: Grant) -> anyhow::Result<()> {
        self.current().enforce(rule, grant)
    }
}
