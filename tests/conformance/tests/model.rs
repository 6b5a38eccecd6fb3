//! The corpus against the reference model: the corpus itself, the shared
//! `limiter-common` functions (every algorithm, every combination of
//! meters, the escalation watch), `governor` and envoy's formula. Depends
//! on `limiter-common` alone, so `cargo xtask mutants` runs it against
//! every mutant in seconds.

use std::{
    collections::{BTreeMap, HashMap},
    sync::atomic::{AtomicU64, Ordering},
};

use limiter_common::{
    abi::{KeyState, RuleConfig, rule_flag},
    escalation::{Escalation, over_limit},
    gcra::{Check, Gcra},
    log::Log,
    meter::{Outcome, acquire, acquire_all, acquire_all_after, windows_all},
    window::{Window, WindowState},
};
use limiter_conformance::{
    assert_same, assert_same_over_soft,
    escalation::{self, EscalationTrace},
    reference::{self, Algo, Arrival, Escalate, Limit, Meter, Spec, Trace},
    traces::{corpus, escalation_corpus},
};

/// Sanity of the corpus itself: every trace admits some and denies some;
/// one with a soft limit admits some within it and some over it, and only
/// one with a soft limit (GCRA's) has any over it.
#[test]
fn the_corpus_exercises_both_verdicts() {
    for trace in corpus() {
        let judged = reference::judge(&trace);
        let v = &judged.admitted;
        assert!(
            v.contains(&true) && v.contains(&false),
            "{} is one-sided: {v:?}",
            trace.name
        );
        let within_soft = v.iter().zip(&judged.over_soft).any(|(a, o)| *a && !*o);
        let over_soft = judged.over_soft.contains(&true);
        assert_eq!(
            (within_soft, over_soft),
            (true, trace.spec.soft.is_some()),
            "{}: over soft {:?}",
            trace.name,
            judged.over_soft
        );
        assert!(
            trace.spec.soft.is_none() || trace.spec.algo == Algo::Gcra,
            "{}: soft needs gcra",
            trace.name
        );
    }
}

/// The meters of a trace's rule in the kernel's order (key requests, key
/// bytes, aggregate requests, aggregate bytes): (period, meter, bytes).
fn meters(spec: &Spec) -> [Option<(u64, Meter, bool)>; 4] {
    let scope = |limit: Option<Limit>| {
        limit.map_or([None, None], |l| {
            [
                l.requests.map(|m| (l.period_ns, m, false)),
                l.bytes.map(|m| (l.period_ns, m, true)),
            ]
        })
    };
    let [a, b] = scope(Some(spec.limit));
    // A second limit on requests takes the key's byte meter's place, as
    // in the kernel (a rule with one has no byte limit).
    let b = b.or(spec
        .second
        .and_then(|l| l.requests.map(|m| (l.period_ns, m, false))));
    let [c, d] = scope(spec.aggregate);
    [a, b, c, d]
}

/// A key's third limit: its meter, and whether it charges bytes.
fn third(spec: &Spec) -> Option<(Gcra, bool)> {
    let l = spec.third?;
    let (meter, bytes) = match (l.requests, l.bytes) {
        (Some(m), _) => (m, false),
        (None, Some(m)) => (m, true),
        (None, None) => return None,
    };
    Some((
        Gcra::new(meter.rate, l.period_ns, meter.burst).expect("valid limit"),
        bytes,
    ))
}

/// Per key, then for the aggregate (key `None`): one state per meter.
type States<T> = HashMap<Option<u8>, [T; 2]>;

/// How [`shared`] charges a key's soft meter: as the kernel and layer 7
/// do ([`AS_BUILT`]), or with a bug the corpus must notice.
#[derive(Clone, Copy)]
struct SoftCharging {
    /// Charged the arrival's credits (else 1).
    credits: bool,
    /// Charged for a refused arrival too (else only for an admitted one).
    refused_too: bool,
}

const AS_BUILT: SoftCharging = SoftCharging {
    credits: true,
    refused_too: false,
};

