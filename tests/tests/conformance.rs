//! Conformance of the kernel: the loaded XDP program (the test build,
//! whose clock is set by the test through BPF_PROG_TEST_RUN) gives exactly
//! the verdicts of the reference model on every trace of the corpus it can
//! run (`limiter-conformance` holds the corpus, the model, and the
//! comparisons that need no kernel). Also what the test build must do that
//! the corpus does not show: dry run, default drop, full rule tables. (This
//! build is the one `cargo xtask mutants` rebuilds from each mutant.)

use std::net::Ipv4Addr;

use limiter_conformance::assert_same;
use limiter_tests::{
    Loaded, XDP_DROP, XDP_PASS, frames, loaded_object,
    reference::{self, Algo},
    rules, run_at, test_clock_object,
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
        let extra = |spec: &reference::Spec| {
            format!(
                "match: {{ source: 198.18.0.0/16 }}, key: source, {}",
                spec.kernel_cost()
            )
        };
        dp.engine
            .apply(rules(&trace.spec.rule_file(&extra(&trace.spec))))
            .expect("applying the trace's rule");
        let datapath = dp.engine.datapath_mut();
        let mut config = datapath.config().expect("config");
        config.realtime_offset_ns = REALTIME_OFFSET_NS;
        datapath.set_config(config).expect("config");
        let mut got = Vec::new();
        let mut changes = trace.changes.iter().peekable();
        for (i, a) in trace.arrivals.iter().enumerate() {
            while let Some(change) = changes.next_if(|c| c.at <= i) {
                // The engine carries the state at the program's clock.
                let monotonic = if trace.spec.algo == Algo::Gcra {
                    change.t
                } else {
                    change.t.wrapping_sub(REALTIME_OFFSET_NS)
                };
                let datapath = dp.engine.datapath_mut();
                let clock = datapath.maps_mut().test_clock.as_mut().expect("test clock");
                clock.set(0, monotonic, 0).expect("setting the clock");
                let applied = dp
                    .engine
                    .apply(rules(&change.spec.rule_file(&extra(&change.spec))))
                    .expect("changing the trace's limits");
                assert_eq!(applied.carried, ["trace"], "{}", trace.name);
                // An apply refreshes the offset from the real clocks.
                let datapath = dp.engine.datapath_mut();
                let mut config = datapath.config().expect("config");
                config.realtime_offset_ns = REALTIME_OFFSET_NS;
                datapath.set_config(config).expect("config");
            }
            let payload = if trace.spec.charges_bytes() {
                a.cost as usize - 42
            } else {
                22
            };
            let source = Ipv4Addr::new(198, 18, 0, a.key + 1);
            // The rule's costly class is a SYN (traces with one charge no
            // bytes, so the frame's length does not matter).
            let frame = if a.costly {
                frames::with_tcp_flags(frames::tcp4(source, 9), 0x02)
            } else {
                frames::udp4(source, 9, payload)
            };
            // GCRA runs on the monotonic clock; windows on the epoch clock,
            // which the program computes as monotonic + the offset.
            let monotonic = if trace.spec.algo == Algo::Gcra {
                a.t
            } else {
                a.t.wrapping_sub(REALTIME_OFFSET_NS)
            };
            got.push(run_at(&mut dp, &frame, monotonic) == XDP_PASS);
        }
        assert_same(
            &trace,
            &reference::verdicts(&trace),
            &got,
            "the XDP program",
        );
        replayed += 1;
    }
    assert_eq!(replayed, 54, "traces replayed through the program");
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

/// The verdict on one UDP frame from `source` at `t`.
fn verdict(dp: &mut Loaded, source: Ipv4Addr, t: u64) -> u32 {
    run_at(dp, &frames::udp4(source, 9, 22), t)
}

/// Guards the rule flags the corpus never sets: a dry-run rule passes its
/// excess (a lost `SHADOW` bit would drop it) and `default: drop` drops
/// what no rule matches (a lost `BLOCK` bit would pass it).
#[test]
fn dry_run_and_default_drop() {
    let mut dp = loaded_object(
        &test_clock_object(),
        "default: drop\nrules:\n  - { name: dry, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 }, action: shadow }\n",
    );
    let t = 5_000_000_000;
    let (matched, unmatched) = (Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(203, 0, 113, 1));
    let got: Vec<u32> = (0..3).map(|i| verdict(&mut dp, matched, t + i)).collect();
    assert_eq!(got, [XDP_PASS; 3], "a dry run passes its excess");
    assert_eq!(verdict(&mut dp, unmatched, t), XDP_DROP, "default: drop");
}

/// Guards the capacity of the rule tries: the largest rule file (1,023
/// rules, each with its own prefix) fits, and so does its next version
/// (renamed rules keep their ids) while the first generation still holds
/// its entries.
#[test]
fn the_largest_rule_file_fits_both_generations() {
    let mut dp = loaded_object(&test_clock_object(), "rules: []\n");
    let largest = |prefix: &str| {
        let mut text = String::from("default: drop\nrules:\n");
        for i in 0..1023u32 {
            text += &format!(
                "  - {{ name: {prefix}{i}, match: {{ source: 10.1.{}.{}/32 }}, limit: unlimited }}\n",
                i / 256,
                i % 256
            );
        }
        text
    };
    for prefix in ["a", "b"] {
        dp.engine
            .apply(rules(&largest(prefix)))
            .expect("the largest rule file fits in the generation packets do not read");
    }
    assert_eq!(
        verdict(&mut dp, Ipv4Addr::new(10, 1, 3, 254), 1),
        XDP_PASS,
        "the last rule applies"
    );
    assert_eq!(verdict(&mut dp, Ipv4Addr::new(10, 1, 3, 255), 1), XDP_DROP);
}
