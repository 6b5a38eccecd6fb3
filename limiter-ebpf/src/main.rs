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

use aya_ebpf::{
    bindings::{BPF_NOEXIST, xdp_action},
    macros::xdp,
    maps::lpm_trie::Key,
    programs::XdpContext,
};
use cell::MapCell;
use limiter_common::{
    abi::{
        DEFAULT_RULE, FlowKey, GlobalCounters, KeyState, RuleConfig, RuleCounters, action,
        rule_flag,
    },
    meter::{Outcome, acquire_pair},
};
use maps::{CONFIG, GLOBAL_STATS, KEYS, LPM_V4, LPM_V6, RULE_STATS, RULES};
use parse::{Packet, Source};

#[xdp]
pub fn limiter(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    let verdict = match parse::parse(&ctx) {
        Ok(Some(packet)) => limit(&packet, len),
        Ok(None) => {
            count_global(|c| c.non_ip += 1);
            action::PASS
        }
        Err(parse::Malformed) => {
            count_global(|c| c.malformed += 1);
            CONFIG.get(0).map_or(action::PASS, |c| c.malformed_action)
        }
    };
    count_global(|c| c.packets += 1);
    if verdict == action::DROP {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

/// Applies the rule that matches `packet` and counts the verdict.
#[inline(always)]
fn limit(packet: &Packet, len: u64) -> u32 {
    count_global(|c| match packet.source {
        Source::V4(_) => c.ipv4 += 1,
        Source::V6(_) => c.ipv6 += 1,
    });
    if packet.fragment {
        count_global(|c| c.fragments += 1);
    }
    let rule_id = match_rule(packet);
    let Some(rule) = RULES.get(rule_id) else {
        return action::PASS;
    };
    let outcome = if rule.flags & rule_flag::BLOCK != 0 {
        Outcome::Denied
    } else if rule.flags & rule_flag::UNLIMITED != 0 {
        Outcome::Allowed
    } else {
        meter(rule_id, rule, packet, len)
    };
    let shadow = rule.flags & rule_flag::SHADOW != 0;
    count_rule(rule_id, |c| match outcome {
        Outcome::Allowed => {
            c.passed_packets += 1;
            c.passed_bytes += len;
        }
        _ if shadow => {
            c.shadow_packets += 1;
            c.shadow_bytes += len;
            c.passed_packets += 1;
            c.passed_bytes += len;
        }
        _ => {
            c.dropped_packets += 1;
            c.dropped_bytes += len;
        }
    });
    if outcome == Outcome::Contended {
        count_rule(rule_id, |c| c.contended += 1);
    }
    if outcome == Outcome::Allowed || shadow {
        action::PASS
    } else {
        action::DROP
    }
}

/// The first candidate of the longest source prefix that matches the
/// packet's protocol and port, or the default rule.
#[inline(always)]
fn match_rule(packet: &Packet) -> u32 {
    let candidates = match packet.source {
        Source::V4(addr) => LPM_V4.get(Key::new(32, addr)),
        Source::V6(addr) => LPM_V6.get(Key::new(128, addr)),
    };
    let Some(candidates) = candidates else {
        return DEFAULT_RULE;
    };
    for candidate in candidates.entries.iter() {
        if candidate as *const _ as usize
            >= &candidates.entries[0] as *const _ as usize + candidates.len as usize * 8
        {
            break;
        }
        if candidate.matches(packet.protocol, packet.dest_port) {
            return u32::from(candidate.rule);
        }
    }
    DEFAULT_RULE
}

/// Charges the packet to its key's meters.
#[inline(always)]
fn meter(rule_id: u32, rule: &RuleConfig, packet: &Packet, len: u64) -> Outcome {
    let key = match packet.source {
        Source::V4(addr) => FlowKey::v4(rule_id, addr, rule.v4_key_mask),
        Source::V6(addr) => FlowKey::v6(rule_id, addr, rule.v6_key_mask),
    };
    let Some(state) = key_state(rule_id, &key) else {
        count_global(|c| c.key_alloc_failed += 1);
        return Outcome::Denied;
    };
    let now = clock::now();
    let packets = MapCell(unsafe { &raw mut (*state).packets_tat });
    let bytes = MapCell(unsafe { &raw mut (*state).bytes_tat });
    acquire_pair(
        (rule.flags & rule_flag::LIMIT_PACKETS != 0).then_some((&packets, &rule.packets, 1)),
        (rule.flags & rule_flag::LIMIT_BYTES != 0).then_some((&bytes, &rule.bytes, len)),
        now,
    )
}

/// The state of `key`, created empty (a full bucket) on first sight.
#[inline(always)]
fn key_state(rule_id: u32, key: &FlowKey) -> Option<*mut KeyState> {
    if let Some(state) = KEYS.get_ptr_mut(key) {
        return Some(state);
    }
    // BPF_NOEXIST: when two CPUs see a new key at once, one creates it and
    // the other finds it on the lookup below.
    if KEYS
        .insert(key, KeyState::default(), u64::from(BPF_NOEXIST))
        .is_ok()
    {
        count_rule(rule_id, |c| c.new_keys += 1);
    }
    KEYS.get_ptr_mut(key)
}

#[inline(always)]
fn count_rule(rule_id: u32, update: impl FnOnce(&mut RuleCounters)) {
    if let Some(counters) = RULE_STATS.get_ptr_mut(rule_id) {
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

    /// Test builds: the time the test stored in the CLOCK map.
    #[cfg(feature = "test-clock")]
    #[inline(always)]
    pub fn now() -> u64 {
        crate::maps::CLOCK.get(0).copied().unwrap_or(0)
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
