//! Conformance: on every trace of the corpus, the shared `limiter-common`
//! functions and the loaded XDP program (the test build, whose clock is
//! set by the test through BPF_PROG_TEST_RUN) give exactly the verdicts of
//! the reference model; and for GCRA, so does the `governor` crate.

use std::{collections::HashMap, net::Ipv4Addr, sync::atomic::AtomicU64};

use aya::{
    maps::Array,
    programs::{TestRun, TestRunOptions},
};
use limiter_common::{
    gcra::Gcra,
    meter::{Outcome, acquire, windows_all},
    window::{Window, WindowState},
};
use limiter_tests::{
    frames, loaded_object,
    reference::{self, Algo, Trace},
    rules, test_clock_object,
    traces::{corpus, replayable_as_frames},
};

/// The first arrival where two verdict lists differ, for the message.
#[track_caller]
fn assert_same(trace: &Trace, expected: &[bool], got: &[bool], who: &str) {
    if let Some(i) = expected.iter().zip(got).position(|(e, g)| e != g) {
        panic!(
            "{who} differs from the reference on {} at arrival {i} ({:?}): reference {}, got {}",
            trace.name, trace.arrivals[i], expected[i], got[i]
        );
    }
    assert_eq!(expected.len(), got.len());
}

/// Sanity of the corpus itself: every trace admits some and denies some.
#[test]
fn the_corpus_exercises_both_verdicts() {
    for trace in corpus() {
        let v = reference::verdicts(&trace);
        assert!(
            v.contains(&true) && v.contains(&false),
            "{} is one-sided: {v:?}",
            trace.name
        );
    }
}

fn shared_verdicts(trace: &Trace) -> Vec<bool> {
    let s = trace.spec;
    match s.algo {
        Algo::Gcra => {
            let gcra = Gcra::new(s.rate, s.period_ns, s.burst).expect("valid limit");
            let mut cells: HashMap<u8, AtomicU64> = HashMap::new();
            trace
                .arrivals
                .iter()
                .map(|a| {
                    acquire(&*cells.entry(a.key).or_default(), &gcra, a.t, a.cost)
                        == Outcome::Allowed
                })
                .collect()
        }
        Algo::SlidingLog => {
            let window = Window::new(s.rate, s.period_ns).expect("valid limit");
            let mut logs: HashMap<u8, limiter_common::log::Log> = HashMap::new();
            trace
                .arrivals
                .iter()
                .map(|a| logs.entry(a.key).or_default().admit(&window, a.t, a.cost))
                .collect()
        }
        Algo::FixedWindow | Algo::SlidingWindow => {
            let window = Window::new(s.rate, s.period_ns).expect("valid limit");
            let mut states: HashMap<u8, WindowState> = HashMap::new();
            trace
                .arrivals
                .iter()
                .map(|a| {
                    let state = states.entry(a.key).or_default();
                    let sliding = s.algo == Algo::SlidingWindow;
                    windows_all([Some((state, &window, a.cost))], a.t, sliding).outcome
                        == Outcome::Allowed
                })
                .collect()
        }
    }
}

#[test]
fn shared_functions_match_the_reference() {
    for trace in corpus() {
        assert_same(
            &trace,
            &reference::verdicts(&trace),
            &shared_verdicts(&trace),
            "limiter-common",
        );
    }
}

#[test]
fn the_xdp_program_matches_the_reference() {
    let object = test_clock_object();
    let mut dp = loaded_object(&object, "rules: []\n");
    let mut replayed = 0;
    for trace in corpus().into_iter().filter(replayable_as_frames) {
        // A fresh rule (fresh id, fresh keys) per trace.
        dp.engine.apply(rules("rules: []\n")).expect("clearing");
        dp.engine
            .apply(rules(
                &trace
                    .spec
                    .rule_file("match: { source: 198.18.0.0/16 }, key: source, "),
            ))
            .expect("applying the trace's rule");
        let datapath = dp.engine.datapath_mut();
        let mut config = datapath.config().expect("config");
        config.realtime_offset_ns = 0; // the test clock is the epoch clock
        datapath.set_config(config).expect("config");
        let mut got = Vec::new();
        for a in &trace.arrivals {
            let frame = if trace.spec.bytes {
                frames::udp4(
                    Ipv4Addr::new(198, 18, 0, a.key + 1),
                    9,
                    a.cost as usize - 42,
                )
            } else {
                frames::udp4(Ipv4Addr::new(198, 18, 0, a.key + 1), 9, 22)
            };
            let mut clock: Array<_, u64> = Array::try_from(
                dp.engine
                    .datapath_mut()
                    .map_mut("CLOCK")
                    .expect("the test build has CLOCK"),
            )
            .expect("array");
            clock.set(0, a.t, 0).expect("setting the clock");
            let result = dp
                .program()
                .test_run(TestRunOptions {
                    data_in: Some(&frame),
                    ..TestRunOptions::default()
                })
                .expect("BPF_PROG_TEST_RUN");
            got.push(result.return_value == 2); // XDP_PASS
        }
        assert_same(
            &trace,
            &reference::verdicts(&trace),
            &got,
            "the XDP program",
        );
        replayed += 1;
    }
    assert_eq!(replayed, 27, "traces replayed through the program");
}