/// `limiter-common`'s verdicts (admitted, and admitted over the soft
/// limit) on every arrival of `trace`, its meters combined as the kernel
/// and layer 7 combine them.
fn shared(trace: &Trace, soft: SoftCharging) -> (Vec<bool>, Vec<bool>) {
    let algo = trace.spec.algo;
    // What arrival `n` (`a`) charges meter `i`: bytes its length, the
    // others its credits under the spec in force.
    let cost = |n: usize, a: &Arrival, i: usize, meters: &[Option<(u64, Meter, bool)>; 4]| {
        meters[i].map_or(0, |m| {
            if m.2 {
                a.cost
            } else {
                trace.spec_at(n).credits(a)
            }
        })
    };
    // The meters in force at each arrival (a limit change replaces them).
    let meters_at = |i: usize| meters(&trace.spec_at(i));
    match algo {
        Algo::Gcra => {
            let gcras = |meters: [Option<(u64, Meter, bool)>; 4]| {
                meters.map(|m| {
                    m.map(|(period, meter, _)| {
                        Gcra::new(meter.rate, period, meter.burst).expect("valid limit")
                    })
                })
            };
            let mut cells: States<AtomicU64> = HashMap::new();
            cells.insert(None, Default::default());
            // Each key's third word.
            let mut thirds: HashMap<u8, AtomicU64> = HashMap::new();
            // Each key's soft meter (the same word in the kernel: a rule
            // has one or the other).
            let mut softs: HashMap<u8, AtomicU64> = HashMap::new();
            let mut changes = trace.changes.iter().peekable();
            let mut in_force = gcras(meters(&trace.spec));
            trace
                .arrivals
                .iter()
                .enumerate()
                .map(|(n, a)| {
                    while let Some(change) = changes.next_if(|c| c.at <= n) {
                        let next = gcras(meters(&change.spec));
                        for (scope, pair) in &cells {
                            for (m, cell) in pair.iter().enumerate() {
                                let i = if scope.is_some() { m } else { m + 2 };
                                if let (Some(from), Some(to)) = (&in_force[i], &next[i]) {
                                    let tat = cell.load(Ordering::Relaxed);
                                    cell.store(from.carried(tat, change.t, to), Ordering::Relaxed);
                                }
                            }
                        }
                        if let (Some((from, _)), Some((to, _))) = (
                            third(&trace.spec_at(n.saturating_sub(1))),
                            third(&change.spec),
                        ) {
                            for cell in thirds.values() {
                                let tat = cell.load(Ordering::Relaxed);
                                cell.store(from.carried(tat, change.t, &to), Ordering::Relaxed);
                            }
                        }
                        in_force = next;
                    }
                    let meters = meters_at(n);
                    cells.entry(Some(a.key)).or_default();
                    let (key, aggregate) = (&cells[&Some(a.key)], &cells[&None]);
                    let cell = |i: usize| if i < 2 { &key[i] } else { &aggregate[i - 2] };
                    let charges: [Option<(&AtomicU64, &Gcra, u64)>; 4] = std::array::from_fn(|i| {
                        in_force[i]
                            .as_ref()
                            .map(|g| (cell(i), g, cost(n, a, i, &meters)))
                    });
                    // A third limit, as the kernel and layer 7 meter it.
                    let verdict = match third(&trace.spec_at(n)) {
                        Some((gcra, bytes)) => {
                            let cell = thirds.entry(a.key).or_default();
                            let cost = if bytes {
                                a.cost
                            } else {
                                trace.spec_at(n).credits(a)
                            };
                            acquire_all_after((&*cell, &gcra, cost), a.t, charges, a.t)
                        }
                        None => acquire_all(charges, a.t),
                    };
                    let allowed = verdict.outcome == Outcome::Allowed;
                    // The soft meter, charged (its credits) only what the
                    // others admitted, and refusing nothing.
                    let spec = trace.spec_at(n);
                    let over = spec.soft.is_some_and(|l| {
                        let meter = l.requests.expect("a soft limit is a request rate");
                        let gcra =
                            Gcra::new(meter.rate, l.period_ns, meter.burst).expect("valid limit");
                        let credits = if soft.credits { spec.credits(a) } else { 1 };
                        (allowed || soft.refused_too)
                            && acquire(softs.entry(a.key).or_default(), &gcra, a.t, credits)
                                == Outcome::Denied
                    });
                    (allowed, allowed && over)
                })
                .unzip()
        }
        Algo::SlidingLog => {
            let mut logs: States<Log> = HashMap::new();
            trace
                .arrivals
                .iter()
                .enumerate()
                .map(|(n, a)| {
                    let meters = meters_at(n);
                    let windows = window_meters(&meters);
                    // Every log is tried on a copy; all are kept only if
                    // all admit.
                    let mut key = logs.get(&Some(a.key)).cloned().unwrap_or_default();
                    let mut aggregate = logs.get(&None).cloned().unwrap_or_default();
                    let admitted = (0..4).all(|i| {
                        let log = if i < 2 {
                            &mut key[i]
                        } else {
                            &mut aggregate[i - 2]
                        };
                        windows[i]
                            .as_ref()
                            .is_none_or(|w| log.admit(w, a.t, cost(n, a, i, &meters)))
                    });
                    if admitted {
                        logs.insert(Some(a.key), key);
                        logs.insert(None, aggregate);
                    }
                    (admitted, false)
                })
                .unzip()
        }
        Algo::FixedWindow | Algo::SlidingWindow => {
            let sliding = algo == Algo::SlidingWindow;
            let mut states: States<WindowState> = HashMap::new();
            states.insert(None, Default::default());
            trace
                .arrivals
                .iter()
                .enumerate()
                .map(|(n, a)| {
                    let meters = meters_at(n);
                    let windows = window_meters(&meters);
                    let mut aggregate = states[&None];
                    let key = states.entry(Some(a.key)).or_default();
                    let [k0, k1] = key;
                    let [a0, a1] = &mut aggregate;
                    let [w0, w1, w2, w3] = &windows;
                    let outcome = windows_all(
                        [
                            w0.as_ref().map(|w| (k0, w, cost(n, a, 0, &meters))),
                            w1.as_ref().map(|w| (k1, w, cost(n, a, 1, &meters))),
                            w2.as_ref().map(|w| (a0, w, cost(n, a, 2, &meters))),
                            w3.as_ref().map(|w| (a1, w, cost(n, a, 3, &meters))),
                        ],
                        a.t,
                        sliding,
                    )
                    .outcome;
                    states.insert(None, aggregate);
                    (outcome == Outcome::Allowed, false)
                })
                .unzip()
        }
    }
}

