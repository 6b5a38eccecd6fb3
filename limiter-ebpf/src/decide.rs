//! The decision program's work, on a packet the entry program parsed
//! (`abi::Handoff`): its rule, a manual block, the rule's meters, then
//! the counters and the verdict.

use core::ptr::NonNull;

use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use limiter_common::{
    abi::{
        FlowKey, GlobalConfig, GlobalCounters, Handoff, action, counter_slot, global_flag,
        handoff_flag, rule_flag, rule_slot,
    },
    keytable::Slot,
    meter::{Outcome, Verdict, order},
    segments,
    trace::{reason, verdict as traced},
};

use crate::{
    admission, blocks, clock, fragments, handoff, keys,
    maps::{CONFIG, COSTS, GLOBAL_STATS, IFACE_MTU, RULE_STATS, RULES},
    matching,
    meter::{self, Cost},
    parse::Source,
    profile, report,
    trace::Decision,
};

/// `Verdict::refused_by` beyond the meters' (`order`), as `trace::reason`
/// names them: a packet refused a new key,
pub const REFUSED_ADMISSION: usize = reason::UNADMITTED as usize;
/// one whose new key could not be stored,
pub const KEY_ALLOC_FAILED: usize = reason::NO_SLOT as usize;
/// one whose rule blocks,
const REFUSED_BY_RULE: usize = reason::RULE_BLOCKS as usize;
/// and a later fragment whose first fragment was dropped.
const REFUSED_WITH_FIRST_FRAGMENT: usize = reason::FRAGMENT as usize;
const _: () = assert!(REFUSED_ADMISSION == order::METERS);

/// The decision program.
#[inline(always)]
pub fn run(ctx: &XdpContext) -> u32 {
    let (Some(handed), Some(config), Some(global)) = (
        handoff::received(),
        CONFIG.get(0),
        GLOBAL_STATS.get_ptr_mut(0),
    ) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: a per-CPU value, which only this CPU's programs touch, and
    // one of them at a time.
    let global = unsafe { &mut *global };
    if profile::stop_after(profile::HANDED_OVER) {
        return profile::verdict(profile::both(
            profile::both(u64::from(handed.len), u64::from(config.generation)),
            global.packets,
        ));
    }
    let decision = decide(config, global, handed);
    report::finish(ctx, &decision)
}

