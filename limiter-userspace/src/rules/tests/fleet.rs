//! Fleet-wide aggregates: what they mean, their fields checked, their
//! bounds (and a key prefix's length).

use super::common::{error, parse};
use crate::rules::*;

#[test]
fn fleet_aggregates() {
    let file = |partitions: u32| {
        format!(
            "rules:
  - name: edge
    match: {{ source: 198.51.100.0/24 }}
    limit: {{ rate: 1000, unit: second }}
    aggregate: {{ rate: 50000, unit: second, burst: 500, scope: fleet, partitions: {partitions}, reserve: 1000 }}
  - name: local
    match: {{ source: 10.0.0.0/8 }}
    limit: {{ rate: 10, unit: second }}
    aggregate: {{ rate: 30, unit: second }}
"
        )
    };
    let set = parse(&file(50)).unwrap();
    assert_eq!(
        set.rules[0].fleet,
        Some(FleetShare {
            partitions: 50,
            reserve: 1000
        })
    );
    assert_eq!(set.rules[1].fleet, None);
    let whole = set.rules[0].aggregate.unwrap().packets.unwrap();
    // A fifth of the rate: a fifth of the burst, the same period.
    let fifth = whole.share(10_000);
    assert_eq!(
        (fifth.rate, fifth.burst, fifth.period),
        (10_000, 100, whole.period)
    );
    assert_eq!(fifth.gcra.emission_ns, 100_000);
    assert_eq!(whole.share(1).burst, 1, "never a burst of zero while open");
    assert_eq!(whole.share(0).gcra, limiter_common::gcra::Gcra::CLOSED);
    // Partitions and reserve are part of what the buckets mean.
    let other = parse(&file(25)).unwrap();
    assert_ne!(other.rules[0].fingerprint(), set.rules[0].fingerprint());
}

#[test]
fn fleet_fields_are_checked() {
    let rule = |aggregate: &str| {
        format!(
            "rules:\n  - name: a\n    limit: {{ rate: 10, unit: second }}\n    aggregate: {aggregate}\n"
        )
    };
    let window = "rules:\n  - name: a\n    algorithm: fixed_window\n    limit: { rate: 10, unit: second }\n    aggregate: { rate: 100, unit: second, scope: fleet }\n";
    // (file, what the error must say)
    let cases = [
        (
            rule("{ rate: 100, unit: second, partitions: 5 }"),
            &[
                "rules.yaml:4:",
                "rules[0].aggregate.partitions",
                "scope: fleet",
            ][..],
        ),
        (
            rule("{ rate: 100, unit: second, scope: fleet, partitions: 101 }"),
            &["aggregate.partitions", "must be 1 to 100"],
        ),
        (
            rule("{ rate: 100, unit: second, scope: fleet, reserve: 101 }"),
            &["aggregate.reserve", "more than the fleet"],
        ),
        (
            rule("{ bytes: 100, unit: second, scope: fleet }"),
            &["aggregate.scope", "give `rate`"],
        ),
        (
            rule("{ rate: 100, bytes: 100, unit: second, scope: fleet }"),
            &["aggregate.bytes"],
        ),
        (window.to_owned(), &["aggregate.scope", "gcra"]),
        (
            rule("{ rate: 100, unit: second, scope: galaxy }"),
            &["galaxy"],
        ),
        (
            "rules:\n  - name: a\n    limit: { rate: 10, unit: second, scope: fleet }\n".to_owned(),
            &["rules[0].limit.scope", "aggregate"],
        ),
        (
            "new_keys: { rate: 10, unit: second, reserve: 3 }\n".to_owned(),
            &["new_keys.reserve"],
        ),
    ];
    for (file, says) in cases {
        let e = error(&file);
        assert!(
            says.iter().all(|s| e.contains(s)),
            "{e}\nshould say {says:?}"
        );
    }
}

/// Guards the fleet fields' bounds, both ends: 1 to min(rate, 1000)
/// partitions, a reserve up to the whole rate, and a node's largest share
/// (rate + reserve) a valid meter; and a key prefix no longer than its
/// family's address.
#[test]
fn fleet_bounds_and_key_lengths() {
    let rule = |aggregate: &str| {
        format!(
            "rules:\n  - {{ name: a, limit: {{ rate: 10, unit: second }}, aggregate: {{ scope: fleet, {aggregate} }} }}\n"
        )
    };
    for ok in [
        "rate: 100, unit: second, partitions: 100",
        "rate: 5000, unit: second, partitions: 1000",
        "rate: 100, unit: second, partitions: 1",
        "rate: 100, unit: second, reserve: 100",
        // 10,000 per ms at most: a share's meter of one per 100 ns.
        "rate: 5000, unit: 1ms, reserve: 5000",
    ] {
        let set = parse(&rule(ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
        assert!(set.rules[0].fleet.is_some(), "{ok}");
    }
    for (wrong, says) in [
        (
            "rate: 100, unit: second, partitions: 0",
            "aggregate.partitions: 0: must be 1 to 100",
        ),
        (
            "rate: 5000, unit: second, partitions: 1001",
            "must be 1 to 1000",
        ),
        (
            "rate: 100, unit: second, partitions: 101",
            "must be 1 to 100",
        ),
        (
            "rate: 100, unit: second, reserve: 101",
            "aggregate.reserve: 101 per unit",
        ),
        (
            "rate: 600000, unit: 1ms, reserve: 600000, partitions: 10",
            "aggregate.reserve: rate exceeds one per nanosecond",
        ),
    ] {
        let e = error(&rule(wrong));
        assert!(e.contains(says), "{wrong}: {e}");
    }
    for (key, says) in [
        (
            "{ source: 10.0.0.0/8 }, key: source/33",
            "/33 is longer than an IPv4 address",
        ),
        (
            "{ source: \"2001:db8::/32\" }, key: source/129",
            "/129 is longer than an IPv6 address",
        ),
    ] {
        let e = error(&format!(
            "rules:\n  - {{ name: k, match: {key}, limit: {{ rate: 1, unit: second }} }}\n"
        ));
        assert!(e.contains(says), "{key}: {e}");
    }
    let set = parse(
        "rules:\n  - { name: k, match: { source: \"2001:db8::/32\" }, key: source/128, limit: { rate: 1, unit: second } }\n",
    )
    .expect("a /128 key");
    assert_eq!(set.rules[0].key.v6, 128);
}
