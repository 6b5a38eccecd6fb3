//! Escalation in the model's terms: the daemon's looks at a rule's keys
//! as a record of what each look found, a key's meters as leaky buckets
//! ([`reference`](crate::reference)'s), a hold as a bucket topped up.
//!
//! A look finds a key (one that has sent anything) over its limit when it
//! was refused anything since the look before (from the second look on;
//! the rule has no aggregate, whose refusals the daemon would not count
//! as the key's), or when one of its buckets could not take one more unit
//! now. It escalates the key when the key was found over at every
//! look of an unbroken run (a look that finds it within its limit, that
//! passes it by, or that escalated it breaks the run) whose first look is
//! `after` or more before this one. Escalated, the key is passed by at
//! every look until `block` has gone by; with the block enforced (scope
//! `key`), each of its buckets is topped up to hold its capacity and the
//! block's length of work, so that it takes nothing until the block ends
//! and is exactly full (no token left) then. Under a dry run (the rule's
//! `action: shadow`, or the global one) no bucket is touched: the
//! escalation is only counted, and the key passed by all the same.
//!
//! The first look at or after a block's end passes the key by as well:
//! what it refused since the look before, the block refused, and a held
//! bucket is exactly full when the block ends. (Counted, a key that went
//! polite during its block, 4 a second against 10, was held again at every
//! block's end with `after: 1s` and whole-second blocks: the daemon did
//! that until the model showed it.)

use std::collections::HashMap;

use crate::reference::{Algo, Bucket, Escalate, Meter, Trace};

/// A trace of a rule that escalates, and when the daemon looks at it.
#[derive(Clone, Debug)]
pub struct EscalationTrace {
    /// The rule (`spec.escalate` set; GCRA, the key's limit alone) and its
    /// arrivals, in time order; no limit changes.
    pub trace: Trace,
    /// When the daemon looks at the rule's keys, in increasing order. An
    /// arrival at the instant of a look comes before it.
    pub looks: Vec<u64>,
    /// The global dry run (`limiter shadow on`) is on throughout.
    pub global_dry_run: bool,
}

impl EscalationTrace {
    /// The rule's escalation.
    pub fn escalate(&self) -> Escalate {
        self.trace
            .spec
            .escalate
            .expect("an escalation trace escalates")
    }

    /// Under a dry run, the rule's or the global one: escalations are
    /// counted, no key is held.
    pub fn dry_run(&self) -> bool {
        self.global_dry_run || self.trace.spec.shadow
    }
}

/// What the model says of an escalation trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Judged {
    /// Per arrival: admitted by its key's meters, holds included. (Under
    /// a dry run every packet passes: a refused one is counted as shadow.)
    pub admitted: Vec<bool>,
    /// Per look: the keys it found over their limit, ascending (those it
    /// escalated included).
    pub over: Vec<Vec<u8>>,
    /// Per look: the keys it escalated, ascending.
    pub escalated: Vec<Vec<u8>>,
    /// Per look: the keys it passed by, escalated within `block` before.
    pub passed_by: Vec<Vec<u8>>,
}

/// What one look did with a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    Over,
    Within,
    PassedBy,
    Escalated,
}

/// One key of the rule.
#[derive(Clone, Debug, Default)]
struct Key {
    /// A bucket per meter of the key's limit (requests, then bytes).
    buckets: Vec<Bucket>,
    /// When each of its refused arrivals came.
    refused: Vec<u64>,
    /// What each look that saw it found: (look number, found).
    found: Vec<(usize, Found)>,
}

