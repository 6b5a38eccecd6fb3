//! A slow, obviously correct model of the algorithms, written apart from
//! `limiter-common` and in other terms: exact 128-bit arithmetic, GCRA as
//! a continuous-state leaky bucket (level and last conformance time, not a
//! theoretical arrival time), windows as a table of counts per window
//! number, the sliding log as a list of admissions. A request is admitted
//! only if every meter of the rule admits it, and then charged to all of
//! them; a refused request is charged to none. An admitted request is then
//! offered to the key's soft meter, if the rule has one: it is over the
//! soft limit when that meter would refuse it (and then charges it
//! nothing), admitted all the same. The conformance tests hold every
//! implementation to it.

use std::collections::HashMap;

/// Which algorithm a trace exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Gcra,
    FixedWindow,
    SlidingWindow,
    SlidingLog,
}

/// One meter: `rate` units per the limit's period, with `burst` (GCRA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meter {
    pub rate: u64,
    pub burst: u64,
}

/// The limits of one scope (a key, or the rule's aggregate), as a rule file
/// writes them: one period, a meter on requests (each costs 1) and/or a
/// meter on the requests' costs (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    pub period_ns: u64,
    pub requests: Option<Meter>,
    pub bytes: Option<Meter>,
}

impl Limit {
    fn yaml(&self, algo: Algo) -> String {
        let mut fields = Vec::new();
        if let Some(m) = self.requests {
            fields.push(format!("rate: {}", m.rate));
            if algo == Algo::Gcra {
                fields.push(format!("burst: {}", m.burst));
            }
        }
        if let Some(m) = self.bytes {
            fields.push(format!("bytes: {}", m.rate));
            if algo == Algo::Gcra {
                fields.push(format!("burst_bytes: {}", m.burst));
            }
        }
        fields.push(format!("unit: {}ns", self.period_ns));
        format!("{{ {} }}", fields.join(", "))
    }

    /// (meter, charges bytes) for each meter present, requests first.
    pub(crate) fn meters(self) -> impl Iterator<Item = (Meter, bool)> {
        let requests = self.requests.map(|m| (m, false));
        let bytes = self.bytes.map(|m| (m, true));
        requests.into_iter().chain(bytes)
    }
}

/// A rule: per-key limits, and optionally limits on all keys together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    pub algo: Algo,
    pub limit: Limit,
    pub aggregate: Option<Limit>,
    /// A second per-key limit on requests, with a period of its own
    /// (`limits: [limit, second]`); `limit` then has no byte meter.
    pub second: Option<Limit>,
    /// A third per-key limit, on requests or bytes, with a period of its
    /// own (`limits: [limit, third]`, `limit` holding both a request and a
    /// byte meter, or `limits: [limit, second, third]`; GCRA only).
    pub third: Option<Limit>,
    /// Credits of the costly class (`cost: [...]`), if the rule has one:
    /// a costly arrival charges every request meter this many instead of
    /// 1. The kernel's class is a TCP SYN, layer 7's a POST.
    pub costly: Option<u64>,
    /// A soft limit per key (`soft:`), a request meter alone (GCRA; the
    /// rule file allows it on GCRA rules with a request limit, without a
    /// third limit): what the other meters admitted is charged to it, its
    /// credits as every request meter; what it would refuse is admitted
    /// all the same, and counted over it.
    pub soft: Option<Limit>,
    /// `escalate: { after, block }` (scope `key`): a key over its limit
    /// at every look for `after` is held for `block`. [`judge`] leaves it
    /// out (it knows no looks); `escalation::judge` decides it.
    pub escalate: Option<Escalate>,
    /// `action: shadow`, the rule's dry run: every packet passes, what
    /// the meters refuse is counted (as shadow) and charged nothing, and
    /// escalation holds no key. The meters' verdicts ([`judge`]) are the
    /// same.
    pub shadow: bool,
}

