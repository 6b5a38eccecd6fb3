//! The corpus against the reference model: the corpus itself, the shared
//! `limiter-common` functions (every algorithm, every combination of
//! meters), `governor` and envoy's formula. Depends on `limiter-common`
//! alone, so `cargo xtask mutants` runs it against every mutant in seconds.

use std::{
    collections::HashMap,
    sync::atomic::{AtomicU64, Ordering},
};

use limiter_common::{
    gcra::Gcra,
    log::Log,
    meter::{Outcome, acquire, acquire_all, acquire_all_after, windows_all},
    window::{Window, WindowState},
};
use limiter_conformance::{
    assert_same, assert_same_over_soft,
    reference::{self, Algo, Arrival, Limit, Meter, Spec, Trace},
    traces::corpus,
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
