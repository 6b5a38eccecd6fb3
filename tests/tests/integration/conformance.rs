//! Conformance of the kernel: the loaded XDP program (the test build,
//! whose clock is set by the test through BPF_PROG_TEST_RUN) gives exactly
//! the verdicts of the reference model on every trace of the corpus it can
//! run (`limiter-conformance` holds the corpus, the model, and the
//! comparisons that need no kernel). Also what the test build must do that
//! the corpus does not show: dry run, default drop, full rule tables. (This
//! build is the one `cargo xtask mutants` rebuilds from each mutant.)

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use ipnet::IpNet;
use limiter::kernel::counters::rule_totals;
use limiter_common::abi::{RuleCounters, counter_slot};
use limiter_conformance::{assert_same, assert_same_over_soft, escalation};
use limiter_tests::{
    Loaded, XDP_DROP, XDP_PASS, frames, loaded_object,
    reference::{self, Algo},
    rules, run_at, set_clock, snapshot, test_clock_object,
    traces::{corpus, escalation_corpus, replayable_as_frames},
};

/// CLOCK_REALTIME − CLOCK_MONOTONIC in the replay: not a whole number of
/// seconds, so a program that forgot it (or applied it to GCRA's
/// monotonic state) would put window edges, or the end of the u64 clock,
/// elsewhere than the reference.
const REALTIME_OFFSET_NS: u64 = 1_234_567_890_123_456_789;

/// The id of the trace's rule.
fn trace_rule(dp: &Loaded) -> u32 {
    rule_id(dp, "trace")
}

/// Packets rule `id` has counted over its soft limit (`SOFT_STATS`, every
/// CPU and interface slot).
fn over_soft(dp: &Loaded, id: u32) -> u64 {
    let maps = dp.maps();
    let soft = maps
        .soft_stats
        .as_ref()
        .expect("the program has SOFT_STATS");
    let mut slots = maps.iface_slots().expect("interface slots");
    slots.push((0, 0));
    slots
        .iter()
        .map(|&(_, slot)| {
            soft.get(&counter_slot(slot, id), 0)
                .expect("reading SOFT_STATS")
                .iter()
                .sum::<u64>()
        })
        .sum()
}

/// Guards the kernel's use of the shared functions: a meter order, cost,
/// refund, lock or clock (monotonic for GCRA, epoch for windows) that
/// differs from layer 7's shows as a verdict that differs from the model;
/// and its soft meter (charged the packet's credits, only when the others
/// admit it) as a packet counted over the soft limit, or not, otherwise
/// than the model says.
#[test]
fn the_xdp_program_matches_the_reference() {
    let object = test_clock_object();
    let mut dp = loaded_object(&object, "rules: []\n");
    let (mut replayed, mut softs) = (0, 0);
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
        let mut got_over_soft = Vec::new();
        let mut id = trace_rule(&dp);
        let mut counted = over_soft(&dp, id);
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
                id = trace_rule(&dp);
                counted = over_soft(&dp, id);
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
            // Counted over the soft limit by this run or not.
            let now_counted = over_soft(&dp, id);
            got_over_soft.push(match now_counted.wrapping_sub(counted) {
                0 => false,
                1 => true,
                n => panic!("{}: arrival {i} counted {n} times over soft", trace.name),
            });
            counted = now_counted;
        }
        let expected = reference::judge(&trace);
        assert_same(&trace, &expected.admitted, &got, "the XDP program");
        assert_same_over_soft(
            &trace,
            &expected.over_soft,
            &got_over_soft,
            "the XDP program",
        );
        replayed += 1;
        softs += usize::from(trace.spec.soft.is_some());
    }
    assert_eq!(replayed, 57, "traces replayed through the program");
    assert_eq!(softs, 3, "traces with a soft limit replayed");
}

/// Rule `id`'s counters, every CPU and interface slot.
fn totals(dp: &Loaded, id: u32) -> RuleCounters {
    rule_totals(dp.maps(), id).expect("reading RULE_STATS")
}

/// The key of the escalation traces' rule that `prefix` (a source, /32)
/// stands for.
fn key_of(prefix: &IpNet) -> u8 {
    match prefix {
        IpNet::V4(net) if net.prefix_len() == 32 && net.addr().octets()[..3] == [198, 18, 0] => {
            net.addr().octets()[3] - 1
        }
        _ => panic!("escalated {prefix}: not a key of the trace"),
    }
}

