//! Charging a tracked key: its meters and its rule's aggregate meters, in
//! one subprogram per algorithm (GCRA: lock-free compare-and-swap;
//! windows: under the key's lock), then its soft limit and its counts.

use limiter_common::{
    abi::{
        AggregateState, GlobalConfig, Handoff, KeyState, RuleConfig, algorithm, counter_slot,
        rule_flag, rule_slot,
    },
    gcra::Gcra,
    keytable::{Slot, pack_counts, window_of},
    meter::{
        Charge, Meters, Outcome, Verdict, WindowMeters, acquire, acquire_all_after, order,
        windows_all,
    },
    trace::reason,
    window::{Window, WindowState},
};

use crate::{
    cell::{MapCell, lock, lock_window, unlock, unlock_window},
    drops,
    maps::{AGGREGATES, SOFT_LIMITS, SOFT_STATS, WINDOW_SCRATCH},
};

/// What a packet costs: its length to the byte meters, its credits (1
/// unless the rule has `cost`) to the packet meters.
#[derive(Clone, Copy)]
pub struct Cost {
    pub len: u64,
    pub credits: u64,
}

impl Cost {
    /// In one word, as a subprogram takes it (five arguments at most): a
    /// frame's length fits 32 bits, and so do credits.
    #[inline(always)]
    pub fn word(self) -> u64 {
        (self.len & 0xffff_ffff) | self.credits << 32
    }

    #[inline(always)]
    pub fn of_word(word: u64) -> Self {
        Self {
            len: word & 0xffff_ffff,
            credits: word >> 32,
        }
    }
}

/// Charges a tracked key (its slot) and counts the outcome on it.
#[inline(always)]
pub fn charge_key(
    config: &GlobalConfig,
    handed: &Handoff,
    rule_id: u32,
    rule: &RuleConfig,
    slot: *mut Slot,
    now: u64,
    cost: Cost,
) -> Verdict {
    let generation = handed.generation;
    // SAFETY: a slot of the key table (a map value); the pointer, not a
    // reference, as other CPUs update it.
    let key_state = unsafe { &raw mut (*slot).state };
    let verdict = meter(config, generation, rule_id, rule, key_state, now, cost);
    if verdict.outcome == Outcome::Allowed
        && rule.flags & rule_flag::SOFT != 0
        && rule.algorithm == algorithm::GCRA
    {
        over_soft(
            generation,
            handed.iface,
            rule_id,
            key_state,
            now,
            cost.credits,
        );
    }
    // For `limiter top`; see `KeyState::passed_packets`. A pass writes the
    // slot's line anyway (its meters); a refusal mostly does not
    // (`drops::count`).
    if verdict.outcome == Outcome::Allowed {
        // SAFETY: a field of the slot above; a plain write, which may lose an
        // increment to another CPU, as documented.
        unsafe {
            let passed = &raw mut (*key_state).passed_packets;
            passed.write(passed.read().wrapping_add(1));
        }
    } else {
        drops::count(slot);
    }
    verdict
}

/// Charges a packet its key's soft meter (the third word of a GCRA key's
/// state, which the hard meters leave free), and counts it when the soft
/// meter refuses it: it is passed all the same.
#[inline(always)]
fn over_soft(
    generation: u32,
    iface: u32,
    rule_id: u32,
    state: *mut KeyState,
    now: u64,
    credits: u64,
) {
    let Some(soft) = SOFT_LIMITS.get(rule_slot(generation, rule_id)) else {
        return;
    };
    // SAFETY: `state` is a `KEYS` slot's (`charge_key`), a map value other
    // CPUs update: only the third word's address is taken, and `MapCell`
    // reads and swaps that aligned u64 atomically.
    let cell = unsafe { MapCell::at(&raw mut (*state).meters[2]) };
    if acquire(cell, soft, now, credits) == Outcome::Denied
        && let Some(over) = SOFT_STATS.get_ptr_mut(counter_slot(iface, rule_id))
    {
        // SAFETY: this CPU's `SOFT_STATS` counter, which only this CPU's running
        // program touches (XDP runs to the end on its CPU).
        unsafe { *over += 1 };
    }
}

