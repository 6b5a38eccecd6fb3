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
    sync::{Arc, Mutex},
};

use arc_swap::{ArcSwap, Guard};

use limiter_common::{
    gcra::Gcra,
    meter::{self, CarriedTat},
};

use super::{
    identity::StateKey,
    keys::{PlainKeys, SharedState},
    limiter::Limiter,
    state::State,
};
use crate::{
    fleet::{Enforcer, Grant, RuleCounts, RuleRef},
    rules::{
        Algorithm, Rule, RuleSet,
        pairing::{OldRule, Paired, pair},
    },
};

impl Limiter {
    /// A limiter for `rules` that keeps this one's state of the rules it
    /// shares with it (by fingerprint, or by identity with new limits, the
    /// state carried over to them); (kept, new) rules. For a limiter that
    /// judges no requests meanwhile: the carried states are final at once
    /// ([`Reloadable::reload`] swaps a limiter in use), and this limiter is
    /// not to be used after (it shares its plain keys with the new one,
    /// which forgets those of rules it dropped).
    pub fn reloaded(&self, rules: RuleSet) -> (Limiter, usize) {
        let Sharing { next, shared } = self.sharing_with(rules);
        next.forget_dropped_plain_keys();
        take_back(&shared.carrying, self.clock.monotonic_ns());
        (next, shared.kept.len())
    }

    /// The limiter for `rules` sharing this one's state, and what it shares.
    fn sharing_with(&self, rules: RuleSet) -> Sharing {
        let mut next = Limiter::new(rules, Arc::clone(&self.clock));
        next.digest = Arc::clone(&self.digest);
        // By fingerprint, then rules whose limits alone changed: paired as
        // the kernel's are (`rules::pairing`).
        let old: Vec<OldRule<'_>> = self.rules.rules.iter().map(OldRule::from).collect();
        let mut kept = HashMap::new();
        let mut changed = HashMap::new();
        for (j, paired) in pair(&old, &next.rules.rules).into_iter().enumerate() {
            match paired {
                Some(Paired::Kept(i)) => {
                    kept.insert(i, j);
                }
                Some(Paired::Carried(i)) => {
                    kept.insert(i, j);
                    changed.insert(i, j);
                }
                None => {}
            }
        }
        for (&i, &j) in &kept {
            next.aggregates[j] = Arc::clone(&self.aggregates[i]);
            next.counters[j] = Arc::clone(&self.counters[i]);
        }
        self.share_plain_slots(&mut next, &kept);
        let mut shared = Shared {
            kept,
            changed,
            carrying: Vec::new(),
            carried_plain: Default::default(),
            swapped_at: None,
        };
        for (&i, &j) in &shared.changed {
            let meters = carried_meters(&self.rules.rules[i], &next.rules.rules[j]);
            let now = self.clock.monotonic_ns();
            let aggregate = SharedState::Key(Arc::clone(&self.aggregates[i]));
            shared.carrying.push(carry(aggregate, &meters[1], now));
        }
        self.share_keys(&next, &mut shared);
        Sharing { next, shared }
    }

    /// Gives `next` this limiter's plain keys ([`super::keys::PlainKeys`]):
    /// a plain rule that keeps the state of one that was plain has its
    /// slot, so they share its keys; any other plain rule gets a new one.
    fn share_plain_slots(&self, next: &mut Limiter, kept: &HashMap<usize, usize>) {
        let plain = Arc::clone(&self.keys.plain);
        let was: HashMap<usize, u32> = kept
            .iter()
            .filter_map(|(&i, &j)| self.plain[i].map(|slot| (j, slot)))
            .collect();
        for (j, slot) in next.plain.iter_mut().enumerate() {
            if slot.is_some() {
                *slot = Some(was.get(&j).copied().unwrap_or_else(|| plain.new_slot()));
            }
        }
        next.keys.plain = plain;
    }

    /// Whether `next` lacks some of this limiter's plain rules' slots.
    fn drops_plain_slots(&self, next: &Limiter) -> bool {
        self.plain
            .iter()
            .flatten()
            .any(|slot| !next.plain.contains(&Some(*slot)))
    }