/// Guards escalation with scope `key`, the kernel and the daemon's watch
/// together (`Engine::escalate`, looking at the keys at each of the
/// trace's looks, the test clock set to the look): which looks escalate
/// which keys, and whether enforced, as the model says (a watch that
/// escalates a look late or early, or a key whose over-limit streak did
/// not restart, or a global dry run that holds keys, shows there); and
/// every arrival's verdict, holds included (a hold that ends at the wrong
/// time, or refills the key, shows there): enforced, a refused packet is
/// dropped; under a dry run, the rule's or the global one, every packet
/// passes and a refused one is counted as shadow.
#[test]
fn escalation_matches_the_reference() {
    let mut dp = loaded_object(&test_clock_object(), "rules: []\n");
    let mut replayed = 0;
    for trace in escalation_corpus() {
        let name = &trace.trace.name;
        let spec = &trace.trace.spec;
        let escalate = trace.escalate();
        dp.engine.apply(rules("rules: []\n")).expect("clearing");
        dp.engine
            .apply(rules(
                &spec.rule_file("match: { source: 198.18.0.0/16 }, key: source, "),
            ))
            .expect("applying the trace's rule");
        dp.engine
            .set_shadow(None, trace.global_dry_run)
            .expect("the global dry run");
        let id = trace_rule(&dp);
        let mut counted = totals(&dp, id);
        // (look number, key, enforced) of each escalation.
        let mut escalated = Vec::new();
        let mut look = |dp: &mut Loaded, n: usize, t: u64| {
            let mut made: Vec<(usize, u8, bool)> = escalate_at(dp, t)
                .into_iter()
                .map(|e| {
                    assert_eq!(e.rule, "trace", "{name}");
                    assert_eq!(e.block, Duration::from_nanos(escalate.block_ns), "{name}");
                    assert!(e.hold.is_some(), "{name}: scope key holds the key");
                    (n, key_of(&e.prefix), e.enforced)
                })
                .collect();
            made.sort_unstable();
            escalated.extend(made);
        };
        let mut looks = trace.looks.iter().copied().enumerate().peekable();
        let mut got = Vec::new();
        for (i, a) in trace.trace.arrivals.iter().enumerate() {
            // An arrival at the instant of a look comes before it.
            while let Some((n, t)) = looks.next_if(|&(_, t)| t < a.t) {
                look(&mut dp, n, t);
            }
            let source = Ipv4Addr::new(198, 18, 0, a.key + 1);
            let verdict = run_at(&mut dp, &frames::udp4(source, 9, 22), a.t);
            let now = totals(&dp, id);
            let shadow = now.shadow_packets - counted.shadow_packets;
            let dropped = now.dropped_packets - counted.dropped_packets;
            counted = now;
            got.push(if trace.dry_run() {
                assert_eq!(
                    (verdict, dropped),
                    (XDP_PASS, 0),
                    "{name}: arrival {i}: a dry run passes everything"
                );
                shadow == 0
            } else {
                assert_eq!(shadow, 0, "{name}: arrival {i}: counted as shadow");
                assert_eq!(
                    u64::from(verdict == XDP_DROP),
                    dropped,
                    "{name}: arrival {i}: verdict {verdict} and its count"
                );
                verdict == XDP_PASS
            });
        }
        for (n, t) in looks {
            look(&mut dp, n, t);
        }
        let expected = escalation::judge(&trace);
        let enforced = !trace.dry_run();
        let expected_escalated: Vec<(usize, u8, bool)> = expected
            .escalated
            .iter()
            .enumerate()
            .flat_map(|(n, keys)| keys.iter().map(move |&k| (n, k, enforced)))
            .collect();
        assert!(!expected_escalated.is_empty(), "{name} escalates");
        assert_eq!(
            escalated, expected_escalated,
            "{name}: (look, key, enforced) escalated: the daemon's watch, then the model's"
        );
        assert_same(&trace.trace, &expected.admitted, &got, "the XDP program");
        replayed += 1;
    }
    dp.engine
        .set_shadow(None, false)
        .expect("the global dry run");
    assert_eq!(replayed, 4, "escalation traces replayed");
}

