//! A new rule file for a running layer-7 limiter without losing buckets:
//! the limiter it makes shares, for every rule whose fingerprint (match,
//! key, limits) is unchanged, the old one's key states, aggregate state
//! and counters; rules added or changed start afresh, as the kernel's do.
//! [`Reloadable`] is what a server holds to swap limiters between two
//! requests: a request is judged whole by the limiter it started with.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock, atomic::Ordering},
};

use super::Limiter;
use crate::{
    fleet::{Enforcer, Grant, RuleCounts, RuleRef},
    rules::RuleSet,
};

impl Limiter {
    /// A limiter for `rules` that keeps this one's state of the rules it
    /// shares with it (by fingerprint); (kept, new) rules.
    pub fn reloaded(&self, rules: RuleSet) -> (Limiter, usize) {
        let mut next = Limiter::new(rules, Arc::clone(&self.clock));
        next.digest = Arc::clone(&self.digest);
        let old: HashMap<u64, usize> = self
            .rules
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| (r.fingerprint(), i))
            .collect();
        // Old rule index -> new rule index.
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
        {
            let keys = self.keys.lock().expect("key map lock");
            let mut next_keys = next.keys.lock().expect("key map lock");
            for ((i, key), state) in keys.iter() {
                if let Some(&j) = kept.get(i) {
                    next_keys.insert((j, *key), Arc::clone(state));
                }
            }
        }
        next.key_alloc_failed.store(
            self.key_alloc_failed.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let n = kept.len();
        (next, n)
    }
}

/// The limiter in force, swapped whole by a reload.
pub struct Reloadable(RwLock<Arc<Limiter>>);

impl Reloadable {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self(RwLock::new(limiter))
    }

    /// The limiter in force now.
    pub fn current(&self) -> Arc<Limiter> {
        Arc::clone(&self.0.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Puts `rules` in force, keeping the state of unchanged rules; how
    /// many rules kept their state.
    pub fn reload(&self, rules: RuleSet) -> usize {
        let mut current = self.0.write().unwrap_or_else(|p| p.into_inner());
        let (next, kept) = current.reloaded(rules);
        *current = Arc::new(next);
        kept
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