/// Charges the packet to its key's meters and the rule's aggregate meters.
#[inline(always)]
fn meter(
    config: &GlobalConfig,
    generation: u32,
    rule_id: u32,
    rule: &RuleConfig,
    state: *mut KeyState,
    now: u64,
    cost: Cost,
) -> Verdict {
    let Some(aggregate) = AGGREGATES.get_ptr_mut(rule_id) else {
        return Verdict {
            outcome: Outcome::Denied,
            refused_by: 0,
        };
    };
    let verdict = if rule.algorithm == algorithm::GCRA {
        // The meter of the key's third word (see `rule_flag::THIRD_LIMIT`).
        let Some(third) = SOFT_LIMITS.get(rule_slot(generation, rule_id)) else {
            return Verdict {
                outcome: Outcome::Denied,
                refused_by: 0,
            };
        };
        let packet = GcraCharge {
            now,
            cost: cost.word(),
            third,
        };
        meter_gcra_call(rule, state, aggregate, &packet)
    } else {
        let packet = PacketCharge {
            now,
            realtime_offset_ns: config.realtime_offset_ns,
            cost,
        };
        meter_windows_call(rule, state, aggregate, &packet)
    };
    Verdict {
        outcome: match verdict & 0xff {
            0 => Outcome::Allowed,
            1 => Outcome::Denied,
            _ => Outcome::Contended,
        },
        refused_by: (verdict >> 8) as usize,
    }
}

/// A verdict in one word, as a subprogram returns it: the outcome in the
/// low byte, `refused_by` above it; a packet that lost every update to
/// other CPUs is refused by contention (`trace::reason::CONTENDED`), not
/// by the meter it was at.
#[inline(always)]
fn verdict_word(verdict: Verdict) -> u64 {
    let (outcome, refused_by) = match verdict.outcome {
        Outcome::Allowed => (0, verdict.refused_by as u64),
        Outcome::Denied => (1, verdict.refused_by as u64),
        Outcome::Contended => (2, u64::from(reason::CONTENDED)),
    };
    outcome | (refused_by << 8)
}

/// The meters a rule has, bit `i` for meter `i` of `order`: a value the
/// verifier does not know (see `meter::Present`).
#[inline(always)]
fn present(flags: u32) -> u32 {
    let bit = |flag: u32, i: usize| (flag_bit(flags, flag) as u32) << i;
    bit(rule_flag::LIMIT_PACKETS, order::KEY_PACKETS)
        | bit(rule_flag::LIMIT_BYTES, order::KEY_BYTES)
        | bit(rule_flag::AGGREGATE_PACKETS, order::AGGREGATE_PACKETS)
        | bit(rule_flag::AGGREGATE_BYTES, order::AGGREGATE_BYTES)
}

/// What the key's byte meter charges: the frame's length, or its
/// credits when the meter is a second packet limit
/// (`rule_flag::BYTES_COUNT_PACKETS`). Without a branch: the verifier
/// would explore every meter after it twice.
#[inline(always)]
fn key_bytes_cost(flags: u32, len: u64, credits: u64) -> u64 {
    pick(
        flag_bit(flags, rule_flag::BYTES_COUNT_PACKETS),
        credits,
        len,
    )
}

/// 1 if `flags` has `flag` (a single bit), else 0: a value, not a branch.
#[inline(always)]
fn flag_bit(flags: u32, flag: u32) -> u64 {
    u64::from((flags >> flag.trailing_zeros()) & 1)
}

/// `if_set` when `bit` (0 or 1) is 1, else `if_clear`, without a branch.
#[inline(always)]
fn pick(bit: u64, if_set: u64, if_clear: u64) -> u64 {
    if_set * bit + if_clear * (1 - bit)
}

/// A packet's time and cost, and the meter of its key's third word, for
/// [`meter_gcra_call`].
struct GcraCharge<'a> {
    now: u64,
    /// [`Cost::word`].
    cost: u64,
    third: &'a Gcra,
}