/// Guards escalation with scope `source` through `Engine::escalate`, which
/// the escalation traces (scope `key`) leave out: the key's source is
/// blocked, the block is listed as the rule's, and the kernel drops the
/// source's packets once its bucket has room again. And, under a rule with
/// an aggregate, a key that only the aggregate refuses is not over its
/// limit (its count of refusals includes the aggregate's).
#[test]
fn escalation_by_source_blocks_for_its_rule_and_not_for_an_aggregate() {
    let mut dp = loaded_object(
        &test_clock_object(),
        "rules:
  - { name: src, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 10, unit: second, burst: 5 }, escalate: { after: 1s, block: 1h, scope: source } }
  - { name: agg, match: { source: 198.20.0.0/16 }, key: source, limit: { rate: 100, unit: second }, aggregate: { rate: 5, unit: second }, escalate: { after: 1s, block: 1h, scope: source } }
",
    );
    // The test clock well before the real monotonic clock, by which the
    // engine dates a block's end.
    let start = 1_000_000_000;
    let ms = 1_000_000;
    let flooder = Ipv4Addr::new(198, 18, 0, 1);
    let sharing = [Ipv4Addr::new(198, 20, 0, 1), Ipv4Addr::new(198, 20, 0, 2)];
    let mut escalated = Vec::new();
    for look in 1..=3 {
        let from = start + (look - 1) * 1_000 * ms;
        for i in 0..100 {
            let t = from + i * 10 * ms;
            verdict(&mut dp, flooder, t);
            if i % 8 == 0 {
                for source in sharing {
                    verdict(&mut dp, source, t);
                }
            }
        }
        for e in escalate_at(&mut dp, start + look * 1_000 * ms) {
            assert!(e.enforced && e.hold.is_none(), "{e:?}");
            escalated.push((look, e.prefix.to_string(), e.rule));
        }
    }
    let refused = totals(&dp, rule_id(&dp, "agg"));
    assert!(
        refused.aggregate_excess > 0,
        "the aggregate refused some: {refused:?}"
    );
    assert_eq!(
        escalated,
        [(3, "198.18.0.1/32".to_owned(), "src".to_owned())],
        "the flooder alone (refused since the look before at looks 2 and 3, 1 s \
         apart), not the aggregate's keys"
    );
    let listed = dp.engine.blocks().expect("blocks");
    let block = listed
        .iter()
        .find(|b| b.prefix == "198.18.0.1/32")
        .unwrap_or_else(|| panic!("the flooder's block: {listed:?}"));
    assert_eq!(block.escalated_by.as_deref(), Some("src"), "{block:?}");
    // Its bucket full again a second later: the block drops it.
    assert_eq!(verdict(&mut dp, flooder, start + 5_000 * ms), XDP_DROP);
    assert_eq!(
        verdict(&mut dp, Ipv4Addr::new(198, 18, 0, 2), start + 5_000 * ms),
        XDP_PASS,
        "another source of the rule"
    );
}

/// Guards the rule file's `escalation` through `Engine::escalate` (the
/// daemon's test of it runs on real traffic, and so only counts at least
/// one of each): a key in `never_block` is never blocked, and of three
/// keys due at one look only `max_per_minute` (2) are; each left out is
/// counted by why, at every look it is due again, and each block counted
/// for its rule.
#[test]
fn escalation_spares_never_block_and_caps_blocks_a_minute() {
    let mut dp = loaded_object(
        &test_clock_object(),
        "escalation: { never_block: [198.18.0.0/24], max_per_minute: 2 }
rules:
  - { name: held, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 10, unit: second, burst: 5 }, escalate: { after: 1s, block: 1h, scope: source } }
",
    );
    let start = 1_000_000_000;
    let ms = 1_000_000;
    let spared = Ipv4Addr::new(198, 18, 0, 1);
    let abusive = [
        Ipv4Addr::new(198, 18, 1, 1),
        Ipv4Addr::new(198, 18, 1, 2),
        Ipv4Addr::new(198, 18, 1, 3),
    ];
    let mut blocked = Vec::new();
    let mut left_out = Vec::new();
    for look in 1..=5 {
        let from = start + (look - 1) * 1_000 * ms;
        for i in 0..100 {
            for source in std::iter::once(spared).chain(abusive) {
                verdict(&mut dp, source, from + i * 10 * ms);
            }
        }
        let mut made: Vec<String> = escalate_at(&mut dp, start + look * 1_000 * ms)
            .into_iter()
            .map(|e| e.prefix.to_string())
            .collect();
        made.sort();
        blocked.push(made);
        left_out.push(dp.engine.escalations_left_out());
    }
    let counts = |spared: u64, capped: u64| {
        let mut counts = Vec::new();
        if capped > 0 {
            counts.push(("max_per_minute".to_owned(), capped));
        }
        if spared > 0 {
            counts.push(("never_block".to_owned(), spared));
        }
        counts
    };
    // Due at look 3 (over at looks 2 and 3, 1 s apart): two blocked, the
    // third capped; the capped key is due again at look 5, and capped
    // again (two blocks this minute already).
    let (first, second) = (blocked[2].clone(), blocked[4].clone());
    assert_eq!(first.len(), 2, "{blocked:?}");
    assert!(second.is_empty(), "{blocked:?}");
    assert!(
        blocked[..2].iter().chain(&blocked[3..4]).all(Vec::is_empty),
        "{blocked:?}"
    );
    assert!(!first.contains(&"198.18.0.1/32".to_owned()), "{first:?}");
    assert_eq!(
        left_out,
        [
            counts(0, 0),
            counts(0, 0),
            counts(1, 1),
            counts(1, 1),
            counts(2, 2)
        ],
        "left out, by why, after each look"
    );
    assert_eq!(dp.engine.escalations(), [("held".to_owned(), 2)]);
}