    /// Forgets the plain keys of rules this limiter does not have (a
    /// reload's dropped rules, and those no longer plain, whose keys were
    /// copied to the others).
    fn forget_dropped_plain_keys(&self) {
        let live: std::collections::HashSet<u32> = self.plain.iter().flatten().copied().collect();
        self.keys.plain.keep_slots(|slot| live.contains(&slot));
    }

    /// Shares this limiter's keys of the rules `shared` keeps with `next`
    /// (those it does not have yet), carrying those of rules with new
    /// limits. Again after the swap: keys made while `next` was built.
    fn share_keys(&self, next: &Limiter, shared: &mut Shared) {
        let now = self.clock.monotonic_ns();
        // An IPv4 client's key of a rule that is plain now is a plain key,
        // unless an escalation's block on it still holds: it stays among
        // the others, where the block does (`KeyStore::with_plain` finds
        // it there).
        let plain_key = |j: usize, key: &StateKey, state: &State| {
            let blocked = state
                .blocked_until
                .load(std::sync::atomic::Ordering::Relaxed)
                > now;
            Some(PlainKeys::key(next.plain[j]?, key.ipv4()?)).filter(|_| !blocked)
        };
        // A copy made before the swap takes in what the old limiter charged
        // since, where the limits are the same (a carried copy keeps what
        // it was carried to).
        let folds = |i: usize| shared.swapped_at.is_some() && !shared.changed.contains_key(&i);
        let mut moved = self
            .keys
            .share_with(&next.keys, &shared.kept, plain_key, folds);
        // And one of a rule that is not plain any more, not.
        for (&i, &j) in &shared.kept {
            if let (Some(slot), None) = (self.plain[i], next.plain[j]) {
                let key = |a| StateKey::v4(j, a);
                let states = self.keys.unplain(slot, &next.keys, key, folds(i));
                moved.extend(states.into_iter().map(|s| (i, SharedState::Key(s))));
            }
        }
        for (i, state) in moved {
            if let Some(&j) = shared.changed.get(&i) {
                let meters = carried_meters(&self.rules.rules[i], &next.rules.rules[j]);
                shared.carrying.push(carry(state, &meters[0], now));
            }
        }
        self.carry_plain_keys(next, shared, now);
    }

    /// Carries the plain keys of rules plain on both sides whose limits
    /// changed (shared, not copied: the first pass carries them all; the
    /// one after the swap, those the old limiter made meanwhile, seen
    /// before the swap, as the new limiter's keys are under its limits).
    fn carry_plain_keys(&self, next: &Limiter, shared: &mut Shared, now: u64) {
        let Shared {
            changed,
            carrying,
            carried_plain,
            swapped_at,
            ..
        } = shared;
        for (&i, &j) in changed.iter() {
            let (Some(slot), Some(_)) = (self.plain[i], next.plain[j]) else {
                continue;
            };
            let [meter, ..] = carried_meters(&self.rules.rules[i], &next.rules.rules[j])[0];
            let keys = &self.keys.plain;
            keys.each_of(slot, |addr, plain| {
                let key = PlainKeys::key(slot, addr);
                let made_before = swapped_at.is_none_or(|t| plain.last_seen() < t);
                if made_before && carried_plain.insert(key) {
                    // On the entry at hand: a lookup of it here would take
                    // its shard's lock a second time.
                    let tat = meter.map_or(CarriedTat::default(), |(from, to)| {
                        meter::carry(&plain.tat, &from, &to, now)
                    });
                    carrying.push(Carried {
                        state: SharedState::Plain(Arc::clone(keys), key),
                        tats: [tat, CarriedTat::default(), CarriedTat::default()],
                    });
                }
            });
        }
    }
}

/// A limiter made from another's state ([`Limiter::sharing_with`]).
struct Sharing {
    next: Limiter,
    shared: Shared,
}

/// What a limiter shares with the one it was made from.
struct Shared {
    /// Old rule index to new, for every rule whose state is shared.
    kept: HashMap<usize, usize>,
    /// Those whose limits changed (their state carried).
    changed: HashMap<usize, usize>,
    carrying: Vec<Carried>,
    /// The plain keys carried so far.
    carried_plain: std::collections::HashSet<u64>,
    /// When the new limiter was put in force (`None`: not yet).
    swapped_at: Option<u64>,
}