/// [`meter_gcra`] as a BPF subprogram, for its stack frame (see
/// [`meter_windows_call`]).
#[inline(never)]
fn meter_gcra_call(
    rule: &RuleConfig,
    state: *mut KeyState,
    aggregate: *mut AggregateState,
    packet: &GcraCharge<'_>,
) -> u64 {
    verdict_word(meter_gcra(
        rule,
        state,
        aggregate,
        packet.now,
        Cost::of_word(packet.cost),
        packet.third,
    ))
}

/// A packet's time and length, for [`meter_windows_call`].
#[derive(Clone, Copy)]
struct PacketCharge {
    now: u64,
    /// `GlobalConfig::realtime_offset_ns`: windows are kept in epoch ns.
    realtime_offset_ns: u64,
    cost: Cost,
}

/// [`meter_windows`] as a BPF subprogram: each meter's stack frame is its
/// own, not added to the program's (the verifier allows 512 bytes along
/// a chain of calls); a subprogram takes five arguments and returns one
/// word ([`verdict_word`]).
#[inline(never)]
fn meter_windows_call(
    rule: &RuleConfig,
    state: *mut KeyState,
    aggregate: *mut AggregateState,
    packet: &PacketCharge,
) -> u64 {
    verdict_word(meter_windows(rule, state, aggregate, packet))
}

/// GCRA: lock-free, one compare-and-swap per meter.
#[inline(always)]
fn meter_gcra(
    rule: &RuleConfig,
    state: *mut KeyState,
    aggregate: *mut AggregateState,
    now: u64,
    cost: Cost,
    third: &Gcra,
) -> Verdict {
    let Cost { len, credits } = cost;
    let charges = KeyMeters {
        state,
        aggregate,
        rule,
        aggregate_packets: &rule.aggregate_packets_at(now).gcra,
        len,
        credits,
        mask: present(rule.flags),
    };
    // The third limit, if any, in the key's third word: charged always
    // (`acquire_all_after`), and without one at no cost, at time 0, to a
    // meter that refuses nothing: a charge that changes nothing, so
    // writes nothing. A branch instead (a fifth optional meter, or a
    // subprogram for the rules with one) has the verifier explore every
    // meter after it twice, past its budget.
    // SAFETY: as for `cells`: only the address of the key's third word.
    let cell = unsafe { MapCell::at(&raw mut (*state).meters[2]) };
    let has_third = flag_bit(rule.flags, rule_flag::THIRD_LIMIT);
    let third = third_meter(rule.flags, third);
    let cost = third_cost(rule.flags, len, credits);
    acquire_all_after((cell, &third, cost), pick(has_third, now, 0), charges, now)
}

/// The GCRA meters [`meter_gcra`] charges, in `order`: a key's state and
/// its rule's aggregate each keep a packet meter (pair index 0) and a byte
/// meter (1). Each one's cell, limit and cost is picked by its index when
/// asked: `Present`'s arrays of them lived on the stack, in the frame
/// Linux 6.1 adds to `limiter_decide`'s against 512 bytes.
#[derive(Clone, Copy)]
struct KeyMeters<'a> {
    /// A `KEYS` slot's value and an `AGGREGATES` value: map values other
    /// CPUs update, reached only through [`MapCell`].
    state: *mut KeyState,
    aggregate: *mut AggregateState,
    rule: &'a RuleConfig,
    /// `rule.aggregate_packets_at(now)`'s.
    aggregate_packets: &'a Gcra,
    len: u64,
    credits: u64,
    mask: u32,
}