/// The daemon's look at `t` (the test clock set to it): what it escalated.
fn escalate_at(dp: &mut Loaded, t: u64) -> Vec<limiter::engine::escalate::Escalated> {
    set_clock(dp, t);
    dp.engine.escalate().expect("escalating")
}

/// The id of rule `name`.
fn rule_id(dp: &Loaded, name: &str) -> u32 {
    snapshot(dp)
        .rules
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("rule {name}"))
        .id
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

/// Guards the capacity of the rule tables: the largest rule file (1,023
/// rules, each with its own prefix) fits, IPv4's and IPv6's, and so does
/// its next version (renamed rules keep their ids) while the first
/// generation still holds its entries.
#[test]
fn the_largest_rule_file_fits_both_generations() {
    let mut dp = loaded_object(&test_clock_object(), "rules: []\n");
    let largest = |prefix: &str, source: &dyn Fn(u32) -> String| {
        let mut text = String::from("default: drop\nrules:\n");
        for i in 0..1023u32 {
            text += &format!(
                "  - {{ name: {prefix}{i}, match: {{ source: {} }}, limit: unlimited }}\n",
                source(i)
            );
        }
        text
    };
    let v4 = |i: u32| format!("10.1.{}.{}/32", i / 256, i % 256);
    let v6 = |i: u32| format!("2001:db8::{i:x}/128");
    for (prefix, source) in [
        ("a", &v4 as &dyn Fn(u32) -> String),
        ("b", &v4),
        ("c", &v6),
        ("d", &v6),
    ] {
        if prefix == "c" {
            // Other matches take other ids: the IPv4 rules go first.
            dp.engine
                .apply(rules("rules: []\n"))
                .expect("an empty rule file");
        }
        dp.engine
            .apply(rules(&largest(prefix, source)))
            .unwrap_or_else(|e| {
                panic!("the largest rule file ({prefix}) fits in the generation packets do not read: {e:#}")
            });
        let (last, past): (IpAddr, IpAddr) = if prefix < "c" {
            (
                Ipv4Addr::new(10, 1, 3, 254).into(),
                Ipv4Addr::new(10, 1, 3, 255).into(),
            )
        } else {
            (
                "2001:db8::3fe".parse().unwrap(),
                "2001:db8::3ff".parse().unwrap(),
            )
        };
        assert_eq!(
            verdict_from(&mut dp, last, 1),
            XDP_PASS,
            "{prefix}: the last rule applies"
        );
        assert_eq!(
            verdict_from(&mut dp, past, 1),
            XDP_DROP,
            "{prefix}: past the last rule"
        );
    }
}

/// The verdict on one UDP frame from `source`, of either family, at `t`.
fn verdict_from(dp: &mut Loaded, source: IpAddr, t: u64) -> u32 {
    match source {
        IpAddr::V4(v4) => verdict(dp, v4, t),
        IpAddr::V6(v6) => run_at(dp, &frames::udp6(v6, 9, 22), t),
    }
}
