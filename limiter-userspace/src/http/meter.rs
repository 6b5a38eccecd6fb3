//! Charging a request's meters with its rule's algorithm, all or none
//! (GCRA cells, windows, logs; the key's and the aggregate's), and how
//! long a refusing meter would take.

use std::{
    cell::Cell,
    sync::atomic::{AtomicU64, Ordering},
};

use limiter_common::{
    gcra::Gcra,
    log::Log,
    meter::{
        Charge, Outcome, Verdict, WindowCharge, acquire_all, acquire_all_after, order, windows_all,
    },
    window::WindowState,
};

use super::{limiter::Limiter, state::State};
use crate::rules::{Algorithm, Rate, Rule};

/// What a request (or a streamed body's chunk) is charged.
#[derive(Clone, Copy)]
pub(super) struct Charges<'a> {
    /// Each meter's limit, in [`order`] (borrowed: a request copies no
    /// limit).
    pub(super) rates: [Option<&'a Rate>; order::METERS],
    /// What each meter charges.
    pub(super) costs: [u64; order::METERS],
    /// The key's third limit (GCRA) and what it charges, if it does.
    pub(super) third: Option<(Gcra, u64)>,
}

/// The GCRA cell of meter `i` (in [`order`]): each state keeps its packet
/// meter, then its byte meter; the aggregate's meters are the rule's.
fn gcra_cell<'s>(i: usize, state: &'s State, aggregate: &'s State) -> &'s AtomicU64 {
    let state = if order::is_aggregate(i) {
        aggregate
    } else {
        state
    };
    &state.cells[usize::from(order::charges_bytes(i))]
}

/// How long until meter `refused_by` of `charges` (a GCRA meter other than
/// the key's requests: bytes, the aggregate, a third limit) would take the
/// request it refused at `now` (0 for the key's requests, which the
/// request's quota says itself): its `Retry-After`.
pub(super) fn refused_wait_ns_of(
    charges: &Charges<'_>,
    refused_by: usize,
    (state, aggregate): (&State, &State),
    now: u64,
) -> u64 {
    let refusing = match (refused_by, charges.third) {
        (order::KEY_THIRD, Some((gcra, cost))) => Some((&state.cells[2], gcra, cost)),
        (order::KEY_PACKETS, _) | (order::KEY_THIRD, None) => None,
        (i, _) => charges
            .rates
            .get(i)
            .copied()
            .flatten()
            .map(|m| (gcra_cell(i, state, aggregate), m.gcra, charges.costs[i])),
    };
    refusing.map_or(0, |(cell, gcra, cost)| {
        gcra.wait_ns(cell.load(Ordering::Acquire), now, cost)
    })
}

impl Limiter {
    /// The clock a GCRA verdict reads, as each meter is judged (after the
    /// key map's lock, and again after a lost compare-and-swap), noting in
    /// `judged_at` when it last did.
    pub(super) fn judging_clock<'a>(
        &'a self,
        judged_at: &'a Cell<u64>,
    ) -> impl Fn() -> u64 + Copy + 'a {
        move || {
            let now = self.clock.monotonic_ns();
            judged_at.set(now);
            now
        }
    }

    /// Charges what `charges` says with the rule's algorithm, all or
    /// none; whether allowed, and which meter refused.
    pub(super) fn meter(
        &self,
        rule: &Rule,
        state: &State,
        aggregate: &State,
        charges: &Charges<'_>,
        judged_at: &Cell<u64>,
    ) -> Verdict {
        let Charges {
            rates,
            costs,
            third,
        } = *charges;
        let pair = |i: usize| usize::from(order::charges_bytes(i));
        match rule.algorithm {
            Algorithm::SlidingLog => {
                let mut key_logs = state.logs().lock().expect("log lock");
                let mut agg_logs = aggregate.logs().lock().expect("log lock");
                // Read under the locks: a wait for them does not age it.
                let now = self.clock.epoch_ns();
                // Check every log on a copy first: a refusal charges none.
                let mut trial: [Log; order::METERS] = std::array::from_fn(|i| {
                    if order::is_aggregate(i) {
                        agg_logs[pair(i)].clone()
                    } else {
                        key_logs[pair(i)].clone()
                    }
                });
                let refused = (0..order::METERS).find(|&i| {
                    !rates[i]
                        .as_ref()
                        .is_none_or(|m| trial[i].admit(&m.window, now, costs[i]))
                });
                if refused.is_none() {
                    for (i, log) in trial.into_iter().enumerate() {
                        if order::is_aggregate(i) {
                            agg_logs[pair(i)] = log;
                        } else {
                            key_logs[pair(i)] = log;
                        }
                    }
                }
                judged_at.set(self.clock.monotonic_ns());
                Verdict {
                    outcome: if refused.is_none() {
                        Outcome::Allowed
                    } else {
                        Outcome::Denied
                    },
                    refused_by: refused.unwrap_or(order::METERS),
                }
            }
            Algorithm::Gcra => {
                let charges: [Charge<'_, AtomicU64>; order::METERS] = std::array::from_fn(|i| {
                    rates[i]
                        .as_ref()
                        .map(|m| (gcra_cell(i, state, aggregate), &m.gcra, costs[i]))
                });
                let now = self.judging_clock(judged_at);
                match third {
                    // In the key's third word, charged first as in the
                    // kernel (`acquire_all_after`).
                    Some((gcra, cost)) => {
                        acquire_all_after((&state.cells[2], &gcra, cost), now, charges, now)
                    }
                    None => acquire_all(charges, now),
                }
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let sliding = rule.algorithm == Algorithm::SlidingWindow;
                // Key first, then aggregate: the kernel's lock order.
                let mut key_windows = state.windows().lock().expect("window lock");
                let mut agg_windows = aggregate.windows().lock().expect("window lock");
                // Read under the locks: a wait for them does not age it.
                let now = self.clock.epoch_ns();
                let [k0, k1] = &mut *key_windows;
                let [a0, a1] = &mut *agg_windows;
                let mut states: [Option<&mut WindowState>; order::METERS] = Default::default();
                states[order::KEY_PACKETS] = Some(k0);
                states[order::KEY_BYTES] = Some(k1);
                states[order::AGGREGATE_PACKETS] = Some(a0);
                states[order::AGGREGATE_BYTES] = Some(a1);
                let windows = rates.map(|m| m.map(|m| m.window));
                let charges: [WindowCharge<'_>; order::METERS] = std::array::from_fn(|i| {
                    let state = states[i].take().expect("each state once");
                    windows[i].as_ref().map(|w| (state, w, costs[i]))
                });
                judged_at.set(self.clock.monotonic_ns());
                windows_all(charges, now, sliding)
            }
        }
    }
}
