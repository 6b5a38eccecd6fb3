//! A streaming body of unknown size, charged to its key's byte limits as
//! it streams.

use std::{
    cell::Cell,
    sync::{Arc, atomic::Ordering},
};

use limiter_common::meter::{Outcome, order};

use super::{
    decision::{RequestMeta, ipv4_mapped},
    limiter::Limiter,
    meter::Charges,
    state::State,
};
use crate::rules::{Algorithm, Limit, Rate};

/// The byte meters of an admitted request whose size was unknown when it
/// was admitted (a chunked upload, no `Content-Length`): its body is
/// charged as it streams ([`Limiter::charge_body`]).
#[derive(Clone)]
pub struct BodyMeter {
    pub(super) index: usize,
    pub(super) state: Arc<State>,
    /// The most one charge may be (see [`crate::http::BodyCharge::max_cost`]).
    pub(super) max_cost: u64,
}

impl Limiter {
    /// The byte meters that will charge `request`'s body as it streams, if
    /// its rule limits bytes (see [`BodyMeter`]).
    pub fn body_meter(&self, request: &RequestMeta<'_>) -> Option<BodyMeter> {
        if let Some(request) = ipv4_mapped(request) {
            return self.body_meter(&request);
        }
        let index = self.rule_of(request)?;
        let rule = &self.rules.rules[index];
        let Limit::Metered { bytes, .. } = rule.limit else {
            return None;
        };
        let aggregate_bytes = rule.aggregate.and_then(|a| a.bytes);
        if (bytes.is_none() && aggregate_bytes.is_none()) || rule.delay.is_some() {
            return None;
        }
        let key = self.state_key(index, rule, request);
        let clock = &self.clock;
        let state = self.keys.with(
            key,
            || clock.monotonic_ns(),
            &self.rest_ns,
            |state| {
                self.seen(index, state, clock.monotonic_ns());
                Some(Arc::clone(state))
            },
            || None,
        )?;
        // A third limit in bytes is charged the body too.
        let third_bytes = rule.third.filter(|t| t.counts_bytes).map(|t| t.rate);
        let max_cost = [bytes, aggregate_bytes, third_bytes]
            .into_iter()
            .flatten()
            .map(|m| match rule.algorithm {
                Algorithm::Gcra => m.burst,
                _ => m.window.limit,
            })
            .min()
            .unwrap_or(u64::MAX);
        Some(BodyMeter {
            index,
            state,
            max_cost,
        })
    }

    /// Charges `n` more bytes of a streaming body to its key's and its
    /// rule's byte limits, all or none: `false` when they refuse.
    pub fn charge_body(&self, meter: &BodyMeter, n: u64) -> bool {
        let rule = &self.rules.rules[meter.index];
        let Limit::Metered { bytes, .. } = rule.limit else {
            return true;
        };
        let mut rates: [Option<&Rate>; order::METERS] = [None; order::METERS];
        rates[order::KEY_BYTES] = bytes.as_ref();
        rates[order::AGGREGATE_BYTES] = rule.aggregate.as_ref().and_then(|a| a.bytes.as_ref());
        let aggregate = &self.aggregates[meter.index];
        let judged_at = Cell::new(0);
        // The third limit only if it counts bytes.
        let third = rule
            .third
            .filter(|t| t.counts_bytes)
            .map(|t| (t.rate.gcra, n));
        let charges = Charges {
            rates,
            costs: [n; order::METERS],
            third,
        };
        let verdict = self.meter(rule, &meter.state, aggregate, &charges, &judged_at);
        // A long upload keeps its key recent: evicting it would hand the
        // client a fresh budget.
        self.seen(meter.index, &meter.state, judged_at.get());
        verdict.outcome == Outcome::Allowed
    }

    /// Counts a streaming body refused by [`Limiter::charge_body`] (once a
    /// body: `first`); whether it goes on anyway (a dry run).
    pub fn count_body_over_limit(&self, meter: &BodyMeter, first: bool) -> bool {
        let rule = &self.rules.rules[meter.index];
        if first {
            let counters = &self.counters[meter.index];
            let counter = if rule.shadow {
                &counters.shadow_bodies
            } else {
                &counters.bodies_cut
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        rule.shadow
    }
}
