//! What a response says of its key's quota: read from the state the
//! request left, in the terms of the rule's request limits.

use limiter_common::{log::Log, meter::AtomicCell, window::WindowState};

use super::{
    decision::{Decision, Quota, QuotaAt},
    limiter::Limiter,
    state::State,
};
use crate::rules::{Algorithm, Rate, Rule};

impl Limiter {
    /// Quota, remaining and timing of the request meter of the key an
    /// decision judged, for the response's fields.
    pub fn quota(&self, decision: &Decision) -> Option<Quota> {
        match decision.quota? {
            QuotaAt::Ready(quota) => Some(quota),
            QuotaAt::Gcra {
                tats,
                now,
                cost,
                refused_wait_ns,
            } => {
                let rule = &self.rules.rules[decision.rule?];
                let quota = |meter: Rate, tat: u64| {
                    let g = meter.gcra;
                    let used = tat.saturating_sub(now).min(g.capacity_ns);
                    Quota {
                        quota: meter.rate,
                        window_secs: meter.period.as_secs().max(1),
                        remaining: g.remaining(tat, now),
                        reset_secs: secs(used),
                        retry_after_secs: secs(g.wait_ns(tat, now, cost)),
                    }
                };
                let first = quota(rule.packet_rate()?, tats[0]);
                let first = match rule.second_packets {
                    Some(second) => first.and(quota(second, tats[1])),
                    None => first,
                };
                // A third limit in bytes says nothing of requests.
                let mut quota = match rule.third {
                    Some(third) if !third.counts_bytes => first.and(quota(third.rate, tats[2])),
                    _ => first,
                };
                quota.retry_after_secs = quota.retry_after_secs.max(secs(refused_wait_ns));
                Some(quota)
            }
        }
    }

    /// What is left of the request meter of the key a decision judged,
    /// and the budget's whole size (the burst, or the window's limit).
    pub fn budget(&self, decision: &Decision) -> Option<(u64, u64)> {
        let quota = self.quota(decision)?;
        let rule = &self.rules.rules[decision.rule?];
        let meter = rule.packet_rate()?;
        let of = match rule.algorithm {
            Algorithm::Gcra => meter.gcra.burst,
            _ => meter.window.limit,
        };
        Some((quota.remaining, of))
    }

    /// A key's request meter as it stands, for [`Limiter::quota`].
    /// `cost`: what the request cost (its credits), for when one of that
    /// cost would conform.
    pub(super) fn quota_at(
        &self,
        rule: &Rule,
        meter: &Rate,
        state: &State,
        // When the request was judged, and how long until the meter that
        // refused it (if not the key's requests) would take it.
        (monotonic, refused_wait_ns): (u64, u64),
        cost: u64,
    ) -> QuotaAt {
        match rule.algorithm {
            Algorithm::Gcra => QuotaAt::Gcra {
                tats: std::array::from_fn(|i| AtomicCell::load(&state.cells[i])),
                now: monotonic,
                cost,
                refused_wait_ns,
            },
            Algorithm::SlidingLog => {
                let now = self.clock.epoch_ns();
                let logs = state.logs().lock().expect("log lock");
                let quota = |meter: &Rate, log: &Log| {
                    let w = meter.window;
                    let reset = log
                        .oldest()
                        .map_or(0, |t| t.saturating_add(w.length_ns).saturating_sub(now));
                    Quota {
                        quota: meter.rate,
                        window_secs: meter.period.as_secs().max(1),
                        remaining: w.limit.saturating_sub(log.total()),
                        reset_secs: secs(reset),
                        retry_after_secs: if log.total().saturating_add(cost) <= w.limit {
                            0
                        } else {
                            secs(reset)
                        },
                    }
                };
                let first = quota(meter, &logs[0]);
                QuotaAt::Ready(match &rule.second_packets {
                    Some(second) => first.and(quota(second, &logs[1])),
                    None => first,
                })
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                let now = self.clock.epoch_ns();
                let windows = *state.windows().lock().expect("window lock");
                let sliding = rule.algorithm == Algorithm::SlidingWindow;
                let quota = |meter: &Rate, s: &WindowState| {
                    let w = meter.window;
                    let used = w.used(s, now, sliding);
                    let reset = w.reset_ns(s, now);
                    Quota {
                        quota: meter.rate,
                        window_secs: meter.period.as_secs().max(1),
                        remaining: w.limit.saturating_sub(used),
                        reset_secs: secs(reset),
                        retry_after_secs: if used.saturating_add(cost) <= w.limit {
                            0
                        } else {
                            secs(reset)
                        },
                    }
                };
                let first = quota(meter, &windows[0]);
                QuotaAt::Ready(match &rule.second_packets {
                    Some(second) => first.and(quota(second, &windows[1])),
                    None => first,
                })
            }
        }
    }
}

impl Quota {
    /// What a client may do under two limits at once: the first's policy,
    /// what both leave, the later of their resets and waits.
    fn and(self, other: Quota) -> Quota {
        Quota {
            remaining: self.remaining.min(other.remaining),
            reset_secs: self.reset_secs.max(other.reset_secs),
            retry_after_secs: self.retry_after_secs.max(other.retry_after_secs),
            ..self
        }
    }
}

/// Nanoseconds in whole seconds, rounded up.
fn secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000)
}
