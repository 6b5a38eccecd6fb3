//! Metering a request against all of its rule's meters, in one order
//! ([`order`]) shared by the kernel and layer 7: lock-free GCRA updates
//! shared between CPUs, window updates under a lock, refunds, and pacing.
//!
//! A GCRA verdict is computed from a snapshot of the TAT and committed
//! with compare-and-swap (or, when it changes nothing, holds as of the
//! snapshot); if another CPU changed the TAT in between, the verdict is
//! recomputed from the value it wrote. No update is ever lost, so
//! concurrency cannot admit more than the algorithm allows.
//!
//! The time a verdict uses is read after the snapshot it judges ([`Now`]):
//! a thread that waited (for a lock, for a CPU) between reading the clock
//! and metering would otherwise judge a TAT that later requests moved on
//! with its earlier time, and refuse a request that conforms. The kernel
//! reads its clock once per packet (XDP runs to the end on its CPU) and
//! passes the reading itself.

use crate::{
    gcra::{Check, Gcra},
    window::{Window, WindowState},
};

/// The order of a rule's meters wherever they are charged together
/// ([`acquire_all`], [`windows_all`]): the kernel and layer 7 both pass
/// them in this order, so "refused by meter i" means the same on both.
/// A key's state and a rule's aggregate state each hold a packet meter
/// (index 0 of the pair) and a byte meter (index 1).
pub mod order {
    /// The key's packet (request) meter: costs 1.
    pub const KEY_PACKETS: usize = 0;
    /// The key's byte meter: costs the frame's (or request's) length.
    pub const KEY_BYTES: usize = 1;
    /// The rule's aggregate packet meter, shared by all its keys.
    pub const AGGREGATE_PACKETS: usize = 2;
    /// The rule's aggregate byte meter.
    pub const AGGREGATE_BYTES: usize = 3;
    /// Meters a rule can have in one array.
    pub const METERS: usize = 4;
    /// The key's third limit (`limits: [...]` with three), kept in the
    /// third word of its state: charged before the others
    /// ([`super::acquire_all_after`]), so not in their array; its index
    /// follows `trace::reason`'s other causes.
    pub const KEY_THIRD: usize = 12;

    /// Whether meter `i` charges a request's length rather than 1.
    #[inline(always)]
    pub const fn charges_bytes(i: usize) -> bool {
        i == KEY_BYTES || i == AGGREGATE_BYTES
    }

    /// Whether meter `i` is the rule's aggregate rather than the key's.
    #[inline(always)]
    pub const fn is_aggregate(i: usize) -> bool {
        i >= AGGREGATE_PACKETS && i < METERS
    }
}

/// The time a verdict uses: a reading (`u64`, the kernel's), or a clock
/// read at the moment of judging (`Fn() -> u64`, layer 7's).
pub trait Now: Copy {
    fn now(&self) -> u64;
}

impl Now for u64 {
    #[inline(always)]
    fn now(&self) -> u64 {
        *self
    }
}

impl<F: Fn() -> u64 + Copy> Now for F {
    #[inline(always)]
    fn now(&self) -> u64 {
        self()
    }
}

/// How many times a contended update is retried before giving up. Each
/// failed attempt means another CPU's update of the same key succeeded.
pub const MAX_CAS_ATTEMPTS: usize = 8;

/// A `u64` that can be read and compare-and-swapped from several CPUs.
/// The kernel implements it with the BPF `cmpxchg` instruction, userspace
/// with `AtomicU64`.
pub trait AtomicCell {
    fn load(&self) -> u64;
    /// Stores `new` if the value is `current`; returns the value seen otherwise.
    fn compare_exchange(&self, current: u64, new: u64) -> Result<(), u64>;
}

/// The outcome of metering one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Allowed,
    Denied,
    /// Every attempt lost the race to another CPU; the caller treats the
    /// request as excess (fail closed) and counts it.
    Contended,
}