fn window_meters(meters: &[Option<(u64, Meter, bool)>; 4]) -> [Option<Window>; 4] {
    meters
        .map(|m| m.map(|(period, meter, _)| Window::new(meter.rate, period).expect("valid limit")))
}

/// Guards every decision in `limiter-common` (cargo-mutants measures how
/// well: see tests/MUTANTS.md), e.g. a missing refund (packets-and-bytes)
/// or a bucket refilled when the clock jumps back (clock-backwards); and
/// which arrivals go over a soft limit.
#[test]
fn shared_functions_match_the_reference() {
    for trace in corpus() {
        let expected = reference::judge(&trace);
        let (admitted, over_soft) = shared(&trace, AS_BUILT);
        assert_same(&trace, &expected.admitted, &admitted, "limiter-common");
        assert_same_over_soft(&trace, &expected.over_soft, &over_soft, "limiter-common");
    }
}

/// The soft traces notice a soft meter charged wrong: charged 1 instead
/// of the credits (the soft traces with a costly class), or charged for
/// what the other meters refused (every soft trace), some arrival goes
/// over the soft limit, or stays within it, otherwise than the reference
/// says (and than the kernel and layer 7 are held to).
#[test]
fn the_soft_traces_notice_a_soft_meter_charged_wrong() {
    let soft: Vec<Trace> = corpus()
        .into_iter()
        .filter(|t| t.spec.soft.is_some())
        .collect();
    let names: Vec<&str> = soft.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "Gcra/soft-credits",
            "Gcra/soft-two-limits",
            "Gcra/soft-credits-aggregate"
        ]
    );
    for trace in &soft {
        let expected = reference::over_soft(trace);
        let bugs = [
            (
                "charged 1",
                SoftCharging {
                    credits: false,
                    ..AS_BUILT
                },
                trace.spec.costly.is_some(),
            ),
            (
                "charged when refused",
                SoftCharging {
                    refused_too: true,
                    ..AS_BUILT
                },
                true,
            ),
        ];
        for (bug, charging, noticed) in bugs {
            let (admitted, over_soft) = shared(trace, charging);
            assert_eq!(
                admitted,
                reference::verdicts(trace),
                "{}: {bug}",
                trace.name
            );
            assert_eq!(
                over_soft != expected,
                noticed,
                "{}: the soft meter {bug}",
                trace.name
            );
        }
    }
}

