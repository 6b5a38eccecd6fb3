//! A slow, obviously correct model of the three algorithms, written apart
//! from `limiter-common` and in other terms: exact 128-bit arithmetic,
//! GCRA as a continuous-state leaky bucket (level and last conformance
//! time, not a theoretical arrival time), windows as a table of counts per
//! window number. The conformance tests hold every implementation to it.

use std::collections::HashMap;

/// Which algorithm a trace exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Gcra,
    FixedWindow,
    SlidingWindow,
    SlidingLog,
}

/// A limit: `rate` per `period_ns` with `burst` (GCRA only).
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub algo: Algo,
    pub rate: u64,
    pub period_ns: u64,
    pub burst: u64,
    /// Costs are bytes (a byte limit) rather than 1 per request.
    pub bytes: bool,
}

impl Spec {
    /// A rule file with one rule, `trace`, expressing this limit; `extra`
    /// goes first inside the rule (a match, a key).
    pub fn rule_file(&self, extra: &str) -> String {
        let algorithm = match self.algo {
            Algo::Gcra => "gcra",
            Algo::FixedWindow => "fixed_window",
            Algo::SlidingWindow => "sliding_window",
            Algo::SlidingLog => "sliding_log",
        };
        let (rate, burst) = if self.bytes {
            ("bytes", "burst_bytes")
        } else {
            ("rate", "burst")
        };
        let burst = if self.algo == Algo::Gcra {
            format!(", {burst}: {}", self.burst)
        } else {
            String::new()
        };
        format!(
            "rules:\n  - {{ name: trace, {extra}algorithm: {algorithm}, limit: {{ {rate}: {}, unit: {}ns{burst} }} }}\n",
            self.rate, self.period_ns
        )
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    /// The clock: monotonic ns for GCRA, Unix-epoch ns for windows.
    pub t: u64,
    pub key: u8,
    pub cost: u64,
}

#[derive(Clone, Debug)]
pub struct Trace {
    pub name: String,
    pub spec: Spec,
    pub arrivals: Vec<Arrival>,
}

/// The verdict for every arrival of a trace.
pub fn verdicts(trace: &Trace) -> Vec<bool> {
    let spec = trace.spec;
    let mut buckets: HashMap<u8, Bucket> = HashMap::new();
    let mut windows: HashMap<u8, Windows> = HashMap::new();
    let mut logs: HashMap<u8, Vec<(u64, u64)>> = HashMap::new();
    trace
        .arrivals
        .iter()
        .map(|a| match spec.algo {
            Algo::Gcra => buckets.entry(a.key).or_default().offer(&spec, a),
            Algo::SlidingLog => offer_log(logs.entry(a.key).or_default(), &spec, a),
            _ => windows.entry(a.key).or_default().offer(&spec, a),
        })
        .collect()
}

/// GCRA as a leaky bucket: `level` ns of work queued as of `last`.
#[derive(Default)]
struct Bucket {
    level: i128,
    last: Option<i128>,
}

impl Bucket {
    fn offer(&mut self, spec: &Spec, a: &Arrival) -> bool {
        let rate = i128::from(spec.rate);
        let period = i128::from(spec.period_ns);
        // One unit of cost is worth T = ceil(U / R) ns; the bucket holds B·T.
        let t_unit = (period + rate - 1) / rate;
        let capacity = i128::from(spec.burst) * t_unit;
        let now = i128::from(a.t);
        // Drained since the last conformance; a clock that went backwards
        // fills it instead, but never past full.
        let level = match self.last {
            None => 0,
            Some(last) => (self.level - (now - last)).clamp(0, capacity),
        };
        let charge = i128::from(a.cost) * t_unit;
        // Conforms if it fits; and the time it would be done by must be a
        // representable (u64) time, as the state is kept in u64 ns.
        if level + charge > capacity || now + level + charge > i128::from(u64::MAX) {
            return false;
        }
        self.level = level + charge;
        self.last = Some(now);
        true
    }
}

/// The exact sliding window over every admitted (time, cost) of a key: the
/// costs within `(now − U, now]` plus this one must stay within `R`. A
/// request from before the newest admitted one is judged, and recorded, at
/// that newest time.
fn offer_log(admitted: &mut Vec<(u64, u64)>, spec: &Spec, a: &Arrival) -> bool {
    let newest = admitted.iter().map(|e| e.0).max().unwrap_or(0);
    let now = i128::from(a.t.max(newest));
    let in_window: i128 = admitted
        .iter()
        .filter(|(t, _)| i128::from(*t) > now - i128::from(spec.period_ns))
        .map(|(_, c)| i128::from(*c))
        .sum();
    if in_window + i128::from(a.cost) > i128::from(spec.rate) {
        return false;
    }
    if a.cost > 0 {
        admitted.push((now as u64, a.cost));
    }
    true
}

/// Admitted cost per window number, and the newest window admitted into.
#[derive(Default)]
struct Windows {
    counts: HashMap<u128, u128>,
    newest: Option<u128>,
}

impl Windows {
    fn offer(&mut self, spec: &Spec, a: &Arrival) -> bool {
        let length = u128::from(spec.period_ns);
        let limit = u128::from(spec.rate);
        let cost = u128::from(a.cost);
        let t = u128::from(a.t);
        // A request from before the newest window (the clock went back)
        // counts in the newest window, at its first instant.
        let window = (t / length).max(self.newest.unwrap_or(0));
        let elapsed = t.saturating_sub(window * length).min(length);
        let current = self.counts.get(&window).copied().unwrap_or(0);
        let allowed = match spec.algo {
            Algo::FixedWindow => current + cost <= limit,
            Algo::SlidingWindow => {
                let previous = window
                    .checked_sub(1)
                    .and_then(|w| self.counts.get(&w))
                    .copied()
                    .unwrap_or(0);
                // previous × (U − elapsed) / U + current + cost ≤ R, times U.
                previous * (length - elapsed) + (current + cost) * length <= limit * length
            }
            Algo::Gcra | Algo::SlidingLog => unreachable!("windows only"),
        };
        if allowed {
            *self.counts.entry(window).or_default() += cost;
            self.newest = Some(window);
        }
        allowed
    }
}