/// Charges `cost` at `now` against `cell` if it conforms.
#[inline(always)]
pub fn acquire<C: AtomicCell + ?Sized>(cell: &C, gcra: &Gcra, now: impl Now, cost: u64) -> Outcome {
    let mut seen = cell.load();
    for _ in 0..MAX_CAS_ATTEMPTS {
        // Read after the snapshot: never older than the TAT it judges.
        match gcra.check(seen, now.now(), cost) {
            Check::Deny => return Outcome::Denied,
            // A charge that changes nothing (nothing to charge, a TAT not
            // past) writes nothing: it holds as of the load.
            Check::Allow { new_tat } if new_tat == seen => return Outcome::Allowed,
            Check::Allow { new_tat } => match cell.compare_exchange(seen, new_tat) {
                Ok(()) => return Outcome::Allowed,
                Err(actual) => seen = actual,
            },
        }
    }
    Outcome::Contended
}

/// Hands back a charge made by [`acquire`] (used when a second meter of the
/// same rule denies the request, so denied requests are never charged).
#[inline(always)]
pub fn refund<C: AtomicCell + ?Sized>(cell: &C, gcra: &Gcra, now: impl Now, cost: u64) {
    let mut seen = cell.load();
    for _ in 0..MAX_CAS_ATTEMPTS {
        let Some(back) = gcra
            .refunded(seen, now.now(), cost)
            .filter(|&back| back != seen)
        else {
            return;
        };
        match cell.compare_exchange(seen, back) {
            Ok(()) => return,
            Err(actual) => seen = actual,
        }
    }
}

/// A TAT on its way to new limits ([`carry`]): what was written, and how
/// far that went past the carried value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CarriedTat {
    pub written: u64,
    pub excess: u64,
}

/// Carries `cell`, kept under `from`, over to `to` at `now`, before `to` is
/// in force: the TAT moves to the later of its own and its carried value
/// ([`Gcra::carried`]), so it has no more budget under either limit than
/// that limit allows while both may judge it. [`take_back`], once `to`
/// alone is in force, removes what this added beyond the carried value.
/// A TAT of `u64::MAX` (a slot being claimed) is left alone.
pub fn carry<C: AtomicCell + ?Sized>(cell: &C, from: &Gcra, to: &Gcra, now: u64) -> CarriedTat {
    let mut seen = cell.load();
    loop {
        if seen == u64::MAX {
            return CarriedTat::default();
        }
        let carried = from.carried(seen, now, to);
        let written = seen.max(carried);
        if written == seen {
            return CarriedTat {
                written,
                excess: seen.saturating_sub(carried),
            };
        }
        match cell.compare_exchange(seen, written) {
            Ok(()) => {
                return CarriedTat { written, excess: 0 };
            }
            Err(actual) => seen = actual,
        }
    }
}

/// Takes back, at `now`, what [`carry`] added beyond the carried value:
/// as much of it as is still ahead of `now`. Once the written TAT is past,
/// the state may have come to rest and been charged afresh (or its slot
/// taken by another key): none of it is owed back then, so a charge made
/// since is never refunded.
pub fn take_back<C: AtomicCell + ?Sized>(cell: &C, carried: CarriedTat, now: u64) {
    let back = carried.excess.min(carried.written.saturating_sub(now));
    if back == 0 {
        return;
    }
    let mut seen = cell.load();
    loop {
        if seen == u64::MAX {
            return;
        }
        match cell.compare_exchange(seen, seen.saturating_sub(back)) {
            Ok(()) => return,
            Err(actual) => seen = actual,
        }
    }
}

/// One meter a request is charged to: its state, parameters and cost.
pub type Charge<'a, C> = Option<(&'a C, &'a Gcra, u64)>;

/// The outcome of metering a request against several meters, and which
/// one refused it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub outcome: Outcome,
    /// Index of the meter that refused (meaningless when allowed).
    pub refused_by: usize,
}

/// The meters [`acquire_all`] charges, by index in [`order`]: an array
/// of [`Charge`]s (layer 7), or [`Present`] (the kernel).
pub trait Meters<'a, C: ?Sized + 'a>: Copy {
    /// How many indices there are.
    const COUNT: usize;
    /// Meter `i`, if the request is charged to it.
    fn meter(&self, i: usize) -> Charge<'a, C>;
}

impl<'a, C: ?Sized + 'a, const N: usize> Meters<'a, C> for [Charge<'a, C>; N] {
    const COUNT: usize = N;

    #[inline(always)]
    fn meter(&self, i: usize) -> Charge<'a, C> {
        self[i]
    }
}