impl<'a> Meters<'a, MapCell> for KeyMeters<'a> {
    const COUNT: usize = order::METERS;

    #[inline(always)]
    fn meter(&self, i: usize) -> Charge<'a, MapCell> {
        if self.mask & (1 << i) == 0 {
            return None;
        }
        let rule = self.rule;
        // SAFETY: addresses only, of aligned u64 meters in the key's slot and
        // the aggregate (map lookups' pointers, allocated while the program
        // runs, which is as long as the cells are used).
        unsafe {
            let (word, limit, cost) = match i {
                order::KEY_PACKETS => (
                    &raw mut (*self.state).meters[0],
                    &rule.packets.gcra,
                    self.credits,
                ),
                order::KEY_BYTES => (
                    &raw mut (*self.state).meters[1],
                    &rule.bytes.gcra,
                    key_bytes_cost(rule.flags, self.len, self.credits),
                ),
                order::AGGREGATE_PACKETS => (
                    &raw mut (*self.aggregate).meters[0][0],
                    self.aggregate_packets,
                    self.credits,
                ),
                _ => (
                    &raw mut (*self.aggregate).meters[1][0],
                    &rule.aggregate_bytes.gcra,
                    self.len,
                ),
            };
            Some((MapCell::at(word), limit, cost))
        }
    }
}

/// The meter of a key's third word as its third limit: `stored` when the
/// rule has one, else one that admits any cost at any TAT (nothing to
/// charge, unlimited capacity and burst), so a charge of 0 at time 0
/// leaves the word as it is (a soft limit's TAT there keeps its meaning).
/// Without a branch.
#[inline(always)]
fn third_meter(flags: u32, stored: &Gcra) -> Gcra {
    let keep = flag_bit(flags, rule_flag::THIRD_LIMIT).wrapping_neg();
    Gcra {
        emission_ns: stored.emission_ns & keep,
        capacity_ns: stored.capacity_ns | !keep,
        burst: stored.burst | !keep,
    }
}

/// What the key's third meter charges: nothing without a third limit,
/// else a frame's credits or (`rule_flag::THIRD_COUNTS_BYTES`) its
/// length. Without a branch (see [`key_bytes_cost`]).
#[inline(always)]
fn third_cost(flags: u32, len: u64, credits: u64) -> u64 {
    let cost = pick(flag_bit(flags, rule_flag::THIRD_COUNTS_BYTES), len, credits);
    flag_bit(flags, rule_flag::THIRD_LIMIT) * cost
}

/// The window meters `meter_windows` checks: their states in this CPU's
/// scratch, each one's window and cost picked by its index when asked.
/// `PresentWindows`' arrays of references and costs, indexed in the
/// check's loop, lived on the stack: 104 bytes of `meter_windows_call`'s
/// frame, which Linux 6.1 adds to `limiter_decide`'s against 512.
struct ScratchWindows<'a> {
    states: &'a mut [WindowState; order::METERS],
    rule: &'a RuleConfig,
    aggregate_packets: &'a Window,
    len: u64,
    credits: u64,
    mask: u32,
}

impl WindowMeters for ScratchWindows<'_> {
    const COUNT: usize = order::METERS;

    #[inline(always)]
    fn meter(&mut self, i: usize) -> Option<(&mut WindowState, &Window, u64)> {
        if self.mask & (1 << i) == 0 {
            return None;
        }
        let rule = self.rule;
        let (window, cost) = match i {
            order::KEY_PACKETS => (&rule.packets.window, self.credits),
            order::KEY_BYTES => (
                &rule.bytes.window,
                key_bytes_cost(rule.flags, self.len, self.credits),
            ),
            order::AGGREGATE_PACKETS => (self.aggregate_packets, self.credits),
            _ => (&rule.aggregate_bytes.window, self.len),
        };
        Some((self.states.get_mut(i)?, window, cost))
    }
}

/// Copies the aggregate's two windows (six words) between its map value
/// and the scratch, word by word: a block copy compiles to a call of
/// `memmove`, a frame of its own, and `limiter_decide`'s chain of frames
/// through `meter_windows_call` and it measured 544 bytes on Linux 6.1,
/// which refuses more than 512 (each frame rounded up to 32 bytes).
/// Volatile so that the compiler cannot fold the words back into one.
///
/// # Safety
/// Both point to six aligned `u64`s the caller may read and write.
#[inline(always)]
unsafe fn copy_words(from: *const u64, to: *mut u64) {
    for i in 0..6 {
        // SAFETY: within the six words the caller vouches for.
        unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) };
    }
}

