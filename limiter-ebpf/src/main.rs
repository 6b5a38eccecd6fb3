//! The XDP rate limiter: parse, look up the rule, decide, count.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![expect(
    internal_features,
    reason = "atomic_cxchg is the only CAS the BPF target offers"
)]

mod cell;
mod fragments;
mod keys;
mod maps;
mod parse;
mod profile;
mod runtime;
mod trace;

use aya_ebpf::{bindings::xdp_action, macros::xdp, maps::lpm_trie::Key, programs::XdpContext};
use cell::{MapCell, add_shared, lock, lock_window, unlock, unlock_window};
use limiter_common::{
    abi::{
        AggregateState, Block, Candidates, DEFAULT_RULE, FlowKey, GlobalConfig, GlobalCounters,
        KeyState, PrefixKey, RuleConfig, RuleCounters, action, algorithm, counter_slot,
        global_flag, rule_flag, rule_slot, v4_table,
    },
    gcra::{Decision, Gcra},
    keytable::{Slot, pack_counts, window_state},
    meter::{
        Charge, Outcome, Verdict, WindowCharge, acquire, acquire_all_after, order, refund, windows_all,
    },
    trace::{reason, verdict as traced},
    window::WindowState,
};
use maps::{
    ADMISSIONS, AGGREGATES, BLOCKED_V4, BLOCKS_V4, BLOCKS_V6, CONFIG, COSTS, GLOBAL_STATS, IFACES,
    LPM_V6, RULE_STATS, RULES, SOFT_LIMITS, SOFT_STATS, V4_L16, V4_L24, V4_L32, V4_LISTS,
    WINDOW_SCRATCH,
};
use parse::{Packet, Source};
use trace::Decided;

