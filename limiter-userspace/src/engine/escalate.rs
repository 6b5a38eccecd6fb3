//! Escalation for the kernel's keys (`escalate` in the rule file): once a
//! second the daemon, or `limiter run`, looks at every key of the rules
//! that escalate; a key over its limit at every look for the rule's
//! `after` is held by its rule's meter for the rule's `block` (`scope:
//! key`, the default: its meters' TATs set past the block), or has its
//! source prefix blocked for `block`, as `limiter block` would (`scope:
//! source`: before any rule; expiring by itself). Under a
//! dry run (`action: shadow`) it is counted and logged, not blocked. The
//! watch (`limiter_common::escalation`) is layer 7's too.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use anyhow::Result;
use ipnet::IpNet;
use limiter_common::{
    abi::{FlowKey, RuleConfig},
    escalation::{Escalation, over_limit},
    gcra::Gcra,
};

use super::Engine;
use crate::{kernel::keys::KeyTable, rules::EscalateScope};

/// A rule that escalates, as a look needs it: its name, escalation, dry
/// run, kernel config, third limit and scope.
type Watched = (
    String,
    Escalation,
    bool,
    RuleConfig,
    Option<Gcra>,
    EscalateScope,
);

/// The TATs that hold a key of `rule` (GCRA) until `block` from `now`
/// ends: each of its meters a whole capacity past the block's end, so
/// that it refuses every packet until then.
fn held_tats(rule: &RuleConfig, escalation: &Escalation, now: u64) -> [Option<u64>; 2] {
    use limiter_common::abi::rule_flag;
    let end = now.saturating_add(escalation.block_ns);
    let tat = |flag: u32, gcra: &Gcra| {
        (rule.flags & flag != 0).then(|| end.saturating_add(gcra.capacity_ns))
    };
    [
        tat(rule_flag::LIMIT_PACKETS, &rule.packets.gcra),
        tat(rule_flag::LIMIT_BYTES, &rule.bytes.gcra),
    ]
}

/// A minute, in ns of the clock escalation looks by.
const MINUTE_NS: u64 = 60_000_000_000;

/// Whether a rule has an aggregate limit, whose refusals a key's count
/// of refusals includes.
fn has_aggregate(rule: &RuleConfig) -> bool {
    use limiter_common::abi::rule_flag;
    rule.flags & (rule_flag::AGGREGATE_PACKETS | rule_flag::AGGREGATE_BYTES) != 0
}

/// One escalation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Escalated {
    pub prefix: IpNet,
    pub rule: String,
    pub block: Duration,
    /// False under a dry run: counted, not blocked.
    pub enforced: bool,
    /// `scope: key`: the key, and the TAT each of its GCRA meters (packets,
    /// bytes) is set to, so that it refuses everything until the block
    /// ends. `None`: the source prefix is blocked.
    pub hold: Option<(FlowKey, [Option<u64>; 2])>,
}

