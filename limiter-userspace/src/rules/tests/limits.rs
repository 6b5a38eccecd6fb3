//! A rule's limits: aggregates and what the fingerprint holds, window
//! algorithms, the key-creation budget, soft limits, several limits on
//! one key.

use std::{path::Path, time::Duration};

use super::common::{error, parse};
use crate::rules::*;

#[test]
fn aggregates_and_fingerprints() {
    let text = "rules:\n  - { name: a, limit: { rate: 1000, unit: second }, aggregate: { rate: 100000, unit: second } }\n";
    let set = parse(text).unwrap();
    let agg = set.rules[0].aggregate.unwrap().packets.unwrap();
    assert_eq!((agg.rate, agg.burst), (100_000, 100_000));
    // Name and action do not change the fingerprint; limits do.
    let renamed = parse(
        &text
            .replace("name: a", "name: b")
            .replace("} }\n", "}, action: shadow }\n"),
    )
    .unwrap();
    assert_eq!(renamed.rules[0].fingerprint(), set.rules[0].fingerprint());
    let changed = parse(&text.replace("rate: 100000", "rate: 99999")).unwrap();
    assert_ne!(changed.rules[0].fingerprint(), set.rules[0].fingerprint());
    // Limits do not change the identity (the keys' meaning); the
    // algorithm, match and key do.
    let identity = |text: &str| parse(text).unwrap().rules[0].identity();
    assert_eq!(identity(text), renamed.rules[0].identity());
    assert_eq!(identity(text), changed.rules[0].identity());
    assert_eq!(
        identity(text),
        identity(&text.replace("rate: 1000,", "rate: 5,"))
    );
    let base = "rules:\n  - { name: a, match: { source: 10.0.0.0/8 }, limit: { rate: 9, unit: second } }\n";
    for other in [
        base.replace("name: a,", "name: a, key: source/24,"),
        base.replace("10.0.0.0/8 }", "10.0.0.0/8, protocol: udp }"),
        base.replace("name: a,", "name: a, algorithm: fixed_window,"),
    ] {
        assert_ne!(identity(&other), identity(base), "{other}");
    }
    // A window's unit is part of what its counts mean; its rate is not.
    let windows = base.replace("name: a,", "name: a, algorithm: fixed_window,");
    assert_eq!(
        identity(&windows),
        identity(&windows.replace("rate: 9", "rate: 3"))
    );
    assert_ne!(
        identity(&windows),
        identity(&windows.replace("unit: second", "unit: minute"))
    );
    // The text a fingerprint hashes is what earlier builds hashed: pinned
    // rules keep their ids across an upgrade.
    assert_eq!(set.rules[0].fingerprint(), 7_282_489_196_954_970_698);
    let e =
        error("rules:\n  - { name: a, limit: unlimited, aggregate: { rate: 1, unit: second } }\n");
    assert!(
        e.contains("rules[0].aggregate: has no effect on an unlimited rule"),
        "{e}"
    );
    let e = error(
        "rules:\n  - { name: a, limit: { rate: 1, unit: second }, aggregate: { rate: 0, unit: second } }\n",
    );
    assert!(
        e.contains("rules[0].aggregate.rate: rate must be at least 1"),
        "{e}"
    );
}