/// The GCRA meters whose state is carried from rule `from` to `to`, in
/// `State::cells` order (packets, bytes, third word): the key's, then the
/// aggregate's (none for a fleet-wide aggregate, whose share restarts
/// anyway).
fn carried_meters(from: &Rule, to: &Rule) -> [[Option<(Gcra, Gcra)>; 3]; 2] {
    let meters = |rule: &Rule| -> [[Option<Gcra>; 3]; 2] {
        if rule.algorithm != Algorithm::Gcra {
            return [[None; 3]; 2];
        }
        let key = rule.key_meters().map(|m| m.map(|r| r.gcra));
        let aggregate = match (rule.aggregate, rule.fleet) {
            (Some(a), None) => [a.packets.map(|r| r.gcra), a.bytes.map(|r| r.gcra), None],
            _ => [None; 3],
        };
        [key, aggregate]
    };
    let (from, to) = (meters(from), meters(to));
    std::array::from_fn(|scope| std::array::from_fn(|m| from[scope][m].zip(to[scope][m])))
}

/// A state [`carry`] carried.
pub(super) struct Carried {
    state: SharedState,
    /// Per cell (packets, bytes, third word).
    tats: [CarriedTat; 3],
}

impl SharedState {
    /// Runs `f` on each of the state's GCRA cells (packets, bytes, third
    /// word; a plain key has the first alone), if it is still kept.
    fn cells(&self, mut f: impl FnMut(usize, &std::sync::atomic::AtomicU64)) {
        match self {
            SharedState::Key(state) => state.cells.iter().enumerate().for_each(|(m, c)| f(m, c)),
            SharedState::Plain(keys, key) => {
                keys.get(*key, |plain| f(0, &plain.tat));
            }
        }
    }
}

/// Carries a state's GCRA cells (packets, bytes) over to new limits before
/// they are in force, as the kernel's are (`meter::carry`).
fn carry(state: SharedState, meters: &[Option<(Gcra, Gcra)>; 3], now: u64) -> Carried {
    let mut tats = [CarriedTat::default(); 3];
    state.cells(|m, cell| {
        if let Some((from, to)) = meters[m] {
            tats[m] = meter::carry(cell, &from, &to, now);
        }
    });
    Carried { state, tats }
}

/// Takes back what [`carry`] added beyond the carried values, once the new
/// limits alone are in force (`meter::take_back`).
fn take_back(carried: &[Carried], now: u64) {
    for c in carried {
        c.state
            .cells(|m, cell| meter::take_back(cell, c.tats[m], now));
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
    /// Rule files re-read and refused (see [`Reloadable::refused`]).
    refusals: std::sync::atomic::AtomicU64,
}

impl Reloadable {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self {
            current: ArcSwap::new(limiter),
            reloading: Mutex::new(()),
            settling: Mutex::new(None),
            refusals: Default::default(),
        }
    }

    /// Notes a rule file re-read and refused (the rules in force kept).
    pub fn refused(&self) {
        self.refusals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Rule files re-read and refused so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(std::sync::atomic::Ordering::Relaxed)
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
        let Sharing { next, mut shared } = old.sharing_with(rules);
        let next = Arc::new(next);
        shared.swapped_at = Some(old.clock.monotonic_ns());
        self.current.store(Arc::clone(&next));
        // Keys the old limiter made while the new one was being built.
        old.share_keys(&next, &mut shared);
        let kept = shared.kept.len();
        let carrying = shared.carrying;
        let forgets = old.drops_plain_slots(&next);
        // Requests still judged by the old limiter are done within moments;
        // the carried states then hold only what the new limits allow, and
        // the plain keys of rules gone are no one's. (A thread of its own:
        // the caller may be an async task.)
        if !carrying.is_empty() || forgets {
            let clock = Arc::clone(&old.clock);
            let next = Arc::clone(&next);
            let pending = std::thread::spawn(move || {
                std::thread::sleep(crate::clock::GRACE);
                take_back(&carrying, clock.monotonic_ns());
                if forgets {
                    next.forget_dropped_plain_keys();
                }
            });
            *self.settling.lock().unwrap_or_else(|p| p.into_inner()) = Some(pending);
        }
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