/// Every meter's state, parameters and cost, with a bit per meter saying
/// whether the request is charged to it: the kernel's form. An array of
/// `Option`s holds a pointer or nothing in each place, and the verifier
/// then explores every combination of the two as a state of its own (16
/// for four meters, each through every meter after it); with a bit of a
/// value it only knows at run time, each meter's two ways join again.
pub struct Present<'a, C: ?Sized, const N: usize> {
    pub cells: [&'a C; N],
    pub limits: [&'a Gcra; N],
    pub costs: [u64; N],
    /// Bit `i` set: meter `i` is charged.
    pub mask: u32,
}

// By hand: a derive would ask for `C: Copy`, and only references are copied.
impl<C: ?Sized, const N: usize> Clone for Present<'_, C, N> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<C: ?Sized, const N: usize> Copy for Present<'_, C, N> {}

impl<'a, C: ?Sized + 'a, const N: usize> Meters<'a, C> for Present<'a, C, N> {
    const COUNT: usize = N;

    #[inline(always)]
    fn meter(&self, i: usize) -> Charge<'a, C> {
        (self.mask & (1 << i) != 0).then_some((self.cells[i], self.limits[i], self.costs[i]))
    }
}

/// Meters one request against every given meter (a key's packets and
/// bytes, the rule's aggregate packets and bytes, ...). It passes only if
/// all allow it, and is charged to none if any refuses: meters charged
/// before the refusal are refunded.
#[inline(always)]
pub fn acquire_all<'a, C: AtomicCell + ?Sized + 'a, M: Meters<'a, C>>(
    charges: M,
    now: impl Now,
) -> Verdict {
    let mut i = 0;
    while i < M::COUNT {
        if let Some((cell, gcra, cost)) = charges.meter(i) {
            let outcome = acquire(cell, gcra, now, cost);
            if outcome != Outcome::Allowed {
                let mut j = 0;
                while j < i {
                    if let Some((cell, gcra, cost)) = charges.meter(j) {
                        refund(cell, gcra, now, cost);
                    }
                    j += 1;
                }
                return Verdict {
                    outcome,
                    refused_by: i,
                };
            }
        }
        i += 1;
    }
    Verdict {
        outcome: Outcome::Allowed,
        refused_by: M::COUNT,
    }
}

/// [`acquire_all`] after one more meter, `first`: charged before the
/// others and handed back if one of them refuses. A key's third limit is
/// metered so (its index [`order::KEY_THIRD`]), apart from the array: a
/// fifth optional meter there would have the kernel's verifier explore
/// every meter after it twice. `first_at` is the time `first` is judged
/// at: `now` for a limit; the kernel charges every GCRA packet so, and
/// when the rule has no third limit, a charge of 0 at time 0 to a meter
/// refusing nothing, which changes nothing and so writes nothing.
#[inline(always)]
pub fn acquire_all_after<'a, C: AtomicCell + ?Sized + 'a, M: Meters<'a, C>>(
    first: (&C, &Gcra, u64),
    first_at: impl Now,
    charges: M,
    now: impl Now,
) -> Verdict {
    let (cell, gcra, cost) = first;
    let outcome = acquire(cell, gcra, first_at, cost);
    if outcome != Outcome::Allowed {
        return Verdict {
            outcome,
            refused_by: order::KEY_THIRD,
        };
    }
    let verdict = acquire_all(charges, now);
    if verdict.outcome != Outcome::Allowed {
        refund(cell, gcra, first_at, cost);
    }
    verdict
}

/// Pacing (nginx's `delay`): charges `cost` at the earliest time it
/// conforms, if that is within `max_delay_ns` of `now`. Returns how long
/// the request must wait (0: it conforms now), or `None` (refused,
/// uncharged).
#[inline(always)]
pub fn acquire_delayed<C: AtomicCell + ?Sized>(
    cell: &C,
    gcra: &Gcra,
    now: u64,
    cost: u64,
    max_delay_ns: u64,
) -> Option<u64> {
    let mut seen = cell.load();
    for _ in 0..MAX_CAS_ATTEMPTS {
        let wait = gcra.wait_ns(seen, now, cost);
        if wait > max_delay_ns {
            return None;
        }
        let Check::Allow { new_tat } = gcra.check(seen, now.saturating_add(wait), cost) else {
            return None;
        };
        match cell.compare_exchange(seen, new_tat) {
            Ok(()) => return Some(wait),
            Err(actual) => seen = actual,
        }
    }
    None
}

