//! Conformance of the kernel: the loaded XDP program (the test build,
//! whose clock is set by the test through BPF_PROG_TEST_RUN) gives exactly
//! the verdicts of the reference model on every trace of the corpus it can
//! run (`limiter-conformance` holds the corpus, the model, and the
//! comparisons that need no kernel).

use std::net::Ipv4Addr;

use aya::programs::{TestRun, TestRunOptions};
use limiter_conformance::assert_same;
use limiter_tests::{
    frames, loaded_object,
    reference::{self, Algo},
    rules, test_clock_object,
    traces::{corpus, replayable_as_frames},
};

/// CLOCK_REALTIME − CLOCK_MONOTONIC in the replay: not a whole number of
/// seconds, so a program that forgot it (or applied it to GCRA's
/// monotonic state) would put window edges, or the end of the u64 clock,
/// elsewhere than the reference.
const REALTIME_OFFSET_NS: u64 = 1_234_567_890_123_456_789;

/// Guards the kernel's use of the shared functions: a meter order, cost,
/// refund, lock or clock (monotonic for GCRA, epoch for windows) that
/// differs from layer 7's shows as a verdict that differs from the model.
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
        config.realtime_offset_ns = REALTIME_OFFSET_NS;
        datapath.set_config(config).expect("config");
        let mut got = Vec::new();
        for a in &trace.arrivals {
            let payload = if trace.spec.charges_bytes() {
                a.cost as usize - 42
            } else {
                22
            };
            let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, a.key + 1), 9, payload);
            // GCRA runs on the monotonic clock; windows on the epoch clock,
            // which the program computes as monotonic + the offset.
            let monotonic = if trace.spec.algo == Algo::Gcra {
                a.t
            } else {
                a.t.wrapping_sub(REALTIME_OFFSET_NS)
            };
            dp.engine
                .datapath_mut()
                .maps_mut()
                .test_clock
                .as_mut()
                .expect("the test build has CLOCK")
                .set(0, monotonic, 0)
                .expect("setting the clock");
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
    assert_eq!(replayed, 39, "traces replayed through the program");
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