/// A rule's `escalate: { after, block }`, in ns (scope `key`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Escalate {
    pub after_ns: u64,
    pub block_ns: u64,
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
        let aggregate = self
            .aggregate
            .map(|a| format!(", aggregate: {}", a.yaml(self.algo)))
            .unwrap_or_default();
        let limit = match (self.second, self.third) {
            (None, None) => format!("limit: {}", self.limit.yaml(self.algo)),
            (second, third) => {
                let limits: Vec<String> = [Some(self.limit), second, third]
                    .into_iter()
                    .flatten()
                    .map(|l| l.yaml(self.algo))
                    .collect();
                format!("limits: [ {} ]", limits.join(", "))
            }
        };
        let soft = self
            .soft
            .map(|s| format!(", soft: {}", s.yaml(Algo::Gcra)))
            .unwrap_or_default();
        let escalate = self
            .escalate
            .map(|e| {
                format!(
                    ", escalate: {{ after: {}ns, block: {}ns }}",
                    e.after_ns, e.block_ns
                )
            })
            .unwrap_or_default();
        let action = if self.shadow { ", action: shadow" } else { "" };
        format!(
            "rules:\n  - {{ name: trace, {extra}algorithm: {algorithm}, {limit}{aggregate}{soft}{escalate}{action} }}\n"
        )
    }

    /// The rule file's `cost` field for the kernel (a SYN is costly), to
    /// go in `rule_file`'s `extra`; empty without one.
    pub fn kernel_cost(&self) -> String {
        self.costly.map_or(String::new(), |n| {
            format!("cost: [ {{ match: {{ tcp_flags: syn }}, credits: {n} }} ], ")
        })
    }

    /// The same for layer 7 (a POST is costly).
    pub fn http_cost(&self) -> String {
        self.costly.map_or(String::new(), |n| {
            format!("cost: [ {{ match: {{ method: POST }}, credits: {n} }} ], ")
        })
    }

    /// What arrival `a` charges each request meter.
    pub fn credits(&self, a: &Arrival) -> u64 {
        match self.costly {
            Some(n) if a.costly => n,
            _ => 1,
        }
    }

    /// The rule's only meter, `(period_ns, meter, charges bytes)`, when it
    /// has exactly one (what peers with a single limit can express).
    pub fn single(&self) -> Option<(u64, Meter, bool)> {
        if self.costly.is_some() {
            return None;
        }
        let mut meters = self.limit.meters();
        match (
            meters.next(),
            meters.next(),
            self.aggregate,
            self.second,
            self.third,
        ) {
            (Some((meter, bytes)), None, None, None, None) => {
                Some((self.limit.period_ns, meter, bytes))
            }
            _ => None,
        }
    }

    /// Whether any meter charges the request's cost (bytes).
    pub fn charges_bytes(&self) -> bool {
        [Some(self.limit), self.aggregate, self.third]
            .iter()
            .flatten()
            .any(|l| l.bytes.is_some())
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    /// The clock: monotonic ns for GCRA, Unix-epoch ns for windows.
    pub t: u64,
    pub key: u8,
    /// Charged to byte meters; request meters charge 1, or the costly
    /// class's credits (`Spec::costly`).
    pub cost: u64,
    /// In the rule's costly class (a SYN, a POST).
    pub costly: bool,
}

/// The rule's limits replaced at time `t`, before arrival `at` (same
/// algorithm, match and key; for windows, the same unit): every meter's
/// state is carried over. GCRA: the level of the bucket at `t` (at most its
/// capacity) scaled by the new capacity over the old one, rounded up (the
/// same fraction of the burst in use); windows and logs keep their
/// counts. A meter in force on one side only starts, or
/// stays, as it is; so does a key's soft meter (a reload keeps it as it
/// is, whatever its limit becomes).
#[derive(Clone, Copy, Debug)]
pub struct LimitChange {
    pub at: usize,
    pub t: u64,
    pub spec: Spec,
}