#[test]
fn window_algorithms() {
    let set = parse(
        "rules:\n  - { name: a, algorithm: sliding_window, limit: { rate: 10, unit: minute } }\n",
    )
    .unwrap();
    assert_eq!(set.rules[0].algorithm, Algorithm::SlidingWindow);
    let Limit::Metered {
        packets: Some(m), ..
    } = set.rules[0].limit
    else {
        panic!()
    };
    assert_eq!((m.window.limit, m.window.length_ns), (10, 60_000_000_000));
    let e = error(
        "rules:\n  - { name: a, algorithm: fixed_window, limit: { rate: 10, burst: 20, unit: minute } }\n",
    );
    assert!(
        e.contains("rules[0].limit.burst: applies to gcra only"),
        "{e}"
    );
    let e = error(
        "rules:\n  - { name: a, algorithm: sliding_window, limit: { rate: 1000000, unit: day } }\n",
    );
    assert!(e.contains("rules[0].limit.rate: 2 × rate × unit"), "{e}");
    // A key's window counts are 31-bit; a rule's aggregate is not bounded so.
    let e = error(
        "rules:\n  - { name: a, algorithm: fixed_window, limit: { rate: 10, bytes: 2147483648, unit: 3s } }\n",
    );
    assert!(
        e.contains("rules[0].limit.bytes: 2147483648: a window counts at most 2147483647 per key"),
        "{e}"
    );
    RuleSet::parse(
        "rules:\n  - { name: a, algorithm: fixed_window, limit: { rate: 10, bytes: 2147483647, unit: 3s }, aggregate: { rate: 10, bytes: 2500000000, unit: 3s } }\n",
        Path::new("t.yaml"),
    )
    .unwrap();
    let e = error("rules:\n  - { name: a, algorithm: leaky, limit: { rate: 1, unit: day } }\n");
    assert!(
        e.contains("rules[0].algorithm: unknown variant `leaky`"),
        "{e}"
    );
    // The algorithm is part of what a bucket means.
    let gcra = parse("rules:\n  - { name: a, limit: { rate: 10, unit: minute } }\n").unwrap();
    assert_ne!(gcra.rules[0].fingerprint(), set.rules[0].fingerprint());
}

/// Guards the key-creation budget: `max_keys` a minute with a second's
/// worth of burst by default, as written when given, and keys only.
#[test]
fn new_keys_budget() {
    let set = parse("max_keys: 6000\nrules: []\n").unwrap();
    assert_eq!(
        (set.new_keys.rate, set.new_keys.period, set.new_keys.burst),
        (6000, Duration::from_secs(60), 100)
    );
    assert_eq!(set.new_keys.gcra.emission_ns, 10_000_000);
    let set = parse("new_keys: { rate: 50, unit: second, burst: 5 }\nrules: []\n").unwrap();
    assert_eq!((set.new_keys.rate, set.new_keys.burst), (50, 5));
    assert_eq!(set.new_keys.gcra.emission_ns, 20_000_000);
    let e = error("rules: []\nnew_keys: { bytes: 5, unit: second }\n");
    assert!(
        e.contains("rules.yaml:2") && e.contains("new_keys.bytes") && e.contains("counts keys"),
        "{e}"
    );
    let e = error("new_keys: { rate: 0, unit: second }\nrules: []\n");
    assert!(e.contains("new_keys.rate"), "{e}");
}

#[test]
fn soft_limits_are_packet_rates_below_the_hard_one() {
    let rule = |soft: &str| {
        format!(
            "rules:\n  - {{ name: s, limit: {{ rate: 100, unit: second, burst: 20 }}, soft: {soft} }}\n"
        )
    };
    let set = parse(&rule("{ rate: 50, unit: second, burst: 10 }")).unwrap();
    let soft = set.rules[0].soft.expect("a soft limit");
    assert_eq!((soft.rate, soft.burst), (50, 10));
    assert_eq!(
        describe::describe(&set.rules[0]).limit,
        "100 pkts/s, burst 20 (soft 50 pkts/s, burst 10)"
    );
    // A rule without one keeps the fingerprint it had before soft limits.
    let plain =
        parse("rules:\n  - { name: s, limit: { rate: 100, unit: second, burst: 20 } }\n").unwrap();
    assert_ne!(plain.rules[0].fingerprint(), set.rules[0].fingerprint());
    assert_eq!(plain.rules[0].identity(), set.rules[0].identity());
    for (soft, expected) in [
        (
            "{ rate: 200, unit: second }",
            "rules[0].soft: 200 per 1s with a burst of 200 is not below the hard limit (100 per 1s, burst 20)",
        ),
        (
            "{ rate: 100, unit: second, burst: 20 }",
            "is not below the hard limit",
        ),
        (
            "{ rate: 50, unit: second, burst: 30 }",
            "is not below the hard limit",
        ),
        (
            "{ rate: 50, unit: second, bytes: 10 }",
            "rules[0].soft.bytes: a soft limit is a packet (request) rate",
        ),
        ("{ rate: 50, unit: fortnight }", "rules[0].soft.unit:"),
    ] {
        let e = error(&rule(soft));
        assert!(e.contains(expected), "{soft}: {e}");
    }
    let e = error(
        "rules:\n  - { name: s, algorithm: fixed_window, limit: { rate: 100, unit: second }, soft: { rate: 5, unit: second } }\n",
    );
    assert!(e.contains("rules[0].soft: needs algorithm gcra"), "{e}");
    let e = error(
        "rules:\n  - { name: s, limit: { bytes: 100, unit: second }, soft: { rate: 5, unit: second } }\n",
    );
    assert!(
        e.contains("rules[0].soft: needs a hard packet limit"),
        "{e}"
    );
}