/// Holds a peer to the reference on every trace of `algo` it can express
/// (`replay` returns `None` for the others), and checks which those were
/// by name, so a trace that silently drops out shows.
fn compare_peer(
    who: &str,
    algo: Algo,
    expected: &[&str],
    replay: impl Fn(&Trace) -> Option<Vec<bool>>,
) {
    let mut compared = Vec::new();
    // Peers have no way to change a limit and keep the state.
    for trace in corpus()
        .into_iter()
        .filter(|t| t.spec.algo == algo && t.changes.is_empty())
    {
        let Some(got) = replay(&trace) else {
            continue;
        };
        assert_same(&trace, &reference::verdicts(&trace), &got, who);
        let shape = trace.name.split_once('/').map_or("", |(_, shape)| shape);
        compared.push(shape.to_owned());
    }
    assert_eq!(compared, expected, "the traces {who} can express");
}

fn monotonic(trace: &Trace) -> bool {
    trace.arrivals.windows(2).all(|w| w[0].t <= w[1].t)
}

/// governor's quota for our (R, U, B): one cell every U/R, burst B; a
/// request of cost `c` is `check_key_n(c)`.
#[test]
fn governor_agrees_on_gcra() {
    use governor::{Quota, RateLimiter, clock::FakeRelativeClock};
    use std::{num::NonZeroU32, time::Duration};
    let expresses = [
        "steady",
        "bursty",
        "idle-gaps",
        "from-zero",
        "near-2^62",
        "bytes",
        "odd-period",
    ];
    compare_peer("governor", Algo::Gcra, &expresses, |trace| {
        // governor has one meter, counts from its clock's start, cannot go
        // backwards and takes costs from 1 to 2^32 − 1. And it has no end
        // of the clock, where ours fails closed (the last 2^63 ns of u64).
        let (period_ns, meter, _) = trace.spec.single()?;
        let costs = trace
            .arrivals
            .iter()
            .all(|a| a.cost >= 1 && a.cost <= u64::from(u32::MAX));
        if !monotonic(trace) || !costs || trace.arrivals.iter().any(|a| a.t > u64::MAX / 2) {
            return None;
        }
        let period = Duration::from_nanos(period_ns.div_ceil(meter.rate));
        let quota = Quota::with_period(period)
            .expect("nonzero")
            .allow_burst(NonZeroU32::new(meter.burst as u32).expect("nonzero burst"));
        let clock = FakeRelativeClock::default();
        let limiter = RateLimiter::dashmap_with_clock(quota, clock.clone());
        let start = trace.arrivals[0].t;
        let mut at = 0;
        Some(
            trace
                .arrivals
                .iter()
                .map(|a| {
                    let offset = a.t - start;
                    clock.advance(Duration::from_nanos(offset - at));
                    at = offset;
                    let cells = NonZeroU32::new(a.cost as u32).expect("nonzero cost");
                    matches!(limiter.check_key_n(&a.key, cells), Ok(Ok(())))
                })
                .collect(),
        )
    });
}

/// envoy ratelimit's fixed window: a counter per key and window
/// `floor(now / unit)`, incremented by every hit; a hit is over the limit
/// when the incremented counter exceeds `requests_per_unit`. (envoy counts
/// hits that are over the limit too; with unit costs that changes no
/// verdict, since a window once over stays over.)
#[test]
fn envoy_formula_agrees_on_fixed_windows() {
    let expresses = [
        "steady",
        "bursty",
        "idle-gaps",
        "from-zero",
        "near-u64-max",
        "near-2^62",
        "odd-period",
    ];
    compare_peer("envoy's formula", Algo::FixedWindow, &expresses, |trace| {
        // One request limit, requests in time order, each costing 1.
        let (period_ns, meter, false) = trace.spec.single()? else {
            return None;
        };
        if !monotonic(trace) || trace.arrivals.iter().any(|a| a.cost != 1) {
            return None;
        }
        let mut counters: HashMap<(u8, u64), u64> = HashMap::new();
        Some(
            trace
                .arrivals
                .iter()
                .map(|a| {
                    let counter = counters.entry((a.key, a.t / period_ns)).or_default();
                    *counter += 1;
                    *counter <= meter.rate
                })
                .collect(),
        )
    });
}