#[derive(Clone, Debug)]
pub struct Trace {
    pub name: String,
    pub spec: Spec,
    pub arrivals: Vec<Arrival>,
    /// In arrival order.
    pub changes: Vec<LimitChange>,
}

impl Trace {
    /// The rule in force at arrival `i`.
    pub fn spec_at(&self, i: usize) -> Spec {
        self.changes
            .iter()
            .take_while(|c| c.at <= i)
            .last()
            .map_or(self.spec, |c| c.spec)
    }
}

/// The aggregate's meters are kept under this key.
const AGGREGATE: Option<u8> = None;

/// A scope's meters: its requests, its bytes, and (a key's) the second
/// limit on requests and the third limit.
const REQUESTS: u8 = 0;
const BYTES: u8 = 1;
const SECOND: u8 = 2;
const THIRD: u8 = 3;
/// A key's soft meter.
const SOFT: u8 = 4;

/// The verdict for every arrival of a trace.
pub fn verdicts(trace: &Trace) -> Vec<bool> {
    judge(trace).admitted
}

/// For every arrival of a trace, whether it was admitted over the rule's
/// soft limit (never for a refused one, nor under a rule without one).
pub fn over_soft(trace: &Trace) -> Vec<bool> {
    judge(trace).over_soft
}

/// What the model says of each arrival of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Judged {
    /// Admitted (passed) or refused.
    pub admitted: Vec<bool>,
    /// Admitted over the soft limit: passed, and counted.
    pub over_soft: Vec<bool>,
}

/// Both verdicts of every arrival of a trace.
pub fn judge(trace: &Trace) -> Judged {
    // State per (scope, meter).
    let mut states: HashMap<(Option<u8>, u8), State> = HashMap::new();
    let mut spec = trace.spec;
    let mut changes = trace.changes.iter().peekable();
    let (admitted, over_soft) = trace
        .arrivals
        .iter()
        .enumerate()
        .map(|(i, a)| {
            while let Some(change) = changes.next_if(|c| c.at <= i) {
                carry(&mut states, &spec, &change.spec, change.t);
                spec = change.spec;
            }
            let scopes = [(Some(a.key), Some(spec.limit)), (AGGREGATE, spec.aggregate)];
            let credits = spec.credits(a);
            let algo = spec.algo;
            let mut charges: Vec<_> = scopes
                .iter()
                .filter_map(|&(scope, limit)| Some((scope, limit?)))
                .flat_map(|(scope, limit)| {
                    limit.meters().map(move |(meter, bytes)| {
                        let cost = if bytes { a.cost } else { credits };
                        let kind = if bytes { BYTES } else { REQUESTS };
                        ((scope, kind), limit.period_ns, meter, cost)
                    })
                })
                .collect();
            if let Some(second) = spec.second
                && let Some(meter) = second.requests
            {
                charges.push(((Some(a.key), SECOND), second.period_ns, meter, credits));
            }
            if let Some(third) = spec.third {
                for (meter, bytes) in third.meters() {
                    let cost = if bytes { a.cost } else { credits };
                    charges.push(((Some(a.key), THIRD), third.period_ns, meter, cost));
                }
            }
            let next: Option<Vec<State>> = charges
                .iter()
                .map(|&(id, period_ns, meter, cost)| {
                    states
                        .entry(id)
                        .or_insert_with(|| State::new(algo))
                        .offer(&meter, period_ns, a.t, cost)
                })
                .collect();
            let Some(next) = next else {
                // Refused: charged nothing, the soft meter included.
                return (false, false);
            };
            for ((id, ..), state) in charges.iter().zip(next) {
                states.insert(*id, state);
            }
            // Admitted: offered to the soft meter, charged its credits if
            // it conforms, over the soft limit (and charged nothing) if not.
            let over = spec.soft.is_some_and(|soft| {
                let meter = soft.requests.expect("a soft limit is a request rate");
                let state = states
                    .entry((Some(a.key), SOFT))
                    .or_insert_with(|| State::new(Algo::Gcra));
                match state.offer(&meter, soft.period_ns, a.t, credits) {
                    Some(next) => {
                        *state = next;
                        false
                    }
                    None => true,
                }
            });
            (true, over)
        })
        .unzip();
    Judged {
        admitted,
        over_soft,
    }
}

