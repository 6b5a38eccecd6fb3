//! The XDP rate limiter: parse, look up the rule, decide, count.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![expect(
    internal_features,
    reason = "atomic_cxchg is the only CAS the BPF target offers"
)]

mod cell;
mod maps;
mod parse;
mod runtime;

use aya_ebpf::{
    bindings::{BPF_NOEXIST, xdp_action},
    macros::xdp,
    maps::lpm_trie::Key,
    programs::XdpContext,
};
use cell::{MapCell, add_shared, lock, unlock};
use limiter_common::{
    abi::{
        Block, DEFAULT_RULE, FlowKey, GlobalConfig, GlobalCounters, KeyState, PrefixKey,
        RuleConfig, RuleCounters, action, algorithm, counter_slot, global_flag, rule_flag,
        rule_slot,
    },
    meter::{Charge, Outcome, Verdict, WindowCharge, acquire_all, order, windows_all},
    window::WindowState,
};
use maps::{
    AGGREGATES, BLOCKS_V4, BLOCKS_V6, CONFIG, GLOBAL_STATS, IFACES, KEYS, LPM_V4, LPM_V6,
    RULE_STATS, RULES,
};
use parse::{Packet, Source};

#[xdp]
pub fn limiter(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    let config = CONFIG.get(0).copied().unwrap_or_default();
    // Safe to read: the verifier allows reading ingress_ifindex from xdp_md.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    let iface = unsafe { IFACES.get(ifindex) }.copied().unwrap_or(0);
    let verdict = match parse::parse(&ctx) {
        Ok(Some(packet)) => limit(&config, iface, &packet, len),
        Ok(None) => {
            count_global(|c| c.non_ip += 1);
            action::PASS
        }
        Err(parse::Malformed) => {
            count_global(|c| c.malformed += 1);
            config.malformed_action
        }
    };
    count_global(|c| c.packets += 1);
    if verdict == action::DROP {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// Applies a manual block or the rule that matches `packet`, and counts.
#[inline(always)]
fn limit(config: &GlobalConfig, iface: u32, packet: &Packet, len: u64) -> u32 {
    count_global(|c| match packet.source {
        Source::V4(_) => c.ipv4 += 1,
        Source::V6(_) => c.ipv6 += 1,
    });
    if packet.fragment {
        count_global(|c| c.fragments += 1);
    }
    let global_shadow = config.flags & global_flag::SHADOW != 0;
    if blocked(packet) {
        count_global(|c| c.blocked += 1);
        return if global_shadow {
            action::PASS
        } else {
            action::DROP
        };
    }
    let rule_id = match_rule(config.generation, packet);
    let Some(rule) = RULES.get(rule_slot(config.generation, rule_id)) else {
        return action::PASS;
    };
    let verdict = if rule.flags & rule_flag::BLOCK != 0 {
        Verdict {
            outcome: Outcome::Denied,
            refused_by: 0,
        }
    } else if rule.flags & rule_flag::UNLIMITED != 0 {
        Verdict {
            outcome: Outcome::Allowed,
            refused_by: 0,
        }
    } else {
        meter(config, iface, rule_id, rule, packet, len)
    };
    let allowed = verdict.outcome == Outcome::Allowed;
    let shadow = global_shadow || rule.flags & rule_flag::SHADOW != 0;
    count_rule(iface, rule_id, |c| {
        if allowed || shadow {
            c.passed_packets += 1;
            c.passed_bytes += len;
        }
        if !allowed && shadow {
            c.shadow_packets += 1;
            c.shadow_bytes += len;
        }
        if !allowed && !shadow {
            c.dropped_packets += 1;
            c.dropped_bytes += len;
        }
        if verdict.outcome == Outcome::Contended {
            c.contended += 1;
        }
        if !allowed && order::is_aggregate(verdict.refused_by) {
            c.aggregate_excess += 1;
        }
    });
    if allowed || shadow {
        action::PASS
    } else {
        action::DROP
    }
}

/// Whether an unexpired manual block covers the packet's source.
#[inline(always)]
fn blocked(packet: &Packet) -> bool {
    let block: Option<&Block> = match packet.source {
        Source::V4(addr) => BLOCKS_V4.get(Key::new(32, addr)),
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
#[inline(always)]
fn match_rule(generation: u32, packet: &Packet) -> u32 {
    let generation = (generation & 1) as u8;
    let candidates = match packet.source {
        Source::V4(addr) => LPM_V4.get(Key::new(8 + 32, PrefixKey { generation, addr })),
        Source::V6(addr) => LPM_V6.get(Key::new(8 + 128, PrefixKey { generation, addr })),
    };
    let Some(candidates) = candidates else {
        return DEFAULT_RULE;
    };
    for (i, candidate) in candidates.entries.iter().enumerate() {
        if i as u32 >= candidates.len {
            break;
        }
        if candidate.matches(packet.protocol, packet.dest_port) {
            return u32::from(candidate.rule);
        }
    }
    DEFAULT_RULE
}

/// Charges the packet to its key's meters and the rule's aggregate meters.
#[inline(always)]
fn meter(
    config: &GlobalConfig,
    iface: u32,
    rule_id: u32,
    rule: &RuleConfig,
    packet: &Packet,
    len: u64,
) -> Verdict {
    let key = match packet.source {
        Source::V4(addr) => FlowKey::v4(rule_id, addr, rule.v4_key_mask),
        Source::V6(addr) => FlowKey::v6(rule_id, addr, rule.v6_key_mask),
    };
    let (Some(state), Some(aggregate)) = (
        key_state(iface, rule_id, &key),
        AGGREGATES.get_ptr_mut(rule_id),
    ) else {
        count_global(|c| c.key_alloc_failed += 1);
        return Verdict {
            outcome: Outcome::Denied,
            refused_by: 0,
        };
    };
    let verdict = if rule.algorithm == algorithm::GCRA {
        meter_gcra(rule, state, aggregate, len)
    } else {
        meter_windows(config, rule, state, aggregate, len)
    };
    let counter = unsafe {
        if verdict.outcome == Outcome::Allowed {
            &raw mut (*state).passed_packets
        } else {
            &raw mut (*state).dropped_packets
        }
    };
    add_shared(counter, 1);
    verdict
}

/// GCRA: lock-free, one compare-and-swap per meter.
#[inline(always)]
fn meter_gcra(
    rule: &RuleConfig,
    state: *mut KeyState,
    aggregate: *mut KeyState,
    len: u64,
) -> Verdict {
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
            MapCell(&raw mut (*state).meters[0][0]),
            MapCell(&raw mut (*state).meters[1][0]),
            MapCell(&raw mut (*aggregate).meters[0][0]),
            MapCell(&raw mut (*aggregate).meters[1][0]),
        ]
    };
    let has = |flag: u32| rule.flags & flag != 0;
    let mut charges: [Charge<'_, MapCell>; order::METERS] = [None; order::METERS];
    charges[order::KEY_PACKETS] = has(rule_flag::LIMIT_PACKETS).then_some((
        &cells[order::KEY_PACKETS],
        &rule.packets.gcra,
        1,
    ));
    charges[order::KEY_BYTES] =
        has(rule_flag::LIMIT_BYTES).then_some((&cells[order::KEY_BYTES], &rule.bytes.gcra, len));
    charges[order::AGGREGATE_PACKETS] = has(rule_flag::AGGREGATE_PACKETS).then_some((
        &cells[order::AGGREGATE_PACKETS],
        &rule.aggregate_packets.gcra,
        1,
    ));
    charges[order::AGGREGATE_BYTES] = has(rule_flag::AGGREGATE_BYTES).then_some((
        &cells[order::AGGREGATE_BYTES],
        &rule.aggregate_bytes.gcra,
        len,
    ));
    acquire_all(charges, clock::now())
}

/// Windows: a window's three fields change together, so the key's state
/// (then the aggregate's, always in that order) is locked while checked.
#[inline(always)]
fn meter_windows(
    config: &GlobalConfig,
    rule: &RuleConfig,
    state: *mut KeyState,
    aggregate: *mut KeyState,
    len: u64,
) -> Verdict {
    let contended = Verdict {
        outcome: Outcome::Contended,
        refused_by: 0,
    };
    let has_aggregate =
        rule.flags & (rule_flag::AGGREGATE_PACKETS | rule_flag::AGGREGATE_BYTES) != 0;
    let key_lock = unsafe { &raw mut (*state).lock };
    let aggregate_lock = unsafe { &raw mut (*aggregate).lock };
    if !lock(key_lock) {
        return contended;
    }
    if has_aggregate && !lock(aggregate_lock) {
        unlock(key_lock);
        return contended;
    }
    let now = clock::now().wrapping_add(config.realtime_offset_ns);
    let (key_meters, aggregate_meters) =
        unsafe { (&mut (*state).meters, &mut (*aggregate).meters) };
    let [key_packets, key_bytes] = key_meters;
    let [aggregate_packets, aggregate_bytes] = aggregate_meters;
    let has = |flag: u32| rule.flags & flag != 0;
    let mut charges: [WindowCharge<'_>; order::METERS] = [const { None }; order::METERS];
    charges[order::KEY_PACKETS] = has(rule_flag::LIMIT_PACKETS)
        .then(|| (WindowState::in_slots(key_packets), &rule.packets.window, 1));
    charges[order::KEY_BYTES] = has(rule_flag::LIMIT_BYTES)
        .then(|| (WindowState::in_slots(key_bytes), &rule.bytes.window, len));
    charges[order::AGGREGATE_PACKETS] = has(rule_flag::AGGREGATE_PACKETS).then(|| {
        (
            WindowState::in_slots(aggregate_packets),
            &rule.aggregate_packets.window,
            1,
        )
    });
    charges[order::AGGREGATE_BYTES] = has(rule_flag::AGGREGATE_BYTES).then(|| {
        (
            WindowState::in_slots(aggregate_bytes),
            &rule.aggregate_bytes.window,
            len,
        )
    });
    let verdict = windows_all(
        charges,
        now,
        rule.algorithm == algorithm::SLIDING_WINDOW,
    );
    if has_aggregate {
        unlock(aggregate_lock);
    }
    unlock(key_lock);
    verdict
}

/// The state of `key`, created empty (a full bucket) on first sight.
#[inline(always)]
fn key_state(iface: u32, rule_id: u32, key: &FlowKey) -> Option<*mut KeyState> {
    if let Some(state) = KEYS.get_ptr_mut(key) {
        return Some(state);
    }
    // BPF_NOEXIST: when two CPUs see a new key at once, one creates it and
    // the other finds it on the lookup below.
    if KEYS
        .insert(key, KeyState::default(), u64::from(BPF_NOEXIST))
        .is_ok()
    {
        count_rule(iface, rule_id, |c| c.new_keys += 1);
    }
    KEYS.get_ptr_mut(key)
}

#[inline(always)]
fn count_rule(iface: u32, rule_id: u32, update: impl FnOnce(&mut RuleCounters)) {
    if let Some(counters) = RULE_STATS.get_ptr_mut(counter_slot(iface, rule_id)) {
        update(unsafe { &mut *counters });
    }
}

#[inline(always)]
fn count_global(update: impl FnOnce(&mut GlobalCounters)) {
    if let Some(counters) = GLOBAL_STATS.get_ptr_mut(0) {
        update(unsafe { &mut *counters });
    }
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