/// The three-limit traces are not decided by the first two limits alone:
/// without its third limit, each admits some arrival it refused.
#[test]
fn third_limits_decide_some_arrivals() {
    let with_third: Vec<Trace> = corpus()
        .into_iter()
        .filter(|t| t.spec.third.is_some())
        .collect();
    assert_eq!(with_third.len(), 3, "the three-limit traces");
    for trace in with_third {
        let without = with_every_spec(&trace, |spec| Spec {
            third: None,
            ..spec
        });
        let (v, w) = (reference::verdicts(&trace), reference::verdicts(&without));
        let decided = v.iter().zip(&w).filter(|(a, b)| a != b).count();
        assert!(
            decided > 0,
            "{}: the third limit refused nothing",
            trace.name
        );
    }
}

/// The credit traces are decided by their credits: charged 1 each, every
/// one of them admits some arrival it refused.
#[test]
fn credits_decide_some_arrivals() {
    let costly: Vec<Trace> = corpus()
        .into_iter()
        .filter(|t| t.spec.costly.is_some())
        .collect();
    assert_eq!(
        costly.len(),
        6,
        "a credit trace per algorithm, and two soft ones (GCRA)"
    );
    for trace in costly {
        let flat = with_every_spec(&trace, |spec| Spec {
            costly: None,
            ..spec
        });
        let (v, w) = (reference::verdicts(&trace), reference::verdicts(&flat));
        let admitted_more = v.iter().zip(&w).filter(|(a, b)| !**a && **b).count();
        assert!(admitted_more > 0, "{}: credits changed nothing", trace.name);
    }
}

/// `trace` with `change` made to its rule and to every rule its limit
/// changes put in force.
fn with_every_spec(trace: &Trace, change: impl Fn(Spec) -> Spec) -> Trace {
    Trace {
        spec: change(trace.spec),
        changes: trace
            .changes
            .iter()
            .map(|c| reference::LimitChange {
                spec: change(c.spec),
                ..*c
            })
            .collect(),
        ..trace.clone()
    }
}

/// The arrivals of key `key` of `trace`, by index.
fn arrivals_of(trace: &Trace, key: u8) -> impl Iterator<Item = (usize, &Arrival)> {
    trace
        .arrivals
        .iter()
        .enumerate()
        .filter(move |(_, a)| a.key == key)
}

/// The first look of the run of looks, each finding `key` over its
/// limit, that ends with look `n`.
fn run_start(judged: &escalation::Judged, key: u8, n: usize) -> usize {
    let mut first = n;
    while first > 0
        && judged.over[first - 1].contains(&key)
        && !judged.escalated[first - 1].contains(&key)
    {
        first -= 1;
    }
    first
}