/// A scope's meter of `spec` that charges bytes (or requests): (period,
/// meter). The soft meter is none: a reload keeps it as it is.
fn meter_of(spec: &Spec, scope: Option<u8>, kind: u8) -> Option<(u64, Meter)> {
    let limit = match (scope, kind) {
        (AGGREGATE, SECOND | THIRD) | (_, SOFT) => return None,
        (_, SECOND) => spec.second?,
        (_, THIRD) => {
            let third = spec.third?;
            let meter = third.requests.or(third.bytes)?;
            return Some((third.period_ns, meter));
        }
        (AGGREGATE, _) => spec.aggregate?,
        _ => spec.limit,
    };
    let meter = if kind == BYTES {
        limit.bytes
    } else {
        limit.requests
    };
    meter.map(|m| (limit.period_ns, m))
}

/// Carries every bucket from `old`'s meters to `new`'s at `t`.
fn carry(states: &mut HashMap<(Option<u8>, u8), State>, old: &Spec, new: &Spec, t: u64) {
    for (&(scope, kind), state) in states.iter_mut() {
        let (Some(from), Some(to), State::Bucket(bucket)) = (
            meter_of(old, scope, kind),
            meter_of(new, scope, kind),
            &*state,
        ) else {
            continue;
        };
        *state = State::Bucket(bucket.carried(from, to, t));
    }
}

/// One meter's state; `offer` returns the state after admitting a request,
/// or `None` when the meter refuses it.
#[derive(Clone, Debug)]
enum State {
    Bucket(Bucket),
    Windows(Windows),
    Log(Vec<(u64, u64)>),
}

impl State {
    fn new(algo: Algo) -> Self {
        match algo {
            Algo::Gcra => Self::Bucket(Bucket::default()),
            Algo::SlidingLog => Self::Log(Vec::new()),
            Algo::FixedWindow | Algo::SlidingWindow => Self::Windows(Windows {
                sliding: algo == Algo::SlidingWindow,
                ..Windows::default()
            }),
        }
    }

    fn offer(&self, meter: &Meter, period_ns: u64, t: u64, cost: u64) -> Option<Self> {
        match self {
            Self::Bucket(b) => b.offer(meter, period_ns, t, cost).map(Self::Bucket),
            Self::Windows(w) => w.offer(meter.rate, period_ns, t, cost).map(Self::Windows),
            Self::Log(l) => offer_log(l, meter.rate, period_ns, t, cost).map(Self::Log),
        }
    }
}

/// GCRA as a leaky bucket: `level` ns of work queued as of `last`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bucket {
    level: i128,
    last: Option<i128>,
}

impl Bucket {
    /// `B·T` in ns of the meter (`T` rounded up).
    pub(crate) fn capacity((period_ns, meter): (u64, Meter)) -> i128 {
        let rate = i128::from(meter.rate);
        i128::from(meter.burst) * ((i128::from(period_ns) + rate - 1) / rate)
    }

    /// The bucket under new limits at `t`: its level then, scaled by the
    /// capacities, rounded up.
    fn carried(&self, from: (u64, Meter), to: (u64, Meter), t: u64) -> Self {
        let Some(last) = self.last else {
            return self.clone();
        };
        let now = i128::from(t);
        let (old, new) = (Self::capacity(from), Self::capacity(to));
        // More than the whole burst (a clock that went back) counts as the
        // whole burst.
        let level = (self.level - (now - last)).clamp(0, old);
        Self {
            level: (level * new + old - 1) / old,
            last: Some(now),
        }
    }