#[xdp]
pub fn limiter(ctx: XdpContext) -> u32 {
    // One per-CPU record counts every packet, another its rule's share:
    // each looked up once, then plain increments.
    let Some(global) = GLOBAL_STATS.get_ptr_mut(0) else {
        return xdp_action::XDP_PASS;
    };
    let global = unsafe { &mut *global };
    let len = (ctx.data_end() - ctx.data()) as u64;
    let Some(config) = CONFIG.get(0) else {
        return xdp_action::XDP_PASS;
    };
    // Safe to read: the verifier allows reading ingress_ifindex from xdp_md.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    let iface = IFACES.get(ifindex).copied().unwrap_or(0);
    global.packets += 1;
    if profile::stop_after(profile::CONFIG_READ) {
        return profile::verdict(u64::from(config.generation ^ iface));
    }
    let parsed = parse::parse(&ctx);
    if profile::stop_after(profile::PARSED) {
        return profile::verdict(parsed.map_or(1, |p| p.map_or(2, |p| u64::from(p.dest_port))));
    }
    let decision = match &parsed {
        Ok(Some(packet)) => limit(config, global, iface, packet, len),
        Ok(None) => {
            // Not IP: no source to limit or to trace.
            global.non_ip += 1;
            return xdp_action::XDP_PASS;
        }
        Err(parse::Malformed) => {
            global.malformed += 1;
            Decided::new(config.malformed_action, traced::MALFORMED, reason::NONE)
        }
    };
    if trace::on() {
        trace::hand_over(&ctx, &decision);
    }
    if decision.action == action::DROP {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// `Verdict::refused_by` beyond the meters' (`order`), as `trace::reason`
/// names them: a packet refused a new key,
const REFUSED_ADMISSION: usize = reason::UNADMITTED as usize;
/// one whose new key could not be stored,
const KEY_ALLOC_FAILED: usize = reason::NO_SLOT as usize;
/// one whose rule blocks,
const REFUSED_BY_RULE: usize = reason::RULE_BLOCKS as usize;
/// and a later fragment whose first was dropped.
const REFUSED_WITH_FIRST_FRAGMENT: usize = reason::FRAGMENT as usize;
const _: () = assert!(REFUSED_ADMISSION == order::METERS);

/// Applies a manual block or the rule that matches `packet`, and counts.
#[inline(always)]
fn limit(
    config: &GlobalConfig,
    global: &mut GlobalCounters,
    iface: u32,
    packet: &Packet,
    len: u64,
) -> Decided {
    match packet.source {
        Source::V4(_) => global.ipv4 += 1,
        Source::V6(_) => global.ipv6 += 1,
    }
    if packet.fragment {
        global.fragments += 1;
    }
    let global_shadow = config.flags & global_flag::SHADOW != 0;
    if packet.unreadable {
        global.unreadable_transport += 1;
    }
    if packet.tiny_fragment {
        // RFC 1858: a first fragment too short for its transport header
        // hides its ports from every rule; no sound stack sends one.
        global.tiny_fragments += 1;
        let action = if global_shadow {
            action::PASS
        } else {
            action::DROP
        };
        return Decided::new(action, traced::MALFORMED, reason::TINY_FRAGMENT);
    }
    // Read once: userspace flips it at any time, and a packet is judged
    // wholly by one generation's rules.
    let generation = unsafe { core::ptr::read_volatile(&config.generation) };
    // A later fragment takes its first fragment's rule, and its fate.
    let first = if packet.later_fragment() {
        fragments::first_of(generation, packet)
    } else {
        None
    };
    let rule_id = match first {
        Some(first) => first.rule,
        None => match_rule(generation, packet),
    };
    if profile::stop_after(profile::RULE_MATCHED) {
        return stopped(u64::from(rule_id));
    }
    let (Some(rule), Some(counters)) = (
        RULES.get(rule_slot(generation, rule_id)),
        RULE_STATS.get_ptr_mut(counter_slot(iface, rule_id)),
    ) else {
        return Decided::new(action::PASS, traced::PASSED, reason::NONE);
    };
    let counters = unsafe { &mut *counters };
    if profile::stop_after(profile::RULE_LOADED) {
        return stopped(u64::from(rule.flags) ^ counters.passed_packets);
    }
    let metered = rule.flags & (rule_flag::BLOCK | rule_flag::UNLIMITED) == 0;
    // What the packet costs its packet meters: 1, or its class's credits.
    let credits = if rule.flags & rule_flag::COSTS != 0 {
        COSTS
            .get(rule_slot(generation, rule_id))
            .map_or(1, |costs| {
                costs.credits(packet.protocol, packet.dest_port, packet.tcp_flags)
            })
    } else {
        1
    };
    let key = match packet.source {
        Source::V4(addr) => FlowKey::v4(rule_id, addr, rule.v4_key_mask),
        Source::V6(addr) => FlowKey::v6(rule_id, addr, rule.v6_key_mask),
    };
    let slot = if metered {
        keys::find(config, &key)
    } else {
        None
    };
    if profile::stop_after(profile::KEY_FOUND) {
        return stopped(slot.map_or(0, |s| s.as_ptr() as u64));
    }
    // A key that is one whole address remembers the block epoch at which
    // its source was last found unblocked (a masked key covers addresses
    // a block may cover apart); 0 means never, hence the + 1.
    let block_cache = slot.filter(|_| whole_address_key(rule, packet));
    let epoch = config.block_epoch.wrapping_add(1);
    if config.blocks != 0 && block_cache.is_none_or(|s| unsafe { s.as_ref().block_epoch } != epoch)
    {
        if blocked(packet) {
            global.blocked += 1;
            let (action, verdict) = if global_shadow {
                (action::PASS, traced::SHADOW)
            } else {
                (action::DROP, traced::BLOCKED)
            };
            return Decided::new(action, verdict, reason::BLOCK);
        }
        if let Some(slot) = block_cache {
            unsafe { (*slot.as_ptr()).block_epoch = epoch };
        }
    }
    if profile::stop_after(profile::BLOCK_CHECKED) {
        return stopped(u64::from(epoch));
    }
    let now = clock::now();
    if profile::stop_after(profile::CLOCK_READ) {
        return stopped(now);
    }
    let verdict = if rule.flags & rule_flag::BLOCK != 0 {
        Verdict {
            outcome: Outcome::Denied,
            refused_by: REFUSED_BY_RULE,
        }
    } else if first.is_some_and(|first| first.dropped != 0) {
        Verdict {
            outcome: Outcome::Denied,
            refused_by: REFUSED_WITH_FIRST_FRAGMENT,
        }
    } else if rule.flags & rule_flag::UNLIMITED != 0 {
        Verdict {
            outcome: Outcome::Allowed,
            refused_by: 0,
        }
    } else {
        let slot = match slot {
            Some(slot) => Ok(slot.as_ptr()),
            None => new_key(
                config,
                generation,
                global,
                rule_id,
                rule,
                &key,
                counters,
                now,
                Charged { len, credits },
            ),
        };
        match slot {
            Ok(slot) => {
                let key_state = unsafe { &raw mut (*slot).state };
                let charged = Charged { len, credits };
                let verdict = meter(config, generation, rule_id, rule, key_state, now, charged);
                if verdict.outcome == Outcome::Allowed
                    && rule.flags & rule_flag::SOFT != 0
                    && rule.algorithm == algorithm::GCRA
                {
                    over_soft(generation, iface, rule_id, key_state, now, credits);
                }
                // For `limiter top`; see `KeyState::passed_packets`.
                let key_state = unsafe { &mut *key_state };
                if verdict.outcome == Outcome::Allowed {
                    key_state.passed_packets = key_state.passed_packets.wrapping_add(1);
                } else {
                    key_state.dropped_packets = key_state.dropped_packets.wrapping_add(1);
                }
                verdict
            }
            Err(verdict) => verdict,
        }
    };
    if profile::stop_after(profile::METERED) {
        return stopped(verdict.outcome as u64);
    }
    let allowed = verdict.outcome == Outcome::Allowed;
    let shadow = global_shadow || rule.flags & rule_flag::SHADOW != 0;
    if allowed || shadow {
        counters.passed_packets += 1;
        counters.passed_bytes += len;
    }
    if !allowed && shadow {
        counters.shadow_packets += 1;
        counters.shadow_bytes += len;
    }
    if !allowed && !shadow {
        counters.dropped_packets += 1;
        counters.dropped_bytes += len;
    }
    if verdict.outcome == Outcome::Contended {
        counters.contended += 1;
    }
    if !allowed {
        match verdict.refused_by {
            REFUSED_ADMISSION => counters.unadmitted += 1,
            KEY_ALLOC_FAILED => global.key_alloc_failed += 1,
            i if i < order::METERS && order::is_aggregate(i) => counters.aggregate_excess += 1,
            _ => {}
        }
    }
    if packet.first_fragment {
        fragments::remember(generation, packet, rule_id, !allowed && !shadow);
    }
    let (action, verdict_traced) = match (allowed, shadow) {
        (true, _) => (action::PASS, traced::PASSED),
        (false, true) => (action::PASS, traced::SHADOW),
        (false, false) => (action::DROP, traced::DROPPED),
    };
    let why = if allowed {
        reason::NONE
    } else {
        verdict.refused_by as u8
    };
    Decided::new(action, verdict_traced, why)
}

/// A profile build's decision when it stops inside `limit`.
#[inline(always)]
fn stopped(value: u64) -> Decided {
    let action = if profile::verdict(value) == xdp_action::XDP_DROP {
        action::DROP
    } else {
        action::PASS
    };
    Decided::new(action, traced::PASSED, reason::NONE)
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
    let cell = MapCell(unsafe { &raw mut (*state).meters[2] });
    if acquire(&cell, soft, now, credits) == Outcome::Denied
        && let Some(over) = SOFT_STATS.get_ptr_mut(counter_slot(iface, rule_id))
    {
        unsafe { *over += 1 };
    }
}

#[inline(always)]
fn whole_address_key(rule: &RuleConfig, packet: &Packet) -> bool {
    match packet.source {
        Source::V4(_) => u32::from_ne_bytes(rule.v4_key_mask) == u32::MAX,
        Source::V6(_) => rule.v6_key_mask == [0xff; 16],
    }
}

/// Whether an unexpired manual block covers the packet's source.
#[inline(always)]
fn blocked(packet: &Packet) -> bool {
    let block: Option<&Block> = match packet.source {
        Source::V4(addr) => {
            // Most sources have no block anywhere near: one bit says so.
            let slash16 = u32::from(u16::from_be_bytes([addr[0], addr[1]]));
            let near = BLOCKED_V4
                .get(slash16 / 64)
                .is_some_and(|bits| bits & (1 << (slash16 % 64)) != 0);
            if !near {
                return false;
            }
            BLOCKS_V4.get(Key::new(32, addr))
        }
        Source::V6(addr) => BLOCKS_V6.get(Key::new(128, addr)),
    };
    let Some(block) = block else {
        return false;
    };
    if block.expires_ns != 0 && clock::now() >= block.expires_ns {
        return false;
    }
    add_shared(&block.dropped_packets as *const u64 as *mut u64, 1);
    true
}

/// The first candidate of the longest source prefix that matches the
/// packet's protocol and port, in the active generation; or the default.
/// A packet whose port is unknown (a later fragment, an unreadable
/// transport header) takes the first it may belong to.
#[inline(always)]
fn match_rule(generation: u32, packet: &Packet) -> u32 {
    let candidates = match packet.source {
        Source::V4(addr) => candidates_v4(generation, addr),
        Source::V6(addr) => LPM_V6.get(Key::new(
            8 + 128,
            PrefixKey {
                generation: (generation & 1) as u8,
                addr,
            },
        )),
    };
    let Some(candidates) = candidates else {
        return DEFAULT_RULE;
    };
    for (i, candidate) in candidates.entries.iter().enumerate() {
        if i as u32 >= candidates.len {
            break;
        }
        if candidate.matches(packet.protocol, packet.dest_port, packet.tcp_flags)
            || (packet.port_unknown && candidate.may_match_unknown_port(packet.protocol))
        {
            return u32::from(candidate.rule);
        }
    }
    DEFAULT_RULE
}

/// The candidates of an IPv4 source: one to three array loads
/// (`abi::v4_table`).
#[inline(always)]
fn candidates_v4(generation: u32, addr: [u8; 4]) -> Option<&'static Candidates> {
    let first = (generation & 1) * v4_table::L16_BLOCKS + u32::from(addr[0]);
    let mut entry = V4_L16.get(first)?[usize::from(addr[1])];
    if entry & v4_table::NEXT != 0 {
        entry = V4_L24.get(entry & !v4_table::NEXT)?[usize::from(addr[2])];
    }
    if entry & v4_table::NEXT != 0 {
        entry = V4_L32.get(entry & !v4_table::NEXT)?[usize::from(addr[3])];
    }
    V4_LISTS.get(entry)
}

/// The state of a source not yet tracked, created empty (a full bucket),
/// or the verdict for its packet when it gets none: a packet the rule's
/// aggregate would refuse creates nothing, beyond the rule's key-creation
/// budget the packet is refused (see `RuleConfig::admission`), and so it is
/// when its bucket has no slot to give (`keys::claim`; the creation it was
/// granted is handed back to the budget).
#[inline(always)]
#[expect(clippy::too_many_arguments, reason = "inlined; the packet's context")]
fn new_key(
    config: &GlobalConfig,
    generation: u32,
    global: &mut GlobalCounters,
    rule_id: u32,
    rule: &RuleConfig,
    key: &FlowKey,
    counters: &mut RuleCounters,
    now: u64,
    charged: Charged,
) -> Result<*mut Slot, Verdict> {
    let Charged { len, credits } = charged;
    let refused = |refused_by| {
        Err(Verdict {
            outcome: Outcome::Denied,
            refused_by,
        })
    };
    if rule.algorithm == algorithm::GCRA
        && let Some(aggregate) = AGGREGATES.get(rule_id)
    {
        let has = |flag: u32| rule.flags & flag != 0;
        let deny = |gcra: &Gcra, tat: u64, cost: u64| gcra.check(tat, now, cost) == Decision::Deny;
        if has(rule_flag::AGGREGATE_PACKETS)
            && deny(
                &rule.aggregate_packets_at(now).gcra,
                aggregate.meters[0][0],
                credits,
            )
        {
            return refused(order::AGGREGATE_PACKETS);
        }
        if has(rule_flag::AGGREGATE_BYTES)
            && deny(&rule.aggregate_bytes.gcra, aggregate.meters[1][0], len)
        {
            return refused(order::AGGREGATE_BYTES);
        }
    }
    let Some(budget) = ADMISSIONS.get_ptr_mut(rule_id) else {
        return refused(REFUSED_ADMISSION);
    };
    let budget = MapCell(budget);
    if acquire(&budget, &rule.admission, now, 1) != Outcome::Allowed {
        return refused(REFUSED_ADMISSION);
    }
    let state = keys::claim(config, generation, key, now, global);
    if state.is_null() {
        refund(&budget, &rule.admission, now, 1);
        return refused(KEY_ALLOC_FAILED);
    }
    counters.new_keys += 1;
    Ok(state)
}

/// What a packet costs: its length to the byte meters, its credits (1
/// unless the rule has `cost`) to the packet meters.
#[derive(Clone, Copy)]
struct Charged {
    len: u64,
    credits: u64,
}

impl Charged {
    /// In one word, as a subprogram takes it (five arguments at most): a
    /// frame's length fits 32 bits, and so do credits.
    #[inline(always)]
    fn word(self) -> u64 {
        (self.len & 0xffff_ffff) | self.credits << 32
    }

    #[inline(always)]
    fn of_word(word: u64) -> Self {
        Self {
            len: word & 0xffff_ffff,
            credits: word >> 32,
        }
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
    charged: Charged,
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
            charged: charged.word(),
            third,
        };
        meter_gcra_call(rule, state, aggregate, &packet)
    } else {
        let packet = PacketCharge {
            now,
            realtime_offset_ns: config.realtime_offset_ns,
            charged,
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
/// low byte, `refused_by` above it.
#[inline(always)]
fn verdict_word(verdict: Verdict) -> u64 {
    let outcome = match verdict.outcome {
        Outcome::Allowed => 0,
        Outcome::Denied => 1,
        Outcome::Contended => 2,
    };
    outcome | ((verdict.refused_by as u64) << 8)
}

/// What the key's byte meter charges: the frame's length, or its
/// credits when the meter is a second packet limit
/// (`rule_flag::BYTES_COUNT_PACKETS`). Without a branch: the verifier
/// would explore every meter after it twice.
#[inline(always)]
fn key_bytes_cost(flags: u32, len: u64, credits: u64) -> u64 {
    pick(flag_bit(flags, rule_flag::BYTES_COUNT_PACKETS), credits, len)
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
    /// [`Charged::word`].
    charged: u64,
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
        Charged::of_word(packet.charged),
        packet.third,
    ))
}

/// A packet's time and length, for [`meter_windows_call`].
#[derive(Clone, Copy)]
struct PacketCharge {
    now: u64,
    /// `GlobalConfig::realtime_offset_ns`: windows are kept in epoch ns.
    realtime_offset_ns: u64,
    charged: Charged,
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
    charged: Charged,
    third: &Gcra,
) -> Verdict {
    let Charged { len, credits } = charged;
    // A key's state and its rule's aggregate each keep a packet meter
    // (pair index 0) and a byte meter (1); `cells` lists them in `order`.
    const _: () = assert!(
        order::KEY_PACKETS == 0
            && order::KEY_BYTES == 1
            && order::AGGREGATE_PACKETS == 2
            && order::AGGREGATE_BYTES == 3
    );
    let cells = unsafe {
        [
            MapCell(&raw mut (*state).meters[0]),
            MapCell(&raw mut (*state).meters[1]),
            MapCell(&raw mut (*aggregate).meters[0][0]),
            MapCell(&raw mut (*aggregate).meters[1][0]),
        ]
    };
    let has = |flag: u32| rule.flags & flag != 0;
    let mut charges: [Charge<'_, MapCell>; order::METERS] = [None; order::METERS];
    charges[order::KEY_PACKETS] = has(rule_flag::LIMIT_PACKETS).then_some((
        &cells[order::KEY_PACKETS],
        &rule.packets.gcra,
        credits,
    ));
    // The key's byte meter counts credits when it is a second packet limit.
    let key_bytes_cost = key_bytes_cost(rule.flags, len, credits);
    charges[order::KEY_BYTES] = has(rule_flag::LIMIT_BYTES).then_some((
        &cells[order::KEY_BYTES],
        &rule.bytes.gcra,
        key_bytes_cost,
    ));
    charges[order::AGGREGATE_PACKETS] = has(rule_flag::AGGREGATE_PACKETS).then_some((
        &cells[order::AGGREGATE_PACKETS],
        &rule.aggregate_packets_at(now).gcra,
        credits,
    ));
    charges[order::AGGREGATE_BYTES] = has(rule_flag::AGGREGATE_BYTES).then_some((
        &cells[order::AGGREGATE_BYTES],
        &rule.aggregate_bytes.gcra,
        len,
    ));
    // The third limit, if any, in the key's third word: charged always
    // (`acquire_all_after`), and without one at no cost, at time 0, to a
    // meter that refuses nothing: a charge that changes nothing, so
    // writes nothing. A branch instead (a fifth optional meter, or a
    // subprogram for the rules with one) has the verifier explore every
    // meter after it twice, past its budget.
    let cell = MapCell(unsafe { &raw mut (*state).meters[2] });
    let has_third = flag_bit(rule.flags, rule_flag::THIRD_LIMIT);
    let third = third_meter(rule.flags, third);
    let cost = third_cost(rule.flags, len, credits);
    acquire_all_after((&cell, &third, cost), pick(has_third, now, 0), charges, now)
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
        charged: Charged { len, credits },
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
    let (key, aggregate_meters, [key_packets, key_bytes]) =
        unsafe { (&mut *state, &mut (*aggregate).meters, &mut *scratch) };
    *key_packets = window_state(key, 1);
    *key_bytes = window_state(key, 2);
    let [aggregate_packets, aggregate_bytes] = aggregate_meters;
    let has = |flag: u32| rule.flags & flag != 0;
    let mut charges: [WindowCharge<'_>; order::METERS] = [const { None }; order::METERS];
    charges[order::KEY_PACKETS] =
        has(rule_flag::LIMIT_PACKETS).then_some((&mut *key_packets, &rule.packets.window, credits));
    let key_bytes_cost = key_bytes_cost(rule.flags, len, credits);
    charges[order::KEY_BYTES] = has(rule_flag::LIMIT_BYTES).then_some((
        &mut *key_bytes,
        &rule.bytes.window,
        key_bytes_cost,
    ));
    charges[order::AGGREGATE_PACKETS] = has(rule_flag::AGGREGATE_PACKETS).then(|| {
        (
            WindowState::in_slots(aggregate_packets),
            aggregate_packets_window,
            credits,
        )
    });
    charges[order::AGGREGATE_BYTES] = has(rule_flag::AGGREGATE_BYTES).then(|| {
        (
            WindowState::in_slots(aggregate_bytes),
            &rule.aggregate_bytes.window,
            len,
        )
    });
    let verdict = windows_all(charges, now, rule.algorithm == algorithm::SLIDING_WINDOW);
    if has_aggregate {
        unlock(aggregate_lock);
    }
    // Written back whatever the verdict (a refusal changed nothing, so this
    // rewrites what was there): fewer values live across the check. The
    // meters in force rolled from one start alike; one not in force kept
    // the start it had, never a later one.
    key.meters[0] = key_packets.start.max(key_bytes.start);
    key.meters[2] = pack_counts(key_bytes);
    unlock_window(key_lock, pack_counts(key_packets));
    verdict
}

mod clock {
    /// Nanoseconds of CLOCK_MONOTONIC, the clock every TAT is kept in.
    #[cfg(not(feature = "test-clock"))]
    #[inline(always)]
    pub fn now() -> u64 {
        unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() }
    }

    /// Test builds: the time the test stored in the CLOCK map, so traces
    /// replay with exact arrival times through BPF_PROG_TEST_RUN.
    #[cfg(feature = "test-clock")]
    #[inline(always)]
    pub fn now() -> u64 {
        crate::maps::CLOCK.get(0).copied().unwrap_or(0)
    }
}