#[test]
fn the_kernel_refuses_what_only_layer_7_can_do() {
    let mut dp = loaded_object(&test_clock_object(), "rules: []\n");
    for (text, what) in [
        (
            "rules:\n  - { name: exact, algorithm: sliding_log, limit: { rate: 5, unit: second } }\n",
            "algorithm sliding_log",
        ),
        (
            "rules:\n  - { name: paced, limit: { rate: 5, unit: second, delay: 1s } }\n",
            "limit.delay (pacing)",
        ),
    ] {
        let error = dp
            .engine
            .apply(rules(text))
            .expect_err("the kernel cannot do this")
            .to_string();
        assert!(
            error.contains(what) && error.contains("layer 7 only"),
            "{error}"
        );
    }
}

/// governor's quota for our (R, U, B): one cell every U/R, burst B.
#[test]
fn governor_agrees_on_gcra() {
    use governor::{Quota, RateLimiter, clock::FakeRelativeClock};
    use std::{num::NonZeroU32, time::Duration};
    let mut compared = 0;
    for trace in corpus().into_iter().filter(|t| t.spec.algo == Algo::Gcra) {
        let s = trace.spec;
        // governor counts from its clock's start and cannot go backwards,
        // and takes whole cells: it gets the traces it can express.
        let monotonic = trace.arrivals.windows(2).all(|w| w[0].t <= w[1].t);
        if !monotonic || s.bytes || trace.arrivals.iter().any(|a| a.t > u64::MAX / 2) {
            continue;
        }
        let period = Duration::from_nanos(s.period_ns.div_ceil(s.rate));
        let quota = Quota::with_period(period)
            .expect("nonzero")
            .allow_burst(NonZeroU32::new(s.burst as u32).expect("nonzero burst"));
        let clock = FakeRelativeClock::default();
        let limiter = RateLimiter::dashmap_with_clock(quota, clock.clone());
        let start = trace.arrivals[0].t;
        let mut at = 0;
        let got: Vec<bool> = trace
            .arrivals
            .iter()
            .map(|a| {
                let offset = a.t - start;
                clock.advance(Duration::from_nanos(offset - at));
                at = offset;
                limiter.check_key(&a.key).is_ok()
            })
            .collect();
        assert_same(&trace, &reference::verdicts(&trace), &got, "governor");
        compared += 1;
    }
    assert!(compared >= 5, "governor compared on only {compared} traces");
}

/// envoy ratelimit's fixed window: a counter per key and window
/// `floor(now / unit)`, incremented by every hit; a hit is over the limit
/// when the incremented counter exceeds `requests_per_unit`. (envoy counts
/// hits that are over the limit too; with unit costs that changes no
/// verdict, since a window once over stays over.)
#[test]
fn envoy_formula_agrees_on_fixed_windows() {
    let mut compared = 0;
    for trace in corpus()
        .into_iter()
        .filter(|t| t.spec.algo == Algo::FixedWindow)
    {
        let monotonic = trace.arrivals.windows(2).all(|w| w[0].t <= w[1].t);
        if !monotonic || trace.arrivals.iter().any(|a| a.cost != 1) {
            continue;
        }
        let mut counters: HashMap<(u8, u64), u64> = HashMap::new();
        let got: Vec<bool> = trace
            .arrivals
            .iter()
            .map(|a| {
                let counter = counters
                    .entry((a.key, a.t / trace.spec.period_ns))
                    .or_default();
                *counter += 1;
                *counter <= trace.spec.rate
            })
            .collect();
        assert_same(
            &trace,
            &reference::verdicts(&trace),
            &got,
            "envoy's formula",
        );
        compared += 1;
    }
    assert!(
        compared >= 5,
        "envoy's formula compared on only {compared} traces"
    );
}