/// Windows: a window's fields change together, so the key's state (then
/// the aggregate's, always in that order) is locked while checked. The
/// key's windows are unpacked (`KeyState`), checked and packed back.
#[inline(always)]
fn meter_windows(
    rule: &RuleConfig,
    state: *mut KeyState,
    aggregate: *mut AggregateState,
    packet: &PacketCharge,
) -> Verdict {
    let PacketCharge {
        now,
        realtime_offset_ns,
        cost: Cost { len, credits },
    } = *packet;
    let contended = Verdict {
        outcome: Outcome::Contended,
        refused_by: 0,
    };
    let has_aggregate =
        rule.flags & (rule_flag::AGGREGATE_PACKETS | rule_flag::AGGREGATE_BYTES) != 0;
    let Some(scratch) = WINDOW_SCRATCH.get_ptr_mut(0) else {
        return contended;
    };
    // SAFETY: addresses only, of the key's packets word (a `KEYS` slot's)
    // and of the aggregate's lock (an `AGGREGATES` value), which other CPUs
    // take too: `lock_window` and `lock` change them atomically.
    let key_lock = unsafe { &raw mut (*state).meters[1] };
    let aggregate_lock = unsafe { &raw mut (*aggregate).lock };
    let Some(held) = lock_window(key_lock) else {
        return contended;
    };
    if has_aggregate && !lock(aggregate_lock) {
        unlock_window(key_lock, held);
        return contended;
    }
    let aggregate_packets_window = &rule.aggregate_packets_at(now).window;
    let now = now.wrapping_add(realtime_offset_ns);
    // The meters are copied into this CPU's scratch, checked there and
    // copied back, through raw pointers: a reference into the key's slot
    // or the aggregate would claim memory other CPUs touch meanwhile (the
    // lock word they spin on, the key's plain counts).
    // SAFETY: words of the key's slot and of the aggregate, aligned u64s of
    // map values; the key's window lock, held, keeps other writers off the
    // key's meters, and the aggregate's lock (taken when `has_aggregate`)
    // off its meters; unlocked (a rule without aggregate meters), the
    // aggregate's copies are neither charged (`present` leaves them out)
    // nor written back. `scratch` is this CPU's `WINDOW_SCRATCH` value,
    // its own.
    unsafe {
        let start = (&raw const (*state).meters[0]).read();
        (*scratch)[0] = window_of(start, held);
        (*scratch)[1] = window_of(start, (&raw const (*state).meters[2]).read());
        if has_aggregate {
            copy_words(
                (&raw const (*aggregate).meters).cast(),
                (&raw mut (*scratch)[2]).cast(),
            );
        }
    }
    // SAFETY: as above; the reference ends with the check.
    let verdict = unsafe {
        let charges = ScratchWindows {
            states: &mut *scratch,
            rule,
            aggregate_packets: aggregate_packets_window,
            len,
            credits,
            mask: present(rule.flags),
        };
        windows_all(charges, now, rule.algorithm == algorithm::SLIDING_WINDOW)
    };
    // Written back whatever the verdict (a refusal changed nothing, so this
    // rewrites what was there): fewer values live across the check. The
    // meters in force rolled from one start alike; one not in force kept
    // the start it had, never a later one.
    // SAFETY: as above, under the same locks, released after.
    let packets_counts = unsafe {
        if has_aggregate {
            copy_words(
                (&raw const (*scratch)[2]).cast(),
                (&raw mut (*aggregate).meters).cast(),
            );
        }
        let (key_packets, key_bytes) = (&(*scratch)[0], &(*scratch)[1]);
        (&raw mut (*state).meters[0]).write(key_packets.start.max(key_bytes.start));
        (&raw mut (*state).meters[2]).write(pack_counts(key_bytes));
        pack_counts(key_packets)
    };
    if has_aggregate {
        unlock(aggregate_lock);
    }
    unlock_window(key_lock, packets_counts);
    verdict
}
