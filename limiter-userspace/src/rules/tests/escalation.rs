//! Escalation: keys narrow enough, durations of a second to a year, the
//! file's escalation policy; and pacing's conditions.

use super::common::{error, parse};
use crate::rules::*;

/// Escalation blocks a key's whole prefix on refusals a forger can cause:
/// `limiter check` refuses it on keys wider than a /24 or a /48 and on
/// `key: all`; and `source/0` (one bucket of the world, unannounced) is
/// refused for `key: all`, which now means one bucket at layer 3/4 too.
#[test]
fn escalation_needs_narrow_keys_and_source_0_is_spelled_all() {
    let rule = |fields: &str| {
        format!(
            "rules:\n  - {{ name: e, {fields}, limit: {{ rate: 10, unit: second }}, escalate: {{ after: 2s, block: 60s }} }}\n"
        )
    };
    for ok in [
        "match: { source: 10.0.0.0/8 }",
        "match: { source: 10.0.0.0/8 }, key: source",
        "match: { source: 10.0.0.0/8 }, key: source/24",
        "match: { source: \"2001:db8::/32\" }, key: source/48",
    ] {
        parse(&rule(ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for (fields, expected) in [
        (
            "match: { source: 10.9.0.0/16 }, key: source/23",
            "rules[0].escalate: not with keys of /23",
        ),
        (
            "match: { source: \"2001:db8::/32\" }, key: source/40",
            "rules[0].escalate: not with keys of /40",
        ),
        (
            "match: { source: 10.9.0.0/16 }, key: all",
            "rules[0].escalate: not with `key: all`",
        ),
        // A /24 is narrow enough for IPv4, not for IPv6: the error says
        // which family's key is too wide.
        (
            "match: { source: \"2001:db8::/32\" }, key: source/24",
            "escalation needs keys of /48 for IPv6 or longer",
        ),
    ] {
        let e = error(&rule(fields));
        assert!(e.contains(expected), "{fields}: {e}");
    }
    let e = error(
        "rules:\n  - { name: w, match: { source: 0.0.0.0/0 }, key: source/0, limit: { rate: 10, unit: second } }\n",
    );
    assert!(
        e.contains("rules[0].key: source/0 makes one bucket of every source: write `key: all`"),
        "{e}"
    );
    let all = parse("rules:\n  - { name: w, match: { source: 0.0.0.0/0 }, key: all, limit: { rate: 10, unit: second } }\n")
        .expect("key: all");
    assert_eq!(all.rules[0].key, KeyPrefix { v4: 0, v6: 0 });
    assert_eq!(
        all.rules[0].layer7_field(),
        None,
        "enforced at layer 3/4 too"
    );
    // The scope: the key under its rule by default, the source on request;
    // a window rule's key cannot be held by a TAT.
    let set = parse(&rule("match: { source: 10.0.0.0/8 }")).unwrap();
    assert_eq!(set.rules[0].escalate_scope, EscalateScope::Key);
    let set = parse(
        &rule("match: { source: 10.0.0.0/8 }").replace("block: 60s", "block: 60s, scope: source"),
    )
    .unwrap();
    assert_eq!(set.rules[0].escalate_scope, EscalateScope::Source);
    let e = error(&rule(
        "match: { source: 10.0.0.0/8 }, algorithm: fixed_window",
    ));
    assert!(
        e.contains("rules[0].escalate.scope: `key` (the default: the rule's own meter holds the key) needs algorithm gcra"),
        "{e}"
    );
}

#[test]
fn escalation_takes_two_durations_of_a_second_or_more() {
    let rule = |escalate: &str| {
        format!(
            "rules:\n  - {{ name: e, limit: {{ rate: 10, unit: second }}, escalate: {escalate} }}\n"
        )
    };
    let set = parse(&rule("{ after: 10s, block: 10m }")).unwrap();
    let e = set.rules[0].escalate.expect("escalation");
    assert_eq!((e.after_ns, e.block_ns), (10_000_000_000, 600_000_000_000));
    assert_eq!(
        describe::describe(&set.rules[0]).limit,
        "10 pkts/s, burst 10; over it 10s holds the key 10m"
    );
    // Not what the buckets mean: the fingerprint is the rule's without it.
    let plain = parse("rules:\n  - { name: e, limit: { rate: 10, unit: second } }\n").unwrap();
    assert_eq!(plain.rules[0].fingerprint(), set.rules[0].fingerprint());
    for (escalate, expected) in [
        (
            "{ after: 500ms, block: 10m }",
            "rules[0].escalate.after: \"500ms\": at least 1s",
        ),
        (
            "{ after: 10s, block: soon }",
            "rules[0].escalate.block: \"soon\"",
        ),
        ("{ after: 10s }", "block"),
    ] {
        let e = error(&rule(escalate));
        assert!(e.contains(expected), "{escalate}: {e}");
    }
    let e = error(
        "rules:\n  - { name: e, limit: { rate: 10, unit: second, delay: 1s }, escalate: { after: 1s, block: 1s } }\n",
    );
    assert!(
        e.contains("rules[0].escalate: has no effect with limit.delay"),
        "{e}"
    );
    let e = error(&rule("{ after: 1s, block: 400d }"));
    assert!(
        e.contains("rules[0].escalate.block: \"400d\": at most a year"),
        "{e}"
    );
    let e =
        error("rules:\n  - { name: e, limit: unlimited, escalate: { after: 1s, block: 1s } }\n");
    assert!(
        e.contains("rules[0].escalate: has no effect on an unlimited rule"),
        "{e}"
    );
}

/// Guards pacing's conditions (a GCRA packet limit alone) and the
/// escalation policy's fields, read as written.
#[test]
fn pacing_conditions_and_the_escalation_policy() {
    for (fields, what) in [
        (
            "limit: { rate: 10, unit: second, delay: 1s }, algorithm: sliding_window",
            "a window",
        ),
        (
            "limit: { rate: 10, bytes: 1000, unit: second, delay: 1s }",
            "bytes",
        ),
        (
            "limit: { rate: 10, unit: second, delay: 1s }, aggregate: { rate: 100, unit: second }",
            "an aggregate",
        ),
    ] {
        let e = error(&format!("rules:\n  - {{ name: p, {fields} }}\n"));
        assert!(
            e.contains(
                "rules[0].limit.delay: pacing needs a gcra packet limit, without bytes or aggregate"
            ),
            "{what}: {e}"
        );
    }
    parse("rules:\n  - { name: p, limit: { rate: 10, unit: second, delay: 1s } }\n")
        .expect("pacing");
    let set = parse(
        "escalation: { never_block: [ 10.1.2.3/8, \"2001:db8::1/64\" ], max_per_minute: 7 }\nrules: []\n",
    )
    .expect("an escalation policy");
    assert_eq!(set.escalation.max_per_minute, 7);
    assert_eq!(
        set.escalation
            .never_block
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.0.0.0/8", "2001:db8::/64"]
    );
    let e = error("escalation: { max_per_minute: 0 }\nrules: []\n");
    assert!(
        e.contains("escalation.max_per_minute: must be at least 1"),
        "{e}"
    );
    let e = error("escalation: { never_block: [ 10.0.0.0/8, 10.0.0/8 ] }\nrules: []\n");
    assert!(e.contains("escalation.never_block[1]"), "{e}");
}

/// Guards escalation's durations: from a second to a year, both ends
/// included, and each field named when out of range.
#[test]
fn escalation_takes_a_second_to_a_year() {
    let rule = |after: &str, block: &str| {
        format!(
            "rules:\n  - {{ name: e, key: source, limit: {{ rate: 10, unit: second }}, escalate: {{ after: {after}, block: {block} }} }}\n"
        )
    };
    for (after, block) in [("1s", "365days"), ("2days", "1s"), ("1h", "30days")] {
        parse(&rule(after, block)).unwrap_or_else(|e| panic!("{after} {block}: {e}"));
    }
    for (after, block, field) in [
        ("1s", "366days", "escalate.block"),
        ("999ms", "1m", "escalate.after"),
        ("1s", "500ms", "escalate.block"),
        ("400days", "1m", "escalate.after"),
    ] {
        let e = error(&rule(after, block));
        assert!(
            e.contains(&format!("rules[0].{field}")),
            "{after} {block}: {e}"
        );
    }
}