/// Guards the escalation traces themselves: enforced, a key that floods
/// is held (several times), a polite one is never over, and one is over
/// at some looks in a row, then not, before a run long enough escalates
/// it; every escalation comes exactly `after` into its run (so a watch
/// that waits one look more shows); a held key is refused everything
/// until its block ends (and something the plain model admits), takes
/// nothing within one packet's time of the end (its bucket is exactly
/// full then), and is admitted again after. Under either dry run the same
/// looks escalate the same keys, and every verdict is the plain model's.
/// A key polite after its hold is held once: the look at its block's end
/// does not count what the hold refused.
#[test]
fn the_escalation_traces_hold_keys_and_restart_runs() {
    let traces = escalation_corpus();
    assert_eq!(traces.len(), 4);
    let enforced = &traces[0];
    assert!(!enforced.dry_run());
    let judged = escalation::judge(enforced);
    let trace = &enforced.trace;
    let Escalate { after_ns, block_ns } = enforced.escalate();
    let meter = trace.spec.limit.requests.expect("a packet limit");
    let unit_ns = trace.spec.limit.period_ns.div_ceil(meter.rate);
    let escalations: Vec<(usize, u8)> = judged
        .escalated
        .iter()
        .enumerate()
        .flat_map(|(n, keys)| keys.iter().map(move |&k| (n, k)))
        .collect();
    let times = |key| escalations.iter().filter(|(_, k)| *k == key).count();
    assert!(times(0) >= 2, "the flood is held again: {escalations:?}");
    assert_eq!(times(1), 0, "the polite key: {escalations:?}");
    assert!(
        judged.over.iter().all(|keys| !keys.contains(&1)),
        "the polite key is never over"
    );
    assert_eq!(times(2), 1, "the intermittent key: {escalations:?}");
    let (held, _) = escalations.iter().find(|(_, k)| *k == 2).expect("key 2");
    let restarted =
        (1..*held).any(|n| judged.over[n - 1].contains(&2) && !judged.over[n].contains(&2));
    assert!(restarted, "key 2's run restarts before its escalation");
    let plain = reference::verdicts(trace);
    for &(n, key) in &escalations {
        let first = run_start(&judged, key, n);
        assert_eq!(
            enforced.looks[n] - enforced.looks[first],
            after_ns,
            "key {key} escalated at look {n}, over since look {first}"
        );
        let (start, end) = (enforced.looks[n], enforced.looks[n] + block_ns);
        let during: Vec<usize> = arrivals_of(trace, key)
            .filter(|(_, a)| start < a.t && a.t < end)
            .map(|(i, _)| i)
            .collect();
        assert!(
            during.iter().all(|&i| !judged.admitted[i]),
            "key {key} held from look {n}"
        );
        assert!(
            during.iter().any(|&i| plain[i]),
            "key {key}'s hold from look {n} refuses something the plain model admits"
        );
        assert!(
            arrivals_of(trace, key)
                .filter(|(_, a)| end <= a.t && a.t < end + unit_ns)
                .all(|(i, _)| !judged.admitted[i]),
            "key {key}'s bucket is full when its block ends"
        );
        assert!(
            arrivals_of(trace, key).any(|(i, a)| end <= a.t && judged.admitted[i]),
            "key {key} is admitted after its block"
        );
    }
    for dry in &traces[1..3] {
        assert!(dry.dry_run(), "{}", dry.trace.name);
        assert_eq!(dry.trace.arrivals.len(), trace.arrivals.len());
        let judged_dry = escalation::judge(dry);
        assert_eq!(
            judged_dry.escalated, judged.escalated,
            "{}: the same escalations",
            dry.trace.name
        );
        assert_same(
            &dry.trace,
            &reference::verdicts(&dry.trace),
            &judged_dry.admitted,
            "a dry run's escalation",
        );
    }
    assert!(traces[1].trace.spec.shadow && !traces[1].global_dry_run);
    assert!(!traces[2].trace.spec.shadow && traces[2].global_dry_run);
    // Polite after its hold: held once, not again at the block's end.
    let polite = escalation::judge(&traces[3]);
    let held: Vec<usize> = (0..polite.escalated.len())
        .filter(|&n| polite.escalated[n].contains(&0))
        .collect();
    assert_eq!(
        held.len(),
        1,
        "{}: held at looks {held:?}",
        traces[3].trace.name
    );
}

/// How [`watched`] builds the daemon's watch: as the daemon does
/// ([`WATCH_AS_BUILT`]), or with a bug the escalation traces must notice.
#[derive(Clone, Copy)]
struct Watch {
    /// A key escalated when its run is longer than `after` (else `after`
    /// or longer).
    strictly_longer: bool,
    /// A held key's block counted from the look (else it ends `block`
    /// after it).
    held_from_look: bool,
    /// The global dry run ignored (else a dry run too).
    rule_dry_run_only: bool,
}

const WATCH_AS_BUILT: Watch = Watch {
    strictly_longer: false,
    held_from_look: false,
    rule_dry_run_only: false,
};