/// One window meter a request is charged to: its state, parameters, cost.
pub type WindowCharge<'a> = Option<(&'a mut WindowState, &'a Window, u64)>;

/// The window meters [`windows_all`] charges, by index in [`order`]: an
/// array of [`WindowCharge`]s (layer 7), or [`PresentWindows`] (the
/// kernel; see [`Present`] for why).
pub trait WindowMeters {
    /// How many indices there are.
    const COUNT: usize;
    /// Meter `i`, if the request is charged to it.
    fn meter(&mut self, i: usize) -> Option<(&mut WindowState, &Window, u64)>;
}

impl<const N: usize> WindowMeters for [WindowCharge<'_>; N] {
    const COUNT: usize = N;

    #[inline(always)]
    fn meter(&mut self, i: usize) -> Option<(&mut WindowState, &Window, u64)> {
        self[i]
            .as_mut()
            .map(|(state, window, cost)| (&mut **state, *window, *cost))
    }
}

/// Every window meter's state, parameters and cost, with a bit per meter
/// saying whether the request is charged to it (see [`Present`]).
pub struct PresentWindows<'a, const N: usize> {
    pub states: [&'a mut WindowState; N],
    pub windows: [&'a Window; N],
    pub costs: [u64; N],
    /// Bit `i` set: meter `i` is charged.
    pub mask: u32,
}

impl<const N: usize> WindowMeters for PresentWindows<'_, N> {
    const COUNT: usize = N;

    #[inline(always)]
    fn meter(&mut self, i: usize) -> Option<(&mut WindowState, &Window, u64)> {
        (self.mask & (1 << i) != 0).then(|| (&mut *self.states[i], self.windows[i], self.costs[i]))
    }
}

/// The window counterpart of [`acquire_all`], for states the caller holds
/// exclusively (under a lock): every meter is checked first, and the new
/// states are written only if all of them allow the request. (The checks
/// are pure, so the second pass recomputes rather than keeping copies:
/// the kernel has 512 bytes of stack.)
#[inline(always)]
pub fn windows_all<M: WindowMeters>(mut charges: M, now: u64, sliding: bool) -> Verdict {
    let mut i = 0;
    while i < M::COUNT {
        if let Some((state, window, cost)) = charges.meter(i)
            && window.check(state, now, cost, sliding).is_none()
        {
            return Verdict {
                outcome: Outcome::Denied,
                refused_by: i,
            };
        }
        i += 1;
    }
    let mut i = 0;
    while i < M::COUNT {
        if let Some((state, window, cost)) = charges.meter(i)
            && let Some(next) = window.check(state, now, cost, sliding)
        {
            *state = next;
        }
        i += 1;
    }
    Verdict {
        outcome: Outcome::Allowed,
        refused_by: M::COUNT,
    }
}

#[cfg(not(target_arch = "bpf"))]
impl AtomicCell for core::sync::atomic::AtomicU64 {
    // Inlined across crates: a call around each atomic was a tenth of a
    // layer-7 decision.
    #[inline(always)]
    fn load(&self) -> u64 {
        self.load(core::sync::atomic::Ordering::Acquire)
    }

