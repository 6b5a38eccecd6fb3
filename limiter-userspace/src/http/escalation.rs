//! Escalation at layer 7: a key that stays over its limit is blocked for
//! a while, as the daemon blocks kernel keys.

use std::{net::IpAddr, sync::atomic::Ordering, time::Duration};

use limiter_common::{escalation::Escalation, gcra::Check};

use super::{counters::HttpCounters, limiter::Limiter, state::State};
use crate::rules::{Algorithm, Rule};

impl Limiter {
    /// Escalation's look at a key, after one of its requests was judged
    /// (`limiter_common::escalation`, as the daemon's at kernel keys): over
    /// its limit when its next request would be refused.
    pub(super) fn watch_escalation(
        &self,
        rule: &Rule,
        escalation: &Escalation,
        state: &State,
        counters: &HttpCounters,
        // The request's client (what the log names: a key of a header's
        // value may be a secret) and when it was judged.
        (client, now): (IpAddr, u64),
    ) {
        // The key's meters in the words of its state (none: unlimited).
        let meters = rule.key_meters();
        let over = match rule.algorithm {
            Algorithm::Gcra => meters.iter().zip(&state.cells).any(|(meter, cell)| {
                meter.is_some_and(|m| {
                    m.gcra.check(cell.load(Ordering::Acquire), now, 1) == Check::Deny
                })
            }),
            Algorithm::SlidingLog => {
                let now = self.clock.epoch_ns();
                let mut logs = state.logs().lock().expect("log lock").clone();
                meters
                    .iter()
                    .zip(logs.iter_mut())
                    .any(|(meter, log)| meter.is_some_and(|m| !log.admit(&m.window, now, 1)))
            }
            algorithm => {
                let now = self.clock.epoch_ns();
                let windows = *state.windows().lock().expect("window lock");
                let sliding = algorithm == Algorithm::SlidingWindow;
                meters.iter().zip(&windows).any(|(meter, w)| {
                    meter.is_some_and(|m| m.window.check(w, now, 1, sliding).is_none())
                })
            }
        };
        // Over, as the daemon looks once a second: refused within the last
        // second, or refusing the next request now.
        // A key neither refused (which would have made its cold part) nor
        // over now has no watch to keep or end: not made for it.
        let cold = match state.cold.get() {
            Some(cold) => cold,
            None if !over => return,
            None => state.cold(),
        };
        let last_refused = cold.last_refused.load(Ordering::Relaxed);
        let over = over || (last_refused != 0 && now.saturating_sub(last_refused) < 1_000_000_000);
        let (since, block) = escalation.observe(cold.over_since.load(Ordering::Relaxed), over, now);
        cold.over_since.store(since, Ordering::Relaxed);
        if block {
            // Under a dry run too: its requests are then counted as
            // shadow-dropped (`excess`) and passed, until the block ends.
            counters.escalations.fetch_add(1, Ordering::Relaxed);
            let block = Duration::from_nanos(escalation.block_ns);
            tracing::warn!(
                event = "escalated",
                layer = "http",
                rule = %rule.name,
                %client,
                for_secs = block.as_secs_f64(),
                enforced = !rule.shadow,
                "a key of rule {:?} (client {client}) stayed over its limit: {} for {}",
                rule.name,
                if rule.shadow { "would be blocked (dry run)" } else { "blocked" },
                humantime::format_duration(block)
            );
            state
                .blocked_until
                .store(now.saturating_add(escalation.block_ns), Ordering::Relaxed);
        }
    }
}
