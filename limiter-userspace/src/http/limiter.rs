//! The layer-7 limiter: its rules and state, and the way from a request
//! to the decision (the rule that applies, the key's state found or made).

use std::sync::{Arc, atomic::Ordering};

use limiter_common::trace::reason;

use super::{
    classify::{is_plain, rest_ns},
    clock::Clock,
    counters::HttpCounters,
    decision::{Decision, RequestMeta, ipv4_mapped},
    fleet_meter, headers,
    identity::{KeyDigest, StateKey},
    keys,
    state::State,
};
use crate::rules::{
    Fallback, Limit, Rule, RuleSet,
    matching::{RequestRules, key_masks},
};

pub struct Limiter {
    pub(super) rules: RuleSet,
    /// Which rule applies to a request (the kernel's order), by source.
    matcher: RequestRules,
    /// By rule index: what its responses always say.
    pub(super) header_fields: Vec<headers::RuleFields>,
    pub(super) clock: Arc<dyn Clock>,
    /// By (rule index, key); a plain rule's keys of IPv4 clients by (its
    /// slot, address), shared with the limiters reloads make.
    pub(super) keys: keys::KeyStore,
    /// By rule index: see [`rest_ns`].
    pub(super) rest_ns: Vec<Option<u64>>,
    /// By rule index: the masks of its client-address keys (IPv4, IPv6).
    pub(super) key_masks: Vec<([u8; 4], [u8; 16])>,
    /// Shared with the limiters a reload makes, so keys keep their digests.
    pub(super) digest: Arc<KeyDigest>,
    /// By rule index; shared with a reload's limiter for unchanged rules.
    pub(super) aggregates: Vec<Arc<State>>,
    pub counters: Vec<Arc<HttpCounters>>,
    /// By rule index: the share of a fleet rule's aggregate.
    pub(super) fleet: Vec<Option<fleet_meter::FleetMeter>>,
    /// By rule index: for a rule of one GCRA request limit and nothing
    /// besides (a plain per-client limit), which [`Limiter::decide_plain`]
    /// judges, its slot among the plain keys ([`keys::PlainKeys`]).
    pub(super) plain: Vec<Option<u32>>,
}

impl Limiter {
    pub fn new(rules: RuleSet, clock: Arc<dyn Clock>) -> Self {
        let n = rules.rules.len();
        let rest = rules.rules.iter().map(rest_ns).collect();
        let keys = keys::KeyStore::new(rules.max_keys as usize);
        // The first read calibrates the clock: at start, not at a request.
        clock.monotonic_ns();
        Self {
            aggregates: (0..n).map(|_| Arc::default()).collect(),
            fleet: rules
                .rules
                .iter()
                .map(fleet_meter::FleetMeter::of)
                .collect(),
            plain: (rules.rules.iter())
                .map(|r| is_plain(r).then(|| keys.plain.new_slot()))
                .collect(),
            counters: (0..n).map(|_| Arc::default()).collect(),
            matcher: RequestRules::new(&rules),
            header_fields: rules.rules.iter().map(headers::RuleFields::of).collect(),
            key_masks: rules.rules.iter().map(key_masks).collect(),
            rules,
            clock,
            keys,
            rest_ns: rest,
            digest: Arc::new(KeyDigest::new()),
        }
    }

    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// Keys with state now.
    pub fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// New keys refused so far because every key kept was still in debt.
    pub fn key_alloc_failures(&self) -> u64 {
        self.keys.refused.load(Ordering::Relaxed)
    }

    /// The rule that applies to `request`, if any, its client canonical
    /// ([`ipv4_mapped`]): a dual-stack listener sees IPv4 clients as
    /// `::ffff:a.b.c.d`, and they are IPv4 clients, under IPv4 rules and
    /// IPv4 keys.
    #[inline(always)]
    pub(super) fn rule_of(&self, request: &RequestMeta<'_>) -> Option<usize> {
        debug_assert!(ipv4_mapped(request).is_none(), "not canonical");
        self.matcher.first(
            &self.rules,
            &request.client,
            &request.port,
            request.http.as_ref(),
        )
    }

    /// Meters one request and decides.
    pub fn check(&self, request: &RequestMeta<'_>) -> Decision {
        if let Some(request) = ipv4_mapped(request) {
            return self.check(&request);
        }
        let Some(index) = self.rule_of(request) else {
            let allowed = self.rules.default == Fallback::Pass;
            let refused_by = (!allowed).then_some(reason::RULE_BLOCKS);
            return Decision::plain(allowed, false, None, refused_by);
        };
        let rule = &self.rules.rules[index];
        let clock = &self.clock;
        // No room for a new key: refused, as the kernel refuses one.
        let full = || self.excess(index, reason::NO_SLOT);
        let Some(key) = self.plain_key(index, rule, request) else {
            return self.check_keyed(index, rule, request);
        };
        // A key a reload left among the others (see `share_keys`).
        let elsewhere = || {
            let key = StateKey::v4(index, key as u32);
            self.keys
                .get(&key, |state| self.decide(index, request, state))
        };
        self.keys.with_plain(
            key,
            || clock.monotonic_ns(),
            &self.rest_ns,
            |state| self.decide_plain(index, rule, (&state.tat, &state.last_seen)),
            elsewhere,
            full,
        )
    }

    /// [`Limiter::check`] of a request whose key is not a plain key (out
    /// of line: the plain key's path is the one kept short).
    #[inline(never)]
    fn check_keyed(&self, index: usize, rule: &Rule, request: &RequestMeta<'_>) -> Decision {
        if matches!(rule.limit, Limit::Unlimited) && rule.concurrent.is_none() {
            return Decision::plain(true, false, Some(index), None);
        }
        let clock = &self.clock;
        let key = self.state_key(index, rule, request);
        self.keys.with(
            key,
            || clock.monotonic_ns(),
            &self.rest_ns,
            |state| self.decide(index, request, state),
            || self.excess(index, reason::NO_SLOT),
        )
    }

    /// A key of rule `index` seen at `now` (see [`State::seen`]: whether
    /// its state says when it rests is the rule's [`rest_ns`]).
    #[inline]
    pub(super) fn seen(&self, index: usize, state: &State, now: u64) {
        state.seen(now, self.rest_ns[index].is_none());
    }

    /// Counts a request refused (or, under a dry run, let through) and
    /// says so.
    pub(super) fn excess(&self, index: usize, refused_by: u8) -> Decision {
        let rule = &self.rules.rules[index];
        let counters = &self.counters[index];
        let counter = if rule.shadow {
            &counters.shadow
        } else {
            &counters.dropped
        };
        counter.add(1);
        Decision::plain(rule.shadow, rule.shadow, Some(index), Some(refused_by))
    }

    /// What the responses of the rule that judged `decision` always say
    /// (`None`: the default rule).
    pub fn rule_fields(&self, decision: &Decision) -> Option<&headers::RuleFields> {
        decision.rule.map(|i| &self.header_fields[i])
    }

    /// The rule's name in a decision (`default` for none).
    pub fn rule_name(&self, decision: &Decision) -> &str {
        decision
            .rule
            .map_or("default", |i| &self.rules.rules[i].name)
    }
}
