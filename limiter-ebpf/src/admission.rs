//! A source not yet tracked: the checks before it gets a key (the rule's
//! aggregate, its key-creation budget), and the slot it gets.

use limiter_common::{
    abi::{FlowKey, GlobalConfig, GlobalCounters, RuleConfig, RuleCounters, algorithm, rule_flag},
    gcra::{Check, Gcra},
    keytable::Slot,
    meter::{Outcome, Verdict, acquire, order, refund},
};

use crate::{
    cell::MapCell,
    decide::{KEY_ALLOC_FAILED, REFUSED_ADMISSION},
    keys,
    maps::{ADMISSIONS, AGGREGATES},
    meter::Cost,
};

/// The state of a source not yet tracked, created empty (a full bucket),
/// or the verdict for its packet when it gets none: a packet the rule's
/// aggregate would refuse creates nothing, beyond the rule's key-creation
/// budget the packet is refused (see `RuleConfig::admission`), and so it is
/// when its bucket has no slot to give (`keys::claim`; the creation it was
/// granted is handed back to the budget).
#[inline(always)]
#[expect(clippy::too_many_arguments, reason = "inlined; the packet's context")]
pub fn new_key(
    config: &GlobalConfig,
    generation: u32,
    global: &mut GlobalCounters,
    rule_id: u32,
    rule: &RuleConfig,
    key: &FlowKey,
    counters: &mut RuleCounters,
    now: u64,
    cost: Cost,
) -> Result<*mut Slot, Verdict> {
    let Cost { len, credits } = cost;
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
        let deny = |gcra: &Gcra, tat: u64, cost: u64| gcra.check(tat, now, cost) == Check::Deny;
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
    // SAFETY: an `ADMISSIONS` value's aligned u64, a map lookup's pointer.
    let budget = unsafe { MapCell::at(budget) };
    if acquire(budget, &rule.admission, now, 1) != Outcome::Allowed {
        return refused(REFUSED_ADMISSION);
    }
    let state = keys::claim(config, generation, key, now, global);
    if state.is_null() {
        refund(budget, &rule.admission, now, 1);
        return refused(KEY_ALLOC_FAILED);
    }
    counters.new_keys += 1;
    Ok(state)
}