/// Every arrival's verdict and every look's findings on `trace`.
pub fn judge(trace: &EscalationTrace) -> Judged {
    let spec = trace.trace.spec;
    assert!(
        spec.algo == Algo::Gcra
            && spec.aggregate.is_none()
            && spec.second.is_none()
            && spec.third.is_none()
            && spec.soft.is_none()
            && trace.trace.changes.is_empty(),
        "{}: the escalation model knows GCRA and a key's one limit",
        trace.trace.name
    );
    assert!(
        trace.looks.windows(2).all(|w| w[0] < w[1]),
        "{}: looks in increasing order",
        trace.trace.name
    );
    assert!(
        trace.trace.arrivals.windows(2).all(|w| w[0].t <= w[1].t),
        "{}: arrivals in time order",
        trace.trace.name
    );
    let meters: Vec<(Meter, bool)> = spec.limit.meters().collect();
    let period_ns = spec.limit.period_ns;
    let mut keys: HashMap<u8, Key> = HashMap::new();
    let mut judged = Judged {
        admitted: Vec::new(),
        over: Vec::new(),
        escalated: Vec::new(),
        passed_by: Vec::new(),
    };
    let mut looks = trace.looks.iter().copied().enumerate().peekable();
    for a in &trace.trace.arrivals {
        while let Some((n, t)) = looks.next_if(|&(_, t)| t < a.t) {
            look(trace, &meters, &mut keys, n, t, &mut judged);
        }
        let key = keys.entry(a.key).or_insert_with(|| Key {
            buckets: vec![Bucket::default(); meters.len()],
            ..Key::default()
        });
        let next: Option<Vec<Bucket>> = key
            .buckets
            .iter()
            .zip(&meters)
            .map(|(bucket, (meter, bytes))| {
                let cost = if *bytes { a.cost } else { spec.credits(a) };
                bucket.offer(meter, period_ns, a.t, cost)
            })
            .collect();
        // Admitted only if every meter admits it, then charged to all;
        // refused, charged to none.
        judged.admitted.push(next.is_some());
        match next {
            Some(next) => key.buckets = next,
            None => key.refused.push(a.t),
        }
    }
    for (n, t) in looks {
        look(trace, &meters, &mut keys, n, t, &mut judged);
    }
    judged
}

/// Look number `n`, at `now`, at every key that has sent anything.
fn look(
    trace: &EscalationTrace,
    meters: &[(Meter, bool)],
    keys: &mut HashMap<u8, Key>,
    n: usize,
    now: u64,
    judged: &mut Judged,
) {
    let Escalate { after_ns, block_ns } = trace.escalate();
    let period_ns = trace.trace.spec.limit.period_ns;
    let previous = n.checked_sub(1).map(|p| trace.looks[p]);
    let (mut over, mut escalated, mut passed_by) = (Vec::new(), Vec::new(), Vec::new());
    let mut ids: Vec<u8> = keys.keys().copied().collect();
    ids.sort_unstable();
    for id in ids {
        let key = keys.get_mut(&id).expect("listed");
        let last_escalated = key
            .found
            .iter()
            .rev()
            .find(|(_, f)| *f == Found::Escalated)
            .map(|&(m, _)| trace.looks[m]);
        // Escalated within `block` before, or its block ended since the
        // look before (what it refused since, the block refused): passed by.
        let ends = |at: u64| u128::from(at) + u128::from(block_ns);
        if last_escalated.is_some_and(|at| {
            u128::from(now) < ends(at) || previous.is_some_and(|p| u128::from(p) < ends(at))
        }) {
            key.found.push((n, Found::PassedBy));
            passed_by.push(id);
            continue;
        }
        let refused_since =
            previous.is_some_and(|previous| key.refused.iter().any(|&t| previous < t && t <= now));
        let full = key
            .buckets
            .iter()
            .zip(meters)
            .any(|(bucket, (meter, _))| bucket.offer(meter, period_ns, now, 1).is_none());
        if !(refused_since || full) {
            key.found.push((n, Found::Within));
            continue;
        }
        over.push(id);
        // The run of looks, back from this one, that each found it over.
        let mut first = n;
        for &(m, found) in key.found.iter().rev() {
            if m + 1 != first || found != Found::Over {
                break;
            }
            first = m;
        }
        let overdue = u128::from(now) >= u128::from(trace.looks[first]) + u128::from(after_ns);
        if !overdue {
            key.found.push((n, Found::Over));
            continue;
        }
        key.found.push((n, Found::Escalated));
        escalated.push(id);
        if !trace.dry_run() {
            // Held: it drains to exactly full when the block ends.
            for (bucket, (meter, _)) in key.buckets.iter_mut().zip(meters) {
                let capacity = Bucket::capacity((period_ns, *meter));
                *bucket = bucket.filled(now, capacity + i128::from(block_ns));
            }
        }
    }
    judged.over.push(over);
    judged.escalated.push(escalated);
    judged.passed_by.push(passed_by);
}