    /// The work still queued at `t`: what the bucket holds, drained from
    /// its last conformance to `t`.
    pub(crate) fn level_at(&self, t: u64) -> i128 {
        self.last
            .map_or(0, |last| (self.level - (i128::from(t) - last)).max(0))
    }

    /// The bucket topped up at `t` to hold at least `level` ns of work
    /// (what it holds already, if more).
    pub(crate) fn filled(&self, t: u64, level: i128) -> Self {
        Self {
            level: self.level_at(t).max(level),
            last: Some(i128::from(t)),
        }
    }

    pub(crate) fn offer(&self, meter: &Meter, period_ns: u64, t: u64, cost: u64) -> Option<Self> {
        let rate = i128::from(meter.rate);
        let period = i128::from(period_ns);
        // One unit of cost is worth T = ceil(U / R) ns; the bucket holds B·T.
        let t_unit = (period + rate - 1) / rate;
        let capacity = i128::from(meter.burst) * t_unit;
        let now = i128::from(t);
        // Drained since the last conformance. A clock that went backwards
        // drains nothing: the work queued stays queued until the clock
        // passes the time it would be done by (the bucket is honoured as
        // written, never refilled by a jump).
        let level = match self.last {
            None => 0,
            Some(last) => (self.level - (now - last)).max(0),
        };
        let charge = i128::from(cost) * t_unit;
        // Conforms if it fits; and the time it would be done by must be a
        // representable (u64) time, as the state is kept in u64 ns.
        if level + charge > capacity || now + level + charge > i128::from(u64::MAX) {
            return None;
        }
        Some(Self {
            level: level + charge,
            last: Some(now),
        })
    }
}

/// The exact sliding window over every admitted (time, cost) of a key: the
/// costs within `(now − U, now]` plus this one must stay within `R`. A
/// request from before the newest admitted one is judged, and recorded, at
/// that newest time.
fn offer_log(
    admitted: &[(u64, u64)],
    limit: u64,
    period_ns: u64,
    t: u64,
    cost: u64,
) -> Option<Vec<(u64, u64)>> {
    let newest = admitted.iter().map(|e| e.0).max().unwrap_or(0);
    let now = i128::from(t.max(newest));
    let in_window: i128 = admitted
        .iter()
        .filter(|(t, _)| i128::from(*t) > now - i128::from(period_ns))
        .map(|(_, c)| i128::from(*c))
        .sum();
    if in_window + i128::from(cost) > i128::from(limit) {
        return None;
    }
    let mut next = admitted.to_vec();
    if cost > 0 {
        next.push((now as u64, cost));
    }
    Some(next)
}

/// Admitted cost per window number, and the newest window admitted into.
#[derive(Clone, Debug, Default)]
struct Windows {
    sliding: bool,
    counts: HashMap<u128, u128>,
    newest: Option<u128>,
}

impl Windows {
    fn offer(&self, limit: u64, period_ns: u64, t: u64, cost: u64) -> Option<Self> {
        let length = u128::from(period_ns);
        let limit = u128::from(limit);
        let cost = u128::from(cost);
        let t = u128::from(t);
        // A request from before the newest window (the clock went back)
        // counts in the newest window, at its first instant.
        let window = (t / length).max(self.newest.unwrap_or(0));
        let elapsed = t.saturating_sub(window * length).min(length);
        let current = self.counts.get(&window).copied().unwrap_or(0);
        let allowed = if self.sliding {
            let previous = window
                .checked_sub(1)
                .and_then(|w| self.counts.get(&w))
                .copied()
                .unwrap_or(0);
            // previous × (U − elapsed) / U + current + cost ≤ R, times U.
            previous * (length - elapsed) + (current + cost) * length <= limit * length
        } else {
            current + cost <= limit
        };
        if !allowed {
            return None;
        }
        let mut next = self.clone();
        *next.counts.entry(window).or_default() += cost;
        next.newest = Some(window);
        Some(next)
    }
}