#[test]
fn several_limits_are_three_at_most() {
    let rule = |limits: &str| format!("rules:\n  - {{ name: m, limits: {limits} }}\n");
    let set = parse(&rule(
        "[ { rate: 10, unit: second }, { rate: 250, unit: day } ]",
    ))
    .unwrap();
    let r = &set.rules[0];
    assert_eq!(r.packet_rate().map(|m| m.rate), Some(10));
    assert_eq!(r.second_packets.map(|m| m.rate), Some(250));
    assert_eq!(
        describe::describe(r).limit,
        "10 pkts/s, burst 10 + 250 pkts/day, burst 250"
    );
    let mixed = parse(&rule(
        "[ { rate: 10, unit: second }, { bytes: 1000000, unit: minute } ]",
    ))
    .unwrap();
    assert!(mixed.rules[0].second_packets.is_none());
    // One limit in `limits` is the same rule as `limit`.
    let one = parse(&rule("[ { rate: 10, unit: second } ]")).unwrap();
    let plain = parse("rules:\n  - { name: m, limit: { rate: 10, unit: second } }\n").unwrap();
    assert_eq!(one.rules[0].fingerprint(), plain.rules[0].fingerprint());
    // Three: the third in the key's third word, packets or bytes.
    let three = parse(&rule(
        "[ { rate: 10, unit: second }, { rate: 250, unit: day }, { bytes: 1000000, unit: second } ]",
    ))
    .unwrap();
    let r = &three.rules[0];
    assert_eq!(r.packet_rate().map(|m| m.rate), Some(10));
    assert!(r.second_packets.is_none(), "the byte meter holds the bytes");
    assert_eq!(
        r.third.map(|t| (t.rate.rate, t.counts_bytes)),
        Some((250, false))
    );
    assert_eq!(
        describe::describe(r).limit,
        "10 pkts/s, burst 10 + 1,000,000 bytes/s, burst 1,000,000 + 250 pkts/day, burst 250"
    );
    let packets = parse(&rule(
        "[ { rate: 1, unit: second }, { rate: 2, unit: minute }, { rate: 3, unit: hour } ]",
    ))
    .unwrap();
    let r = &packets.rules[0];
    assert_eq!(r.second_packets.map(|m| m.rate), Some(2));
    assert_eq!(
        r.third.map(|t| (t.rate.rate, t.counts_bytes)),
        Some((3, false))
    );
    let bytes = parse(&rule(
        "[ { rate: 1, bytes: 500, unit: second }, { bytes: 9000, unit: minute } ]",
    ))
    .unwrap();
    assert_eq!(
        bytes.rules[0].third.map(|t| (t.rate.rate, t.counts_bytes)),
        Some((9000, true))
    );
    // A soft limit below either of two packet limits (the daily one here,
    // though listed first and kept second).
    let soft = parse(&rule(
        "[ { rate: 1000, unit: day }, { rate: 10, unit: second } ], soft: { rate: 500, unit: day }",
    ))
    .unwrap();
    assert_eq!(soft.rules[0].soft.map(|s| s.rate), Some(500));
    let e = error(&rule(
        "[ { rate: 1000, unit: day }, { rate: 10, unit: second } ], soft: { rate: 2000, unit: day }",
    ));
    assert!(
        e.contains("rules[0].soft:") && e.contains("not below the hard limit"),
        "{e}"
    );
    // The file's order does not matter: shortest unit first.
    let shuffled = parse(&rule(
        "[ { rate: 250, unit: day }, { rate: 2, unit: minute }, { rate: 1, unit: second } ]",
    ))
    .unwrap();
    let sorted = parse(&rule(
        "[ { rate: 1, unit: second }, { rate: 2, unit: minute }, { rate: 250, unit: day } ]",
    ))
    .unwrap();
    assert_eq!(shuffled.rules[0], sorted.rules[0]);
    assert_eq!(
        shuffled.rules[0].third.map(|t| t.rate.rate),
        Some(250),
        "the longest unit in the third word"
    );
    // Adding a third limit, or switching its kind, starts the keys afresh.
    let identity = |text: &str| parse(&rule(text)).unwrap().rules[0].identity();
    let two = identity("[ { rate: 10, unit: second }, { bytes: 500, unit: second } ]");
    let third_packets = identity(
        "[ { rate: 10, unit: second }, { bytes: 500, unit: second }, { rate: 3, unit: hour } ]",
    );
    let third_bytes = identity(
        "[ { rate: 10, unit: second }, { bytes: 500, unit: second }, { bytes: 3000, unit: hour } ]",
    );
    assert!(two != third_packets && third_packets != third_bytes && two != third_bytes);
    assert_eq!(
        third_packets,
        identity(
            "[ { rate: 20, unit: second }, { bytes: 900, unit: second }, { rate: 5, unit: day } ]"
        ),
        "limits alone changed: the keys are kept"
    );
    for (limits, expected) in [
        (
            "[ { rate: 1, unit: second }, { rate: 2, unit: minute }, { rate: 3, unit: hour }, { rate: 4, unit: day } ]",
            "rules[0].limits: one to three limits per key",
        ),
        (
            "[ { rate: 1, bytes: 5, unit: second }, { rate: 2, bytes: 6, unit: minute } ]",
            "one to three limits per key",
        ),
        (
            "[ { bytes: 5, unit: second }, { bytes: 6, unit: minute }, { bytes: 7, unit: hour } ]",
            "two byte rates at most",
        ),
        (
            "[ { rate: 1, unit: second }, { rate: 2, unit: second }, { rate: 3, unit: second } ], algorithm: fixed_window",
            "a window key holds two meters",
        ),
        (
            "[ { rate: 10, unit: second }, { rate: 5, unit: minute }, { rate: 3, unit: hour } ], soft: { rate: 5, unit: second }",
            "rules[0].soft: a key with three limits has no room for a soft one",
        ),
        ("[]", "one to three limits per key"),
        (
            "[ { rate: 1, unit: second, delay: 1s } ]",
            "rules[0].limits[0].delay: pacing takes one `limit`",
        ),
        (
            "[ { rate: 1, unit: fortnight } ]",
            "rules[0].limits[0].unit:",
        ),
    ] {
        let e = error(&rule(limits));
        assert!(e.contains(expected), "{limits}: {e}");
    }
    let e = error(
        "rules:\n  - { name: m, limit: { rate: 1, unit: second }, limits: [ { rate: 2, unit: minute } ] }\n",
    );
    assert!(
        e.contains("rules[0].limits: give `limit` or `limits`, not both"),
        "{e}"
    );
    let e = error(&rule(
        "[ { rate: 10, unit: second }, { rate: 250, unit: day } ], algorithm: fixed_window",
    ));
    assert!(
        e.contains("limits of different units need algorithm gcra"),
        "{e}"
    );
    let e = error("rules:\n  - { name: m }\n");
    assert!(e.contains("rules[0].limit: missing"), "{e}");
}
