//! A new rule file for a running layer-7 limiter without losing buckets:
//! the limiter it makes shares, for every rule whose fingerprint (match,
//! key, limits) is unchanged, the old one's key states, aggregate state
//! and counters; so it does for a rule whose limits alone changed, its
//! GCRA state carried over to the new limits (the same fraction of the
//! burst in use; window counts kept), as the kernel's is; rules added or
//! otherwise changed start afresh.
//! [`Reloadable`] is what a server holds to swap limiters between two
//! requests: a request is judged whole by the limiter it started with.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::Ordering},
};

use arc_swap::{ArcSwap, Guard};

use limiter_common::gcra::Gcra;

use super::{Limiter, State};
use crate::{
    fleet::{Enforcer, Grant, RuleCounts, RuleRef},
    rules::{Algorithm, Limit, Rule, RuleSet},
};

impl Limiter {
    /// A limiter for `rules` that keeps this one's state of the rules it
    /// shares with it (by fingerprint, or by identity with new limits, the
    /// state carried over to them); (kept, new) rules.
    pub fn reloaded(&self, rules: RuleSet) -> (Limiter, usize) {
        let (next, kept, carrying) = self.sharing_with(rules);
        take_back(&carrying);
        (next, kept.len())
    }

    /// [`Limiter::reloaded`], and the rules it kept (old index to new),
    /// and the states of rules with new limits, carried conservatively
    /// (see [`carry`]) until [`take_back`].
    fn sharing_with(&self, rules: RuleSet) -> (Limiter, HashMap<usize, usize>, Vec<Carried>) {
        let mut next = Limiter::new(rules, Arc::clone(&self.clock));
        next.digest = Arc::clone(&self.digest);
        let old: HashMap<u64, usize> = self
            .rules
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| (r.fingerprint(), i))
            .collect();
        let mut kept: HashMap<usize, usize> = next
            .rules
            .rules
            .iter()
            .enumerate()
            .filter_map(|(j, r)| old.get(&r.fingerprint()).map(|&i| (i, j)))
            .collect();
        // Then rules whose limits alone changed: the kernel's rule (see
        // `Engine::apply`).
        let mut same_keys: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, r) in self.rules.rules.iter().enumerate().rev() {
            if !kept.contains_key(&i) {
                same_keys.entry(r.identity()).or_default().push(i);
            }
        }
        let kept_new: Vec<usize> = kept.values().copied().collect();
        let mut changed = Vec::new();
        for (j, r) in next.rules.rules.iter().enumerate() {
            if !kept_new.contains(&j)
                && let Some(i) = same_keys.get_mut(&r.identity()).and_then(Vec::pop)
            {
                kept.insert(i, j);
                changed.push((i, j));
            }
        }
        for (&i, &j) in &kept {
            next.aggregates[j] = Arc::clone(&self.aggregates[i]);
            next.counters[j] = Arc::clone(&self.counters[i]);
        }
        self.keys.share_with(&next.keys, &kept);
        let now = self.clock.monotonic_ns();
        let mut carrying = Vec::new();
        for (i, j) in changed {
            let (from, to) = (&self.rules.rules[i], &next.rules.rules[j]);
            let [key_from, aggregate_from] = gcra_meters(from);
            let [key_to, aggregate_to] = gcra_meters(to);
            for state in self.keys.states_of(i) {
                carrying.push(carry(state, &key_from, &key_to, now));
            }
            carrying.push(carry(
                Arc::clone(&self.aggregates[i]),
                &aggregate_from,
                &aggregate_to,
                now,
            ));
        }
        (next, kept, carrying)
    }
}

/// A rule's GCRA meters whose state may be carried to new limits: the
/// key's (packets, bytes) and the aggregate's (none for a fleet-wide
/// aggregate, whose share restarts anyway).
fn gcra_meters(rule: &Rule) -> [[Option<Gcra>; 2]; 2] {
    if rule.algorithm != Algorithm::Gcra {
        return [[None; 2]; 2];
    }
    let key = match rule.limit {
        Limit::Metered { packets, bytes } => [packets.map(|r| r.gcra), bytes.map(|r| r.gcra)],
        Limit::Unlimited => [None; 2],
    };
    let aggregate = match (rule.aggregate, rule.fleet) {
        (Some(a), None) => [a.packets.map(|r| r.gcra), a.bytes.map(|r| r.gcra)],
        _ => [None; 2],
    };
    [key, aggregate]
}

/// A state whose TATs [`carry`] moved past their carried values.
pub(super) struct Carried {
    state: Arc<State>,
    excess: [u64; 2],
}

/// Carries a state's GCRA cells (packets, bytes) from meters `from` to
/// `to` before `to` is in force, as the kernel's are: each TAT to the later
/// of its own and its carried value (`Gcra::carried`), so no request has
/// more budget than either limit allows meanwhile.
fn carry(state: Arc<State>, from: &[Option<Gcra>; 2], to: &[Option<Gcra>; 2], now: u64) -> Carried {
    let mut excess = [0; 2];
    for meter in 0..2 {
        if let (Some(from), Some(to)) = (from[meter], to[meter]) {
            let _ = state.cells[meter].fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                let carried = from.carried(tat, now, &to);
                excess[meter] = tat.saturating_sub(carried);
                Some(tat.max(carried))
            });
        }
    }
    Carried { state, excess }
}

/// Takes back what [`carry`] added beyond the carried values, once the new
/// limits are in force.
fn take_back(carried: &[Carried]) {
    for c in carried {
        for (cell, &excess) in c.state.cells.iter().zip(&c.excess) {
            if excess != 0 {
                let _ = cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                    Some(tat.saturating_sub(excess))
                });
            }
        }
    }
}

/// The limiter in force, swapped whole by a reload. Reading it is a few
/// nanoseconds and never waits (`arc-swap`): every request reads it.
pub struct Reloadable {
    current: ArcSwap<Limiter>,
    /// One reload at a time.
    reloading: Mutex<()>,
    /// The last reload's taking back of carried states, while it runs.
    settling: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Reloadable {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self {
            current: ArcSwap::new(limiter),
            reloading: Mutex::new(()),
            settling: Mutex::new(None),
        }
    }

    /// Waits until the last reload's carried states hold exactly what the
    /// new limits allow (until then they may hold less: see [`carry`]).
    pub fn settle(&self) {
        let pending = self
            .settling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(pending) = pending {
            let _ = pending.join();
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
        // A change carried from states still being carried would carry
        // their conservative values.
        self.settle();
        let old = self.current.load_full();
        let (next, kept, carrying) = old.sharing_with(rules);
        let next = Arc::new(next);
        self.current.store(Arc::clone(&next));
        // Keys the old limiter made while the new one was being built.
        old.keys.share_with(&next.keys, &kept);
        // Requests still judged by the old limiter are done within moments;
        // the carried states then hold only what the new limits allow. (A
        // thread of its own: the caller may be an async task.)
        if !carrying.is_empty() {
            let pending = std::thread::spawn(move || {
                std::thread::sleep(crate::engine::GRACE);
                take_back(&carrying);
            });
            *self.settling.lock().unwrap_or_else(|p| p.into_inner()) = Some(pending);
        }
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