impl Engine {
    /// Looks at every key of the rules that escalate, and blocks those
    /// over their limit for long enough; what it escalated.
    pub fn escalate(&mut self) -> Result<Vec<Escalated>> {
        let Some((set, ids)) = &self.applied else {
            return Ok(Vec::new());
        };
        let config = self.datapath.config()?;
        let mut rules: HashMap<u32, Watched> = HashMap::new();
        for (rule, &id) in set.rules.iter().zip(ids) {
            let Some(escalation) = rule.escalate else {
                continue;
            };
            let Ok(kernel) = self
                .datapath
                .maps()
                .rules
                .get(&limiter_common::abi::rule_slot(config.generation, id), 0)
            else {
                continue;
            };
            let dry_run = kernel.flags & limiter_common::abi::rule_flag::SHADOW != 0
                || config.flags & limiter_common::abi::global_flag::SHADOW != 0;
            let third = rule.third.map(|t| t.rate.gcra);
            let scope = rule.escalate_scope;
            rules.insert(
                id,
                (rule.name.clone(), escalation, dry_run, kernel, third, scope),
            );
        }
        if rules.is_empty() {
            self.watch.over_since.clear();
            self.watch.looked.clear();
            return Ok(Vec::new());
        }
        let now = self.datapath.clock_ns();
        // A key whose block (held or dry) ended since the last look is
        // passed by once more: what it refused since that look, the block
        // refused (a held key's buckets are empty when its block ends), so
        // its watch starts afresh at the next look, not over at this one.
        let mut released = HashSet::new();
        self.watch.dry_until.retain(|key, until| {
            let blocked = *until > now;
            if !blocked {
                released.insert(*key);
            }
            blocked
        });
        let mut over_since = HashMap::new();
        let mut dropped = HashMap::new();
        let mut due = Vec::new();
        let mut dry_until = Vec::new();
        self.datapath.maps().keys.visit(|key, state| {
            let Some((name, escalation, dry_run, kernel, third, scope)) = rules.get(&key.rule_id())
            else {
                return;
            };
            if self.watch.dry_until.contains_key(key) || released.contains(key) {
                // Held, or by a dry run's block, or just released: its
                // count still moves on.
                if state.dropped_packets != 0 {
                    dropped.insert(*key, state.dropped_packets);
                }
                return;
            }
            // Over: it refused a packet since the last look, or would
            // refuse the next one now.
            // (A key's count of refusals includes the aggregate's: under a
            // rule with one, only its own meters say it is over.)
            // (A key not in the last look's counts had refused none, if
            // that look was at its rule.)
            let refused_since = !has_aggregate(kernel)
                && self.watch.looked.contains(&key.rule_id())
                && self.watch.dropped.get(key).copied().unwrap_or(0) != state.dropped_packets;
            if state.dropped_packets != 0 {
                dropped.insert(*key, state.dropped_packets);
            }
            let over = refused_since
                || over_limit(
                    state,
                    kernel,
                    third.as_ref(),
                    now,
                    config.realtime_offset_ns,
                );
            let since = self.watch.over_since.get(key).copied().unwrap_or(0);
            let (since, block) = escalation.observe(since, over, now);
            if since != 0 {
                over_since.insert(*key, since);
            }
            if block {
                let hold = (*scope == EscalateScope::Key)
                    .then(|| (*key, held_tats(kernel, escalation, now)));
                if *dry_run || hold.is_some() {
                    dry_until.push((*key, now.saturating_add(escalation.block_ns)));
                }
                due.push(Escalated {
                    prefix: KeyTable::prefix_of(key, Some(kernel)),
                    rule: name.clone(),
                    block: Duration::from_nanos(escalation.block_ns),
                    enforced: !dry_run,
                    hold,
                });
            }
        });
        self.watch.over_since = over_since;
        self.watch.dropped = dropped;
        self.watch.looked = rules.keys().copied().collect();
        self.watch.dry_until.extend(dry_until);
        if due.is_empty() && self.watch.made.is_empty() {
            return Ok(due);
        }
        // The blocks as they stand, read once: (prefix, expired).
        let listed: Vec<(IpNet, bool)> = self
            .blocks()?
            .into_iter()
            .filter_map(|b| Some((b.prefix.parse().ok()?, b.expired)))
            .collect();
        // Forget what it made once the block is gone.
        self.watch
            .made
            .retain(|net, _| listed.iter().any(|(listed, _)| listed == net));
        // A prefix blocked already (by hand, for ever maybe) keeps its block.
        due.retain(|e| {
            e.hold.is_some()
                || !listed
                    .iter()
                    .any(|(net, expired)| !expired && *net == e.prefix)
        });
        let due = self.bounded(due, now);
        let mut holds = Vec::new();
        for escalated in &due {
            if escalated.enforced {
                match escalated.hold {
                    Some(hold) => holds.push(hold),
                    None => {
                        self.block(escalated.prefix, Some(escalated.block))?;
                        self.watch
                            .made
                            .insert(escalated.prefix, escalated.rule.clone());
                    }
                }
            }
            *self.watch.counts.entry(escalated.rule.clone()).or_default() += 1;
        }
        if !holds.is_empty() {
            self.datapath.maps().keys.hold(&holds);
        }
        Ok(due)
    }