/// `limiter-common`'s verdicts and escalations (per look, ascending
/// keys) on an escalation trace: its GCRA, its escalation watch
/// (`Escalation::observe`, `over_limit`) and what the daemon does around
/// them (a key's refusals since the last look, a held key's TAT `block`
/// and a capacity past the look, keys passed by until their block ends).
fn watched(trace: &EscalationTrace, watch: Watch) -> (Vec<bool>, Vec<Vec<u8>>) {
    let spec = trace.trace.spec;
    let meter = spec.limit.requests.expect("a packet limit");
    let gcra = Gcra::new(meter.rate, spec.limit.period_ns, meter.burst).expect("valid limit");
    let mut rule = RuleConfig {
        flags: rule_flag::LIMIT_PACKETS,
        ..RuleConfig::default()
    };
    rule.packets.gcra = gcra;
    let Escalate { after_ns, block_ns } = trace.escalate();
    let escalation = Escalation {
        // Looks a second apart, `after` whole seconds: `>` is `>=` a
        // nanosecond later.
        after_ns: after_ns + u64::from(watch.strictly_longer),
        block_ns,
    };
    let dry_run = if watch.rule_dry_run_only {
        spec.shadow
    } else {
        trace.dry_run()
    };
    let mut keys: BTreeMap<u8, KeyState> = BTreeMap::new();
    let (mut over_since, mut dropped, mut until) = (
        HashMap::<u8, u64>::new(),
        HashMap::<u8, u32>::new(),
        HashMap::<u8, u64>::new(),
    );
    let mut admitted = Vec::new();
    let mut escalated = Vec::new();
    let mut look = |keys: &mut BTreeMap<u8, KeyState>, n: usize, now: u64| {
        // Passed by until the block ends, and at the first look after.
        let mut released = Vec::new();
        until.retain(|key, end| {
            if *end <= now {
                released.push(*key);
            }
            *end > now
        });
        let (mut since_now, mut dropped_now, mut made) =
            (HashMap::new(), HashMap::new(), Vec::new());
        for (&key, state) in keys.iter_mut() {
            dropped_now.insert(key, state.dropped_packets);
            if until.contains_key(&key) || released.contains(&key) {
                continue;
            }
            let refused_since =
                n > 0 && dropped.get(&key).copied().unwrap_or(0) != state.dropped_packets;
            let over = refused_since || over_limit(state, &rule, None, now, 0);
            let since = over_since.get(&key).copied().unwrap_or(0);
            let (since, block) = escalation.observe(since, over, now);
            if since != 0 {
                since_now.insert(key, since);
            }
            if block {
                made.push(key);
                until.insert(key, now + block_ns);
                if !dry_run {
                    let end = if watch.held_from_look {
                        now
                    } else {
                        now + block_ns
                    };
                    state.meters[0] = state.meters[0].max(end + gcra.capacity_ns);
                }
            }
        }
        over_since = since_now;
        dropped = dropped_now;
        escalated.push(made);
    };
    let mut looks = trace.looks.iter().copied().enumerate().peekable();
    for a in &trace.trace.arrivals {
        while let Some((n, t)) = looks.next_if(|&(_, t)| t < a.t) {
            look(&mut keys, n, t);
        }
        let state = keys.entry(a.key).or_default();
        match gcra.check(state.meters[0], a.t, spec.credits(a)) {
            Check::Allow { new_tat } => {
                state.meters[0] = new_tat;
                admitted.push(true);
            }
            Check::Deny => {
                state.dropped_packets += 1;
                admitted.push(false);
            }
        }
    }
    for (n, t) in looks {
        look(&mut keys, n, t);
    }
    (admitted, escalated)
}

/// Guards `limiter-common`'s escalation watch (`Escalation::observe`,
/// `over_limit`) and GCRA under holds: on every escalation trace, run as
/// the daemon runs them, the same verdicts and the same escalations as
/// the model (cargo-mutants holds `limiter-common` to this in seconds).
#[test]
fn the_escalation_watch_matches_the_reference() {
    for trace in escalation_corpus() {
        let judged = escalation::judge(&trace);
        let (admitted, escalated) = watched(&trace, WATCH_AS_BUILT);
        assert_eq!(
            escalated, judged.escalated,
            "{}: escalated per look, limiter-common then the model",
            trace.trace.name
        );
        assert_same(&trace.trace, &judged.admitted, &admitted, "limiter-common");
    }
}

/// Guards the escalation traces' reach: a watch built wrong (one that
/// escalates a key only once its run is longer than `after`, a hold that
/// ends at the look rather than `block` after it, or a global dry run
/// that holds keys, each as the daemon could get it wrong) escalates
/// otherwise, or gives some arrival another verdict, than the model on
/// some trace.
#[test]
fn the_escalation_traces_notice_a_watch_built_wrong() {
    for (wrong, what) in [
        (
            Watch {
                strictly_longer: true,
                ..WATCH_AS_BUILT
            },
            "a run longer than `after`",
        ),
        (
            Watch {
                held_from_look: true,
                ..WATCH_AS_BUILT
            },
            "a hold ending at the look",
        ),
        (
            Watch {
                rule_dry_run_only: true,
                ..WATCH_AS_BUILT
            },
            "the global dry run ignored",
        ),
    ] {
        let noticed = escalation_corpus().iter().any(|trace| {
            let judged = escalation::judge(trace);
            watched(trace, wrong) != (judged.admitted, judged.escalated)
        });
        assert!(noticed, "{what} went unnoticed");
    }
}
