//! A request's decision once its key's state is found: the whole one, and
//! the plain rule's shortcut.

use std::{
    cell::Cell,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use limiter_common::{
    meter::{AtomicCell, Outcome, acquire, acquire_delayed, order},
    trace::reason,
};

use super::{
    decision::{Decision, QuotaAt, RequestMeta},
    limiter::Limiter,
    meter::{Charges, refused_wait_ns_of},
    state::{InFlight, State, seen},
};
use crate::rules::{Algorithm, Rate, Rule};

impl Limiter {
    /// [`Limiter::check`] once the request's key state is found.
    pub(super) fn decide(
        &self,
        index: usize,
        request: &RequestMeta<'_>,
        state: &Arc<State>,
    ) -> Decision {
        let rule = &self.rules.rules[index];
        // A block a reload's rule left on the key goes the long way.
        if self.plain[index].is_some() && state.blocked_until.load(Ordering::Relaxed) == 0 {
            return self.decide_plain(index, rule, (&state.cells[0], &state.last_seen));
        }
        // (Unlimited: none, but counted in flight.)
        let [packets, key_bytes, _] = rule.key_meters();
        let counters = &self.counters[index];
        // A key its escalation blocked is refused before anything else
        // (under a dry run, passed and counted), and charged nothing.
        let blocked_until = state.blocked_until.load(Ordering::Relaxed);
        if blocked_until != 0 {
            let now = self.clock.monotonic_ns();
            if now < blocked_until {
                return Decision {
                    blocked_for_ns: blocked_until - now,
                    ..self.excess(index, reason::ESCALATED)
                };
            }
        }
        // Counted in flight first: a request refused for that is charged
        // nothing; one the meters refuse is no longer in flight.
        let in_flight = match rule.concurrent {
            None => None,
            Some(max) => match InFlight::enter(state, max) {
                Some(entered) => Some(Arc::new(entered)),
                None => {
                    counters.in_flight_excess.fetch_add(1, Ordering::Relaxed);
                    return Decision {
                        too_many_in_flight: true,
                        ..self.excess(index, reason::IN_FLIGHT)
                    };
                }
            },
        };
        // A request's credits (`cost`): its class's, or 1.
        let credits = request.http.as_ref().map_or(1, |http| {
            rule.costs
                .iter()
                .find(|class| class.holds_request(http))
                .map_or(1, |class| class.credits)
        });
        let mut delay_ns = 0;
        let mut by_aggregate = false;
        let mut refused_by = None;
        let mut refused_wait_ns = 0;
        let judged_at = Cell::new(0);
        // A lone request limit (most rules): its one meter alone, as
        // `acquire_all` charges an array of it alone.
        let lone = packets.filter(|_| {
            key_bytes.is_none()
                && rule.third.is_none()
                && rule.aggregate.is_none()
                && self.fleet[index].is_none()
        });
        let allowed = match (rule.algorithm, rule.delay, lone) {
            (Algorithm::Gcra, Some(delay), _) => {
                // Validation allows pacing only on a lone packet meter.
                let max = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
                let gcra = packets.as_ref().map(|m| m.gcra).unwrap_or_default();
                let now = self.clock.monotonic_ns();
                judged_at.set(now);
                match acquire_delayed(&state.cells[0], &gcra, now, credits, max) {
                    Some(wait) => {
                        delay_ns = wait;
                        true
                    }
                    None => {
                        refused_by = Some(order::KEY_PACKETS as u8);
                        false
                    }
                }
            }
            (Algorithm::Gcra, None, Some(limit)) => {
                let now = self.judging_clock(&judged_at);
                let outcome = acquire(&state.cells[0], &limit.gcra, now, credits);
                if outcome != Outcome::Allowed {
                    refused_by = Some(order::KEY_PACKETS as u8);
                }
                outcome == Outcome::Allowed
            }
            _ => {
                let aggregate = &self.aggregates[index];
                // In `order`: the key's packets and bytes, the aggregate's.
                let aggregate_packets = self.aggregate_packets(index);
                let mut rates: [Option<&Rate>; order::METERS] = [None; order::METERS];
                rates[order::KEY_PACKETS] = packets;
                // A second packet limit takes the byte meter's place, as in the
                // kernel (validation keeps the two apart).
                rates[order::KEY_BYTES] = key_bytes;
                rates[order::AGGREGATE_PACKETS] = aggregate_packets.as_deref();
                rates[order::AGGREGATE_BYTES] =
                    rule.aggregate.as_ref().and_then(|a| a.bytes.as_ref());
                let second_counts_packets = rule.second_packets.is_some();
                let third_counts_bytes = rule.third.as_ref().is_some_and(|t| t.counts_bytes);
                let cost = |bytes: bool| if bytes { request.bytes } else { credits };
                let costs: [u64; order::METERS] = std::array::from_fn(|i| {
                    cost(
                        order::charges_bytes(i)
                            && !(i == order::KEY_BYTES && second_counts_packets),
                    )
                });
                let charges = Charges {
                    rates,
                    costs,
                    third: rule
                        .third
                        .as_ref()
                        .map(|t| (t.rate.gcra, cost(third_counts_bytes))),
                };
                let verdict = self.meter(rule, state, aggregate, &charges, &judged_at);
                by_aggregate =
                    verdict.outcome == Outcome::Denied && order::is_aggregate(verdict.refused_by);
                if verdict.outcome != Outcome::Allowed {
                    refused_by = Some(match verdict.refused_by {
                        order::KEY_THIRD => order::KEY_THIRD as u8,
                        i => i.min(order::METERS - 1) as u8,
                    });
                }
                if verdict.outcome == Outcome::Denied && rule.algorithm == Algorithm::Gcra {
                    refused_wait_ns = refused_wait_ns_of(
                        &charges,
                        verdict.refused_by,
                        (state, aggregate),
                        judged_at.get(),
                    );
                }
                verdict.outcome == Outcome::Allowed
            }
        };
        let now = judged_at.get();
        self.seen(index, state, now);
        // The soft meter, charged like the kernel's: only what the hard
        // limits admitted, never refusing.
        let over_soft = allowed
            && rule.soft.is_some_and(|soft| {
                rule.algorithm == Algorithm::Gcra
                    && acquire(&state.cells[2], &soft.gcra, now, credits) == Outcome::Denied
            });
        if over_soft {
            counters.over_soft.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(escalation) = rule.escalate {
            // Refused by its own meters, not by the rule's aggregate (a
            // flood elsewhere spending the shared budget is not its doing).
            if !allowed && refused_by.is_some_and(|i| !order::is_aggregate(usize::from(i))) {
                state
                    .cold()
                    .last_refused
                    .store(now.max(1), Ordering::Relaxed);
            }
            self.watch_escalation(rule, &escalation, state, counters, (request.client, now));
        }
        if by_aggregate {
            counters.aggregate_excess.fetch_add(1, Ordering::Relaxed);
        }
        let shadow = !allowed && rule.shadow;
        match (allowed, shadow) {
            (true, _) => counters.passed.add(1),
            (false, true) => counters.shadow.add(1),
            (false, false) => counters.dropped.add(1),
        };
        Decision {
            allowed: allowed || shadow,
            shadow,
            rule: Some(index),
            quota: packets.map(|m| self.quota_at(rule, m, state, (now, refused_wait_ns), credits)),
            delay_ns,
            in_flight: in_flight.filter(|_| allowed),
            too_many_in_flight: false,
            refused_by,
            over_soft,
            blocked_for_ns: 0,
        }
    }

    /// [`Limiter::decide`] for a plain rule
    /// ([`super::classify::is_plain`]): its one meter charged a request's
    /// one credit, what `decide` does for such a rule without asking of
    /// each feature whether the rule has it.
    /// The key's state is its request meter's cell and its last-seen
    /// cell (a [`State`]'s or a [`super::keys::Plain`]'s).
    #[inline(always)]
    pub(super) fn decide_plain(
        &self,
        index: usize,
        rule: &Rule,
        (tat, last_seen): (&AtomicU64, &AtomicU64),
    ) -> Decision {
        let [Some(limit), ..] = rule.key_meters() else {
            unreachable!("a plain rule has a request limit")
        };
        let judged_at = Cell::new(0);
        let allowed =
            acquire(tat, &limit.gcra, self.judging_clock(&judged_at), 1) == Outcome::Allowed;
        let now = judged_at.get();
        // A plain rule's key says itself when it rests ([`rest_ns`]).
        seen(last_seen, now, true);
        let counters = &self.counters[index];
        if allowed {
            counters.passed.add(1);
        } else {
            counters.dropped.add(1);
        }
        Decision {
            allowed,
            shadow: false,
            rule: Some(index),
            // A plain rule's meters are the first alone.
            quota: Some(QuotaAt::Gcra {
                tats: [AtomicCell::load(tat), 0, 0],
                now,
                cost: 1,
                refused_wait_ns: 0,
            }),
            delay_ns: 0,
            in_flight: None,
            too_many_in_flight: false,
            refused_by: (!allowed).then_some(order::KEY_PACKETS as u8),
            over_soft: false,
            blocked_for_ns: 0,
        }
    }
}