    #[inline(always)]
    fn compare_exchange(&self, current: u64, new: u64) -> Result<(), u64> {
        use core::sync::atomic::Ordering::{AcqRel, Acquire};
        self.compare_exchange(current, new, AcqRel, Acquire)
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    extern crate std;

    use core::sync::atomic::{AtomicU64, Ordering};
    use std::{sync::Arc, thread, vec::Vec};

    use super::*;

    const SEC: u64 = 1_000_000_000;

    /// A cell that counts its compare-and-swaps.
    struct Counted(AtomicU64, core::cell::Cell<u32>);

    impl AtomicCell for Counted {
        fn load(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }

        fn compare_exchange(&self, current: u64, new: u64) -> Result<(), u64> {
            self.1.set(self.1.get() + 1);
            AtomicCell::compare_exchange(&self.0, current, new)
        }
    }

    /// The kernel hands a clock (a closure read after each load), userspace
    /// a time: a meter charges at the time either gives.
    #[test]
    fn a_clock_is_read_as_the_time_it_gives() {
        let gcra = Gcra::new(10, SEC, 5).unwrap();
        let by_time = Counted(AtomicU64::new(0), core::cell::Cell::new(0));
        let by_clock = Counted(AtomicU64::new(0), core::cell::Cell::new(0));
        assert_eq!(acquire(&by_time, &gcra, 7 * SEC, 1), Outcome::Allowed);
        assert_eq!(acquire(&by_clock, &gcra, || 7 * SEC, 1), Outcome::Allowed);
        assert_eq!(by_clock.load(), by_time.load());
        assert_eq!(by_clock.load(), 7 * SEC + gcra.emission_ns);
    }

    /// The kernel's third word without a third limit: a charge of 0 at
    /// time 0 to a meter that refuses nothing, then handed back when
    /// another meter refuses: the word is never written, whatever it
    /// holds; a charge that does change the TAT still swaps it.
    #[test]
    fn a_charge_that_changes_nothing_writes_nothing() {
        let neutral = Gcra {
            emission_ns: 0,
            capacity_ns: u64::MAX,
            burst: u64::MAX,
        };
        for tat in [0, 5 * SEC, u64::MAX - 1, u64::MAX] {
            let cell = Counted(AtomicU64::new(tat), core::cell::Cell::new(0));
            assert_eq!(acquire(&cell, &neutral, 0u64, 0), Outcome::Allowed);
            refund(&cell, &neutral, 0u64, 0);
            assert_eq!((cell.load(), cell.1.get()), (tat, 0), "TAT {tat}");
        }
        let gcra = Gcra::new(10, SEC, 5).unwrap();
        let cell = Counted(AtomicU64::new(0), core::cell::Cell::new(0));
        assert_eq!(acquire(&cell, &gcra, 7 * SEC, 1), Outcome::Allowed);
        assert_eq!(cell.1.get(), 1);
        assert!(cell.load() > 7 * SEC);

        // As the kernel composes it: the neutral third word first, then a
        // packet meter that refuses (its TAT far ahead): neither is written.
        let third = Counted(AtomicU64::new(3 * SEC), core::cell::Cell::new(0));
        let packets = Counted(AtomicU64::new(1000 * SEC), core::cell::Cell::new(0));
        let mut charges: [Charge<'_, Counted>; order::METERS] = [None; order::METERS];
        charges[order::KEY_PACKETS] = Some((&packets, &gcra, 1));
        let verdict = acquire_all_after((&third, &neutral, 0), 0u64, charges, 7 * SEC);
        assert_eq!(
            (verdict.outcome, verdict.refused_by),
            (Outcome::Denied, order::KEY_PACKETS)
        );
        assert_eq!((third.load(), third.1.get()), (3 * SEC, 0));
        assert_eq!((packets.load(), packets.1.get()), (1000 * SEC, 0));
    }

    /// Guards the two steps of a limit change: meanwhile the later of the
    /// old and the carried TAT (no more budget than either limit allows),
    /// then the carried one; and nothing taken back once the TAT written
    /// is past (the key may have been charged afresh since).
    #[test]
    fn a_carried_tat_is_conservative_then_exact_and_never_refunds_a_new_charge() {
        let now = 1_000 * SEC;
        let ten = Gcra::new(10, SEC, 10).unwrap(); // a burst of 1 s
        let one = Gcra::new(1, SEC, 2).unwrap(); // a burst of 2 s
        // Lowered: half of 1 s spent becomes half of 2 s, at once.
        let cell = AtomicU64::new(now + SEC / 2);
        let c = carry(&cell, &ten, &one, now);
        assert_eq!(cell.load(Ordering::Relaxed), now + SEC);
        assert_eq!(
            c,
            CarriedTat {
                written: now + SEC,
                excess: 0
            }
        );
        take_back(&cell, c, now + 1);
        assert_eq!(cell.load(Ordering::Relaxed), now + SEC);
        // Raised: the TAT stays until the new limit alone judges it...
        let cell = AtomicU64::new(now + SEC);
        let c = carry(&cell, &one, &ten, now);
        assert_eq!(cell.load(Ordering::Relaxed), now + SEC);
        assert_eq!(c.excess, SEC / 2);
        // ... then is lowered to the carried value, charges made since kept.
        cell.store(now + SEC + 7, Ordering::Relaxed);
        take_back(&cell, c, now + 20_000_000);
        assert_eq!(cell.load(Ordering::Relaxed), now + SEC / 2 + 7);
        // Only what is still ahead of the clock is taken back: here the
        // TAT written is 0.4 s ahead, so 0.4 s of the 0.5 s.
        let cell = AtomicU64::new(now + SEC);
        let c = carry(&cell, &one, &ten, now);
        take_back(&cell, c, now + 6 * SEC / 10);
        assert_eq!(cell.load(Ordering::Relaxed), now + 6 * SEC / 10);
        // Once it is past, none: a key at rest and charged afresh keeps
        // its charge.
        let cell = AtomicU64::new(now + SEC);
        let c = carry(&cell, &one, &ten, now);
        cell.store(now + 2 * SEC + SEC / 10, Ordering::Relaxed);
        take_back(&cell, c, now + 2 * SEC);
        assert_eq!(cell.load(Ordering::Relaxed), now + 2 * SEC + SEC / 10);
        // A slot being claimed is left alone.
        let cell = AtomicU64::new(u64::MAX);
        assert_eq!(carry(&cell, &ten, &one, now), CarriedTat::default());
        assert_eq!(cell.load(Ordering::Relaxed), u64::MAX);
    }

    #[test]
    fn threads_never_overshoot_burst() {
        // One unit per day: over the test only the burst can be admitted.
        let gcra = Gcra::new(1, 86_400 * SEC, 10_000).unwrap();
        let cell = Arc::new(AtomicU64::new(0));
        let admitted: u64 = (0..4)
            .map(|_| {
                let cell = Arc::clone(&cell);
                thread::spawn(move || {
                    (0..20_000)
                        .filter(|_| acquire(&*cell, &gcra, 5 * SEC, 1) == Outcome::Allowed)
                        .count() as u64
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(admitted, 10_000);
    }

    #[test]
    fn a_later_refusal_refunds_earlier_meters() {
        let packets = Gcra::new(100, SEC, 10).unwrap();
        let bytes = Gcra::new(1000, SEC, 1000).unwrap();
        let p = AtomicU64::new(0);
        let b = AtomicU64::new(0);
        let now = 7 * SEC;
        // 1500 bytes exceed the byte burst: denied, and the packet meter is untouched.
        let verdict = acquire_all(
            [Some((&p, &packets, 1)), None, Some((&b, &bytes, 1500))],
            now,
        );
        assert_eq!(
            verdict,
            Verdict {
                outcome: Outcome::Denied,
                refused_by: 2
            }
        );
        assert!(AtomicCell::load(&p) <= now);
        assert_eq!(AtomicCell::load(&b), 0);
        let verdict = acquire_all(
            [Some((&p, &packets, 1)), None, Some((&b, &bytes, 100))],
            now,
        );
        assert_eq!(verdict.outcome, Outcome::Allowed);
        assert_eq!(AtomicCell::load(&p), now + packets.emission_ns);
    }

    /// Guards the kernel's form of the meters (`Present`,
    /// `PresentWindows`: every meter and a mask) against layer 7's (an
    /// array of `Option`s): for every set of meters present, and meters
    /// that allow or refuse, the same verdict, the same meter refusing,
    /// and the same states after (refunds included). A meter left out
    /// holds a state that must not change.
    #[test]
    fn masked_meters_charge_what_optional_ones_do() {
        let now = 7 * SEC;
        let limits = [
            Gcra::new(100, SEC, 10).unwrap(),
            Gcra::new(1000, SEC, 1000).unwrap(),
            Gcra::new(50, SEC, 5).unwrap(),
            Gcra::new(500, SEC, 600).unwrap(),
        ];
        let costs = [1, 700, 1, 700];
        let windows = [
            Window::new(3, SEC).unwrap(),
            Window::new(1000, SEC).unwrap(),
            Window::new(2, SEC).unwrap(),
            Window::new(800, SEC).unwrap(),
        ];
        for mask in 0..16u32 {
            // Each meter starts fresh, or (bit set) spent far ahead.
            for spent in 0..16u32 {
                let tat = |i: usize| {
                    if spent & (1 << i) != 0 {
                        now + 100 * SEC
                    } else {
                        0
                    }
                };
                let optional: [AtomicU64; 4] = core::array::from_fn(|i| AtomicU64::new(tat(i)));
                let masked: [AtomicU64; 4] = core::array::from_fn(|i| AtomicU64::new(tat(i)));
                let charges: [Charge<'_, AtomicU64>; 4] = core::array::from_fn(|i| {
                    (mask & (1 << i) != 0).then_some((&optional[i], &limits[i], costs[i]))
                });
                let expected = acquire_all(charges, now);
                let present = Present {
                    cells: [&masked[0], &masked[1], &masked[2], &masked[3]],
                    limits: [&limits[0], &limits[1], &limits[2], &limits[3]],
                    costs,
                    mask,
                };
                let verdict = acquire_all(present, now);
                let states = |cells: &[AtomicU64; 4]| cells.each_ref().map(AtomicCell::load);
                assert_eq!(
                    verdict.outcome, expected.outcome,
                    "GCRA {mask:04b} {spent:04b}"
                );
                if verdict.outcome != Outcome::Allowed {
                    assert_eq!(verdict.refused_by, expected.refused_by);
                }
                assert_eq!(
                    states(&masked),
                    states(&optional),
                    "GCRA {mask:04b} {spent:04b}"
                );

                let full = |i: usize| WindowState {
                    start: now - now % SEC,
                    previous: 0,
                    current: if spent & (1 << i) != 0 {
                        windows[i].limit
                    } else {
                        0
                    },
                };
                let mut optional: [WindowState; 4] = core::array::from_fn(full);
                let mut masked: [WindowState; 4] = core::array::from_fn(full);
                let [o0, o1, o2, o3] = &mut optional;
                let slots = [o0, o1, o2, o3];
                let mut i = 0;
                let charges: [WindowCharge<'_>; 4] = slots.map(|state| {
                    let charge = (mask & (1 << i) != 0).then_some((state, &windows[i], costs[i]));
                    i += 1;
                    charge
                });
                let expected = windows_all(charges, now, true);
                let [m0, m1, m2, m3] = &mut masked;
                let present = PresentWindows {
                    states: [m0, m1, m2, m3],
                    windows: [&windows[0], &windows[1], &windows[2], &windows[3]],
                    costs,
                    mask,
                };
                let verdict = windows_all(present, now, true);
                assert_eq!(verdict, expected, "windows {mask:04b} {spent:04b}");
                assert_eq!(masked, optional, "windows {mask:04b} {spent:04b}");
            }
        }
    }

    /// Guards pacing: a request that conforms now waits 0; one that will
    /// conform within the allowed delay waits exactly until then (the
    /// boundary included) and is charged for that time; one beyond it is
    /// refused and charged nothing.
    #[test]
    fn pacing_waits_exactly_until_conformance() {
        let gcra = Gcra::new(10, SEC, 1).unwrap();
        let cell = AtomicU64::new(0);
        let now = 9 * SEC;
        let t = gcra.emission_ns;
        assert_eq!(acquire_delayed(&cell, &gcra, now, 1, 0), Some(0));
        assert_eq!(acquire_delayed(&cell, &gcra, now, 1, t - 1), None);
        assert_eq!(AtomicCell::load(&cell), now + t);
        assert_eq!(acquire_delayed(&cell, &gcra, now, 1, t), Some(t));
        assert_eq!(AtomicCell::load(&cell), now + 2 * t);
        assert_eq!(acquire_delayed(&cell, &gcra, now, 1, 10 * t), Some(2 * t));
    }

    /// Guards the one meter order both layers use: which meters charge a
    /// request's length, and which are the rule's aggregate.
    #[test]
    fn the_meter_order() {
        let bytes: Vec<usize> = (0..order::METERS)
            .filter(|&i| order::charges_bytes(i))
            .collect();
        let aggregate: Vec<usize> = (0..order::METERS)
            .filter(|&i| order::is_aggregate(i))
            .collect();
        // The positions a key's and an aggregate's state keep their
        // meters at (`abi::KeyState`: packets, then bytes) depend on these.
        assert_eq!(
            [
                order::KEY_PACKETS,
                order::KEY_BYTES,
                order::AGGREGATE_PACKETS,
                order::AGGREGATE_BYTES
            ],
            [0, 1, 2, 3]
        );
        assert_eq!(bytes, [1, 3]);
        assert_eq!(aggregate, [2, 3]);
    }
}