/// Finds the packet's rule, applies a manual block or the rule, and counts.
#[inline(always)]
fn decide(config: &GlobalConfig, global: &mut GlobalCounters, handed: &mut Handoff) -> Decision {
    let global_shadow = config.flags & global_flag::SHADOW != 0;
    let generation = handed.generation;
    let source = handoff::source(handed);
    let len = u64::from(handed.len);
    // A later fragment takes its first fragment's rule, and its fate.
    let later_fragment = handed.flags & handoff_flag::LATER_FRAGMENT != 0;
    let first = if later_fragment {
        fragments::first_of(generation, &source, handed.datagram)
    } else {
        None
    };
    let rule_id = match first {
        Some(first) => first.rule,
        None => matching::match_rule(generation, &source, handed),
    };
    handed.rule = rule_id;
    if later_fragment && first.is_none() {
        // Its first fragment not seen (yet: a datagram may be sent first
        // fragment last): the rule file's `fragments` says what becomes of it.
        let drop = config.flags & global_flag::DROP_ORPHAN_FRAGMENTS != 0;
        fragments::count_orphan(drop);
        if drop {
            let (action, verdict) = if global_shadow {
                (action::PASS, traced::SHADOW)
            } else {
                (action::DROP, traced::DROPPED)
            };
            return Decision::new(action, verdict, reason::ORPHAN_FRAGMENT);
        }
    }
    if handed.flags & handoff_flag::TINY_FRAGMENT != 0 {
        // RFC 1858: a first fragment too short for its transport header
        // hides its ports from every rule; no sound stack sends one.
        global.tiny_fragments += 1;
        let action = if global_shadow {
            action::PASS
        } else {
            action::DROP
        };
        return Decision::new(action, traced::MALFORMED, reason::TINY_FRAGMENT);
    }
    if profile::stop_after(profile::RULE_MATCHED) {
        return profile::decision(u64::from(rule_id));
    }
    let (Some(rule), Some(counters)) = (
        RULES.get(rule_slot(generation, rule_id)),
        RULE_STATS.get_ptr_mut(counter_slot(handed.iface, rule_id)),
    ) else {
        return Decision::new(action::PASS, traced::PASSED, reason::NONE);
    };
    // SAFETY: a per-CPU value, as `global`.
    let counters = unsafe { &mut *counters };
    if profile::stop_after(profile::RULE_LOADED) {
        return profile::decision(profile::both(
            u64::from(rule.flags),
            counters.passed_packets,
        ));
    }
    let metered = rule.flags & (rule_flag::BLOCK | rule_flag::UNLIMITED) == 0;
    // The frames it stands for: 1, or in skb mode a buffer's segments.
    let frames = frames_of(handed);
    // What the packet costs its packet meters: its frames, each 1 or its
    // class's credits.
    let credits = if rule.flags & rule_flag::COSTS != 0 {
        COSTS
            .get(rule_slot(generation, rule_id))
            .map_or(1, |costs| {
                costs.credits(handed.protocol, handed.dest_port, handed.tcp_flags)
            })
    } else {
        1
    } * frames;
    let key = match source {
        Source::V4(addr) => FlowKey::v4(rule_id, addr, rule.v4_key_mask),
        Source::V6(addr) => FlowKey::v6(rule_id, addr, rule.v6_key_mask),
    };
    let slot = if metered {
        keys::find(config, &key)
    } else {
        None
    };
    if profile::stop_after(profile::KEY_FOUND) {
        return profile::decision(slot.map_or(0, |s| s.as_ptr() as u64));
    }
    // A key that is one whole address remembers the block epoch at which
    // its source was last found unblocked (a masked key covers addresses
    // a block may cover apart); 0 means never, hence the + 1.
    let block_cache = slot.filter(|_| blocks::whole_address_key(rule, &source));
    let epoch = config.block_epoch.wrapping_add(1);
    // SAFETY: the slot's `block_epoch`, an aligned u32 of a `KEYS` value,
    // read through its pointer: other CPUs write it (only with this epoch).
    let cached = |s: NonNull<Slot>| unsafe { (&raw const (*s.as_ptr()).block_epoch).read() };
    if config.blocks != 0 && block_cache.is_none_or(|s| cached(s) != epoch) {
        if blocks::blocked(&source) {
            global.blocked += 1;
            let (action, verdict) = if global_shadow {
                (action::PASS, traced::SHADOW)
            } else {
                (action::DROP, traced::BLOCKED)
            };
            return Decision::new(action, verdict, reason::BLOCK);
        }
        if let Some(slot) = block_cache {
            // SAFETY: as above: this slot's `block_epoch`, an aligned u32 of a `KEYS`
            // value; one plain store, which a racing CPU's store only overwrites.
            unsafe { (*slot.as_ptr()).block_epoch = epoch };
        }
    }
    if profile::stop_after(profile::BLOCK_CHECKED) {
        return profile::decision(u64::from(epoch));
    }
    let now = clock::now();
    if profile::stop_after(profile::CLOCK_READ) {
        return profile::decision(now);
    }
    let cost = Cost { len, credits };
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
            None => admission::new_key(
                config, generation, global, rule_id, rule, &key, counters, now, cost,
            ),
        };
        match slot {
            Ok(slot) => meter::charge_key(config, handed, rule_id, rule, slot, now, cost),
            Err(verdict) => verdict,
        }
    };
    if profile::stop_after(profile::METERED) {
        return profile::decision(verdict.outcome as u64);
    }
    let allowed = verdict.outcome == Outcome::Allowed;
    let shadow = global_shadow || rule.flags & rule_flag::SHADOW != 0;
    if allowed || shadow {
        counters.passed_packets += frames;
        counters.passed_bytes += len;
    }
    if !allowed && shadow {
        counters.shadow_packets += frames;
        counters.shadow_bytes += len;
    }
    if !allowed && !shadow {
        counters.dropped_packets += frames;
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
    if handed.flags & handoff_flag::FIRST_FRAGMENT != 0 {
        fragments::remember(
            generation,
            &source,
            handed.datagram,
            rule_id,
            !allowed && !shadow,
        );
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
    Decision::new(action, verdict_traced, why)
}

/// The frames the packet stands for (`limiter_common::segments`). Its
/// length is read again for this: the comparisons here would otherwise
/// bound the decision's own copy, and the verifier walk the rest once per
/// bound (57,000 instructions more on 6.18).
#[inline(always)]
fn frames_of(handed: &Handoff) -> u64 {
    // SAFETY: a field of this CPU's hand-over record; one aligned load.
    let len = u64::from(unsafe { core::ptr::read_volatile(&handed.len) });
    segments::frames(
        len,
        IFACE_MTU.get(handed.iface).map_or(0, |mtu| u64::from(*mtu)),
    )
}