    /// `due` within the rule file's `escalation`: none of a never-block
    /// prefix, and at most `max_per_minute` blocks in any minute (dry runs,
    /// which block nothing, are not held to it). What it leaves out is
    /// counted and logged (the cap once a minute at most).
    fn bounded(&mut self, due: Vec<Escalated>, now: u64) -> Vec<Escalated> {
        let Some((set, _)) = &self.applied else {
            return due;
        };
        let policy = &set.escalation;
        let watch = &mut self.watch;
        while watch
            .recent
            .front()
            .is_some_and(|&at| now.saturating_sub(at) >= MINUTE_NS)
        {
            watch.recent.pop_front();
        }
        let mut kept = Vec::with_capacity(due.len());
        let mut capped = 0;
        for escalated in due {
            if let Some(spared) = policy.spares(&escalated.prefix) {
                *watch.left_out.entry("never_block").or_default() += 1;
                tracing::warn!(event = "escalation_left_out", prefix = %escalated.prefix, rule = %escalated.rule, reason = "never_block",
                    "{} stayed over rule {:?}'s limit: not blocked, escalation.never_block has {spared}", escalated.prefix, escalated.rule);
                continue;
            }
            // Holds block only what the rule limits already: not capped.
            if escalated.enforced && escalated.hold.is_none() {
                if watch.recent.len() >= policy.max_per_minute as usize {
                    capped += 1;
                    continue;
                }
                watch.recent.push_back(now);
            }
            kept.push(escalated);
        }
        if capped > 0 {
            *watch.left_out.entry("max_per_minute").or_default() += capped;
            if watch.cap_logged == 0 || now.saturating_sub(watch.cap_logged) >= MINUTE_NS {
                watch.cap_logged = now;
                tracing::warn!(
                    event = "escalation_left_out",
                    reason = "max_per_minute",
                    left_out = capped,
                    "keys over their limits left unblocked: {capped} this look; escalation.max_per_minute ({}) reached",
                    policy.max_per_minute
                );
            }
        }
        kept
    }

    /// Escalations left out by the rule file's `escalation`, by why
    /// (`never_block`, `max_per_minute`), since this process started.
    pub fn escalations_left_out(&self) -> Vec<(String, u64)> {
        let mut counts: Vec<(String, u64)> = self
            .watch
            .left_out
            .iter()
            .map(|(why, n)| ((*why).to_owned(), *n))
            .collect();
        counts.sort();
        counts
    }

    /// Escalations per rule name since this process started.
    pub fn escalations(&self) -> Vec<(String, u64)> {
        let mut counts: Vec<(String, u64)> = self
            .watch
            .counts
            .iter()
            .map(|(rule, n)| (rule.clone(), *n))
            .collect();
        counts.sort();
        counts
    }
}

#[cfg(test)]
mod tests {
    use limiter_common::abi::rule_flag;

    use super::*;

    /// A hold moves only the meters the rule has (`KeyTable::hold` leaves
    /// a `None` word as it is: the key's other words are not its meters).
    #[test]
    fn an_escalation_holds_only_the_rules_meters() {
        let mut rule = RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            ..RuleConfig::default()
        };
        rule.packets.gcra = Gcra::new(10, 1_000_000_000, 5).unwrap();
        rule.bytes.gcra = Gcra::new(1_000, 1_000_000_000, 500).unwrap();
        let escalation = Escalation {
            after_ns: 1,
            block_ns: 3_000_000_000,
        };
        let now = 7_000_000_000;
        let end = now + escalation.block_ns;
        assert_eq!(
            held_tats(&rule, &escalation, now),
            [Some(end + rule.packets.gcra.capacity_ns), None]
        );
        rule.flags = rule_flag::LIMIT_BYTES;
        assert_eq!(
            held_tats(&rule, &escalation, now),
            [None, Some(end + rule.bytes.gcra.capacity_ns)]
        );
    }
}
