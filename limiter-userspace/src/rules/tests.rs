//! The rule file's errors, each with its file, line and field, and what
//! valid files mean.

use std::{path::Path, time::Duration};

use super::*;

fn parse(text: &str) -> Result<RuleSet, InvalidFile> {
    RuleSet::parse(text, Path::new("rules.yaml"))
}

fn error(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

#[test]
fn example_is_valid() {
    let set = parse(EXAMPLE).unwrap();
    assert_eq!(set.rules.len(), 4);
    assert_eq!(set.rules[1].key, KeyPrefix { v4: 32, v6: 64 });
    let Limit::Metered {
        packets: Some(m),
        bytes: None,
    } = set.rules[0].limit
    else {
        panic!("rule 0 limits packets")
    };
    assert_eq!(
        (m.rate, m.burst, m.gcra.emission_ns),
        (1000, 100, 1_000_000)
    );
    assert!(set.rules[2].shadow);
}

#[test]
fn issue_example_is_valid() {
    let set = parse(
        r#"default: pass
rules:
  - name: dns-clients
    match: { source: 10.0.0.0/8, protocol: udp, dest_port: 53 }
    key: source
    limit: { rate: 1000, unit: second, burst: 100 }
    action: drop
  - name: bulk
    match: { source: "2001:db8::/32" }
    key: source/64
    limit: { bytes: 10485760, unit: second, burst_bytes: 1048576 }
  - name: office
    match: { source: 192.168.0.0/16 }
    limit: unlimited
"#,
    )
    .unwrap();
    assert_eq!(set.rules[0].matches.dest_port, Some(53));
    assert_eq!(set.rules[2].limit, Limit::Unlimited);
}

#[test]
fn burst_defaults_to_rate_and_units_accept_durations() {
    let set = parse("rules:\n  - { name: a, limit: { rate: 10, unit: 30s } }\n").unwrap();
    let Limit::Metered {
        packets: Some(m), ..
    } = set.rules[0].limit
    else {
        panic!()
    };
    assert_eq!((m.burst, m.gcra.emission_ns), (10, 3_000_000_000));
}

#[test]
fn bad_cidr_names_line_and_field() {
    let e = error("rules:\n  - name: a\n    match: { source: 10.0.0/8 }\n    limit: unlimited\n");
    assert!(
        e.starts_with("rules.yaml:3: rules[0].match.source: "),
        "{e}"
    );
}

#[test]
fn host_bits_are_rejected() {
    let e =
        error("rules:\n  - name: a\n    match:\n      source: 10.0.0.1/8\n    limit: unlimited\n");
    assert_eq!(
        e,
        "rules.yaml:4: rules[0].match.source: 10.0.0.1/8 has host bits set; did you mean 10.0.0.0/8?"
    );
}

#[test]
fn zero_and_overflowing_rates() {
    let e = error("rules:\n  - name: a\n    limit:\n      rate: 0\n      unit: second\n");
    assert_eq!(
        e,
        "rules.yaml:4: rules[0].limit.rate: rate must be at least 1"
    );
    let e = error("rules:\n  - name: a\n    limit: { rate: 2000000000, unit: second }\n");
    assert!(
        e.contains("rules[0].limit.rate: rate exceeds one per nanosecond"),
        "{e}"
    );
    let e = error(
        "rules:\n  - name: a\n    limit: { rate: 1, burst: 18446744073709551615, unit: day }\n",
    );
    assert!(
        e.starts_with("rules.yaml:3: rules[0].limit.rate: burst"),
        "{e}"
    );
}

#[test]
fn unknown_field_is_rejected() {
    let e = error("rules:\n  - name: a\n    limit: { rate: 1, unit: second, brust: 5 }\n");
    assert!(
        e.starts_with("rules.yaml:3: rules[0].limit: unknown field `brust`"),
        "{e}"
    );
    let e = error("defualt: drop\n");
    assert!(
        e.starts_with("rules.yaml:1: unknown field `defualt`"),
        "{e}"
    );
}

#[test]
fn duplicate_name_and_match() {
    let e = error(
        "rules:\n  - { name: a, limit: unlimited }\n  - name: a\n    match: { source: 10.0.0.0/8 }\n    limit: unlimited\n",
    );
    assert_eq!(
        e,
        "rules.yaml:3: rules[1].name: duplicate name \"a\" (also rules[0])"
    );
    let e = error(
        "rules:\n  - { name: a, match: { source: 10.0.0.0/8 }, limit: unlimited }\n  - name: b\n    match: { source: 10.0.0.0/8 }\n    limit: { rate: 1, unit: second }\n",
    );
    assert!(
        e.starts_with("rules.yaml:4: rules[1].match: same match as rules[0]"),
        "{e}"
    );
}

#[test]
fn ambiguous_and_oversized_keys() {
    let e = error("rules:\n  - { name: a, key: source/24, limit: { rate: 1, unit: second } }\n");
    assert!(
        e.contains("rules[0].key: source/24 needs match.source"),
        "{e}"
    );
    let e = error(
        "rules:\n  - { name: a, match: { source: 10.0.0.0/8 }, key: source/33, limit: { rate: 1, unit: second } }\n",
    );
    assert!(
        e.contains("rules[0].key: /33 is longer than an IPv4 address"),
        "{e}"
    );
}

#[test]
fn port_needs_a_port_protocol() {
    let e = error(
        "rules:\n  - { name: a, match: { protocol: icmp, dest_port: 1 }, limit: unlimited }\n",
    );
    assert!(
        e.contains("rules[0].match.dest_port: needs protocol tcp, udp or sctp"),
        "{e}"
    );
}

#[test]
fn bad_unit_and_missing_rate() {
    let e = error("rules:\n  - { name: a, limit: { rate: 1, unit: fortnight } }\n");
    assert!(
        e.contains("rules[0].limit.unit: \"fortnight\": expected second"),
        "{e}"
    );
    let e = error("rules:\n  - { name: a, limit: { burst: 5, unit: second } }\n");
    assert!(
        e.contains("rules[0].limit.burst: given without `rate`"),
        "{e}"
    );
}

#[test]
fn too_many_rules_cover_one_prefix() {
    let mut text = String::from("rules:\n");
    for port in 1..=9 {
        text += &format!(
            "  - {{ name: p{port}, match: {{ source: 10.0.0.0/8, protocol: tcp, dest_port: {port} }}, limit: unlimited }}\n"
        );
    }
    let e = error(&text);
    assert!(e.contains("9 rules cover 10.0.0.0/8; at most 8"), "{e}");
    // Eight fit.
    let eight: String = text.lines().take(9).map(|l| format!("{l}\n")).collect();
    assert_eq!(parse(&eight).expect("eight rules").rules.len(), 8);
}

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

const LAYER7: &str = r#"rules:
  - name: login
    match: { method: [post, PUT], host: API.example.com, path: /v1/login }
    key: [source, header:x-api-key]
    limit: { rate: 5, unit: minute }
  - name: free-tier
    match:
      path_prefix: /v1/
      headers:
        - { name: x-tier, equals: free }
        - { name: x-debug, present: false }
    key: header:x-api-key
    limit: { rate: 100, unit: second }
  - name: per-path
    match: { source: 10.0.0.0/8 }
    key: [source, path]
    limit: { rate: 10, unit: second }
"#;

#[test]
fn layer7_fields_are_read_and_tried_most_specific_first() {
    use crate::rules::request::{HeaderCondition, PathMatch};
    let set = parse(LAYER7).unwrap();
    let login = &set.rules[0];
    assert_eq!(
        login.request.methods,
        [http::Method::POST, http::Method::PUT]
    );
    assert_eq!(login.request.host.as_deref(), Some("api.example.com"));
    assert_eq!(
        login.request.path,
        Some(PathMatch::Exact("/v1/login".into()))
    );
    assert_eq!(login.key.v4, 32);
    assert_eq!(login.keyed_by.len(), 2);
    let free = &set.rules[1];
    assert_eq!(
        free.request.headers[1].condition,
        HeaderCondition::Absent,
        "present: false"
    );
    assert_eq!(
        free.keyed_by,
        [KeyPart::Header(http::HeaderName::from_static("x-api-key"))]
    );
    // Three conditions, then two, then none (whatever the source).
    assert_eq!(matching::match_order(&set), [0, 1, 2]);
    let described = describe::describe(login);
    assert_eq!(
        described.matches,
        "any source POST|PUT host api.example.com path /v1/login"
    );
    assert_eq!(described.key, "/32 v4, /128 v6 + header:x-api-key");
    // A rule's layer-7 fields are in its fingerprint: changed, its
    // buckets start over.
    let other = parse(&LAYER7.replace("/v1/login", "/v1/logout")).unwrap();
    assert_ne!(login.fingerprint(), other.rules[0].fingerprint());
}

#[test]
fn the_kernel_refuses_layer7_fields_and_keys() {
    let e = parse(LAYER7).unwrap().kernel_compatible().unwrap_err();
    assert!(
        e.contains("rules[0] (\"login\"): match.method (a request's field) works at layer 7 only"),
        "{e}"
    );
    let keyed = "rules:\n  - { name: p, key: [source, path], limit: { rate: 1, unit: second } }\n";
    let e = parse(keyed).unwrap().kernel_compatible().unwrap_err();
    assert!(
        e.contains("key source + path (a request's fields) works at layer 7 only"),
        "{e}"
    );
    let plain = "rules:\n  - { name: p, key: source/24, match: { source: 10.0.0.0/8 }, limit: { rate: 1, unit: second } }\n";
    assert_eq!(parse(plain).unwrap().kernel_compatible(), Ok(()));
}

#[test]
fn bad_layer7_fields_name_their_line_and_field() {
    let rule = |fields: &str| {
        format!("rules:\n  - name: r\n    {fields}\n    limit: {{ rate: 1, unit: second }}\n")
    };
    let cases = [
        (
            "match: { method: \"GE T\", path: /a }",
            "rules[0].match.method: \"GE T\": not a method",
        ),
        (
            "match: { method: [] }",
            "rules[0].match.method: an empty list matches nothing",
        ),
        (
            "match: { host: \"example.com:80\" }",
            "rules[0].match.host: \"example.com:80\": expected a host name without a port",
        ),
        (
            "match: { path: v1 }",
            "rules[0].match.path: \"v1\": expected a path starting with /",
        ),
        (
            "match: { path: /a, path_prefix: /b }",
            "rules[0].match.path_prefix: give `path` (exact) or `path_prefix`, not both",
        ),
        (
            "match: { headers: [{ name: \"x y\" }] }",
            "rules[0].match.headers[0].name: \"x y\": not a header name",
        ),
        (
            "match: { headers: [{ name: x, equals: a, present: true }] }",
            "rules[0].match.headers[0].present: give `equals` or `present`, not both",
        ),
        (
            "key: [path, cookie]",
            "rules[0].key: \"cookie\": expected source, source/N, header:NAME, path, method, host or all",
        ),
        (
            "key: [source, source/24]",
            "rules[0].key: source: named twice",
        ),
    ];
    for (fields, expected) in cases {
        let e = error(&rule(fields));
        assert!(e.contains(expected), "{fields}: {e}");
        assert!(e.contains("rules.yaml:3"), "{fields}: no line 3 in {e}");
    }
    // Two rules that ask the same of a request cannot both apply.
    let twice = "rules:\n  - { name: a, match: { path: /x }, limit: { rate: 1, unit: second } }\n  - { name: b, match: { path: /x }, limit: { rate: 2, unit: second } }\n";
    assert!(error(twice).contains("same match as rules[0]"));
    let differ = twice.replace(
        "{ path: /x }, limit: { rate: 2",
        "{ path: /y }, limit: { rate: 2",
    );
    assert!(parse(&differ).is_ok());
}

/// Of rules with the same match, the first that can key a request applies
/// (a request without a header a rule is keyed by skips it): a rule after
/// one that keys every request it could is refused; one that keys requests
/// the rules before it skip is not.
#[test]
fn a_rule_of_the_same_match_is_refused_only_when_it_could_never_apply() {
    let with = |matches: &str, keys: &[&str]| {
        let mut text = String::from("rules:\n");
        for (i, key) in keys.iter().enumerate() {
            text.push_str(&format!(
                "  - {{ name: r{i}, match: {{ {matches} }}, key: {key}, limit: {{ rate: 1, unit: second }} }}\n"
            ));
        }
        text
    };
    let file = |keys: &[&str]| with("path_prefix: /api/", keys);
    for text in [
        file(&["header:x-user", "source"]),
        file(&["[header:x-a, header:x-b]", "header:x-a", "source"]),
        file(&["[source, header:x-a]", "[source, host]", "source"]),
        file(&["host", "source"]),
        // Without layer-7 conditions, a caller that tells addresses alone
        // gives no path: the rule keyed by the address takes it.
        with("source: 10.0.0.0/8", &["path", "source"]),
        with(
            "headers: [{ name: x-a, present: false }]",
            &["header:x-b", "source"],
        ),
        // A header the match requires says nothing of another header.
        with(
            "headers: [{ name: x-b, present: true }]",
            &["header:x-a", "source"],
        ),
    ] {
        let set = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(set.rules.len() >= 2);
    }
    for (text, refused, first) in [
        (file(&["source", "header:x-user"]), 1, 0),
        (file(&["header:x-user", "header:x-user"]), 1, 0),
        (file(&["header:x-a", "[header:x-a, header:x-b]"]), 1, 0),
        (
            file(&["header:x-a", "header:x-b", "[header:x-b, header:x-c]"]),
            2,
            1,
        ),
        (file(&["[source, header:x-a]", "[header:x-a, path]"]), 1, 0),
        // Every request under a layer-7 condition has a path and a method.
        (file(&["path", "source"]), 1, 0),
        (file(&["[method, path]", "header:x-a"]), 1, 0),
        (with("source: 10.0.0.0/8", &["path", "header:x-a"]), 1, 0),
        // A header or host the match requires is always there.
        (
            with(
                "headers: [{ name: x-a, present: true }]",
                &["header:x-a", "source"],
            ),
            1,
            0,
        ),
        (
            with(
                "headers: [{ name: x-a, equals: v }]",
                &["header:x-a", "source"],
            ),
            1,
            0,
        ),
        (with("host: example.com", &["host", "source"]), 1, 0),
    ] {
        let e = error(&text);
        assert!(
            e.contains(&format!(
                "rules[{refused}].match: same match as rules[{first}] (\"r{first}\"), which keys every request this one could"
            )),
            "{text}: {e}"
        );
    }
}

#[test]
fn concurrency_limits_are_layer7_and_at_least_one() {
    let set =
        parse("rules:\n  - { name: d, key: header:x-user, limit: unlimited, concurrent: 3 }\n")
            .unwrap();
    assert_eq!(set.rules[0].concurrent, Some(3));
    assert_eq!(describe::describe(&set.rules[0]).limit, "3 in flight");
    let alone = parse("rules:\n  - { name: d, limit: { rate: 5, unit: second }, concurrent: 3 }\n")
        .unwrap();
    let e = alone.kernel_compatible().unwrap_err();
    assert!(
        e.contains("concurrent (requests in flight) works at layer 7 only"),
        "{e}"
    );
    let e = error("rules:\n  - { name: d, limit: unlimited, concurrent: 0 }\n");
    assert!(e.contains("rules[0].concurrent: must be at least 1"), "{e}");
    let e = error("rules:\n  - { name: d, key: path, limit: unlimited }\n");
    assert!(
        e.contains("rules[0].key: has no effect on an unlimited rule"),
        "{e}"
    );
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

#[test]
fn tcp_flags_name_flags_set_and_clear_on_tcp_rules() {
    let rule = |flags: &str| {
        format!(
            "rules:\n  - {{ name: t, match: {{ protocol: tcp, tcp_flags: \"{flags}\" }}, limit: {{ rate: 10, unit: second }} }}\n"
        )
    };
    let set = parse(&rule("syn,!ack")).unwrap();
    let flags = set.rules[0].matches.tcp_flags.expect("flags");
    assert_eq!((flags.mask, flags.value), (0x12, 0x02));
    assert_eq!(flags.text(), "syn,!ack");
    assert_eq!(
        describe::describe(&set.rules[0]).matches,
        "any source tcp flags syn,!ack"
    );
    for (flags, expected) in [
        (
            "syn,!akc",
            "rules[0].match.tcp_flags: \"syn,!akc\": \"akc\" is not a TCP flag",
        ),
        ("syn,!syn", "syn named twice"),
    ] {
        let e = error(&rule(flags));
        assert!(e.contains(expected), "{flags}: {e}");
    }
    let e = error(
        "rules:\n  - { name: t, match: { protocol: udp, tcp_flags: syn }, limit: { rate: 1, unit: second } }\n",
    );
    assert!(
        e.contains("rules[0].match.tcp_flags: needs protocol tcp"),
        "{e}"
    );
    // More specific than the same rule without flags, whatever the order.
    let set = parse(
        "rules:\n  - { name: all-tcp, match: { protocol: tcp }, limit: { rate: 100, unit: second } }\n  - { name: syns, match: { protocol: tcp, tcp_flags: syn }, limit: { rate: 1, unit: second } }\n",
    )
    .unwrap();
    let order = matching::match_order(&set);
    let source = "198.51.100.1".parse().unwrap();
    let rule_of = |flags| matching::first_match(&set, &order, source, 6, Some(22), flags);
    assert_eq!(rule_of(Some(0x02)), Some(1));
    assert_eq!(rule_of(Some(0x10)), Some(0));
    assert_eq!(
        rule_of(None),
        Some(0),
        "unknown flags never match a flags rule"
    );
}

#[test]
fn costs_are_classes_of_segments_or_of_requests() {
    let rule = |cost: &str| {
        format!(
            "rules:\n  - {{ name: c, limit: {{ rate: 100, unit: second, burst: 20 }}, cost: {cost} }}\n"
        )
    };
    let set = parse(&rule(
        "[ { match: { tcp_flags: \"syn,!ack\" }, credits: 10 }, { match: { method: POST }, credits: 5 } ]",
    ))
    .unwrap();
    let r = &set.rules[0];
    assert_eq!(r.costs.len(), 2);
    assert_eq!(
        describe::describe(r).limit,
        "100 pkts/s, burst 20 (credits: flags syn,!ack = 10, POST = 5, else 1)"
    );
    let e = set.kernel_compatible().unwrap_err();
    assert!(e.contains("cost (by a request's fields)"), "{e}");
    let kernel = parse(&rule("[ { match: { tcp_flags: syn }, credits: 20 } ]")).unwrap();
    assert!(kernel.kernel_compatible().is_ok());
    assert!(kernel.rules[0].costs[0].holds_packet(Some(0x12)));
    assert!(
        !kernel.rules[0].costs[0].holds_packet(None),
        "not a TCP segment"
    );
    for (cost, expected) in [
        (
            "[ { match: { tcp_flags: syn }, credits: 21 } ]",
            "rules[0].cost[0].credits: 21: from 1 to 20",
        ),
        (
            "[ { match: { tcp_flags: syn }, credits: 0 } ]",
            "rules[0].cost[0].credits: 0: from 1 to 20",
        ),
        (
            "[ { match: { }, credits: 2 } ]",
            "rules[0].cost[0].match: names no class",
        ),
        (
            "[ { match: { tcp_flags: syn, method: GET }, credits: 2 } ]",
            "not both",
        ),
        (
            "[ { match: { protocol: tcp }, credits: 2 } ]",
            "rules[0].cost[0].match.protocol: a class is told by",
        ),
        (
            "[ { match: { tcp_flags: sin }, credits: 2 } ]",
            "rules[0].cost[0].match.tcp_flags:",
        ),
        ("[]", "rules[0].cost: 1 to 4 classes"),
    ] {
        let e = error(&rule(cost));
        assert!(e.contains(expected), "{cost}: {e}");
    }
    // A soft limit is a budget too: a class over its burst is always over it.
    let e = error(
        "rules:\n  - { name: c, limit: { rate: 100, unit: second, burst: 20 }, soft: { rate: 50, unit: second, burst: 5 }, cost: [ { match: { tcp_flags: syn }, credits: 6 } ] }\n",
    );
    assert!(
        e.contains("rules[0].cost[0].credits: 6: from 1 to 5"),
        "{e}"
    );
    let e = error(
        "rules:\n  - { name: c, limit: { bytes: 100, unit: second }, cost: [ { match: { tcp_flags: syn }, credits: 2 } ] }\n",
    );
    assert!(e.contains("rules[0].cost: needs a packet limit"), "{e}");
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

/// The index finds the rule a search of every rule in order finds, on
/// random rule files (sources of every length of both families, any
/// source, ports, methods, hosts, exact paths and path prefixes, header
/// keys)
/// and requests in and out of them.
#[test]
fn the_rule_index_finds_the_rule_the_search_in_order_finds() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut requests: Vec<(http::Method, http::Uri, http::HeaderMap)> = Vec::new();
    for method in [http::Method::GET, http::Method::POST] {
        for path in ["/", "/x", "/xy", "/a", "/a/", "/a/b", "/a/bc", "/é/b"] {
            for (user, host) in [
                (None, None),
                (Some("u1"), None),
                (None, Some("h.example")),
                (Some("u1"), Some("H.Example:8080")),
                (None, Some("other.example")),
            ] {
                let mut headers = http::HeaderMap::new();
                if let Some(user) = user {
                    headers.insert("x-user", user.parse().unwrap());
                }
                if let Some(host) = host {
                    headers.insert(http::header::HOST, host.parse().unwrap());
                }
                requests.push((method.clone(), path.parse().unwrap(), headers));
            }
        }
    }
    let (mut found, mut files) = ([0usize; 2], 0);
    for _ in 0..600 {
        let mut text = String::from("rules:\n");
        for r in 0..1 + next(12) {
            let net = match next(6) {
                0 => None,
                1 => Some(format!("10.{}.{}.0/{}", next(3), next(4), 8 + next(25))),
                2 => Some(format!("2001:db8:{:x}::/{}", next(3), 32 + next(97))),
                3 => Some(
                    ["0.0.0.0/0", "::/0", "8.0.0.0/5", "2000::/3"][next(4) as usize].to_owned(),
                ),
                4 => Some(format!("10.{}.{}.{}/32", next(3), next(4), next(4))),
                _ => Some(format!("10.{}.0.0/16", next(3))),
            };
            // Without host bits, as validation wants.
            let source = net.map_or(String::new(), |net| {
                let net: ipnet::IpNet = net.parse().expect("a prefix");
                format!("source: {}, ", net.trunc())
            });
            let (protocol, port) = match next(4) {
                0 => ("", ""),
                1 => ("protocol: udp, ", ""),
                _ => (
                    "protocol: tcp, ",
                    ["", "dest_port: 80, ", "dest_port: 443, "][next(3) as usize],
                ),
            };
            let method = ["", "", "method: POST, "][next(3) as usize];
            let host = ["", "", "host: h.example, ", "host: other.example, "][next(4) as usize];
            let path = [
                "",
                "",
                "path_prefix: /x, ",
                "path_prefix: /, ",
                "path_prefix: /a/, ",
                "path_prefix: /a/b, ",
                "path_prefix: /é, ",
                "path: /x, ",
                "path: /a/b, ",
            ][next(9) as usize];
            let key = ["", "", "key: [source, path], ", "key: header:x-user, "][next(4) as usize];
            text.push_str(&format!(
                "  - {{ name: r{r}, match: {{ {source}{protocol}{port}{method}{host}{path} }}, {key}limit: {{ rate: 1, unit: second }} }}\n"
            ));
        }
        // A catch-all in a third of the files (the index asks only the
        // rules before it), TCP's alone in some.
        let catch_all = ["", "", "", "protocol: tcp"][next(4) as usize];
        if next(3) == 0 {
            text.push_str(&format!(
                "  - {{ name: all, match: {{ {catch_all} }}, limit: {{ rate: 1, unit: second }} }}\n"
            ));
        }
        // (Files where a rule could never apply are refused.)
        let Ok(set) = parse(&text) else { continue };
        files += 1;
        let index = matching::RequestRules::new(&set);
        let order = matching::match_order(&set);
        for _ in 0..200 {
            let source: std::net::IpAddr = match next(3) {
                0 => std::net::Ipv4Addr::new(10, next(4) as u8, next(5) as u8, next(256) as u8)
                    .into(),
                1 => std::net::Ipv4Addr::from(next(1 << 32) as u32).into(),
                _ => {
                    let mut bits = 0x2001_0db8u128 << 96 | u128::from(next(4)) << 80;
                    bits |= u128::from(next(u64::MAX)) * u128::from(next(2));
                    std::net::Ipv6Addr::from(bits).into()
                }
            };
            let port = [None, Some(80), Some(443)][next(3) as usize];
            let request = match next(4) {
                0 => None,
                _ => {
                    let (method, uri, headers) = &requests[next(requests.len() as u64) as usize];
                    Some(HttpRequest {
                        method,
                        uri,
                        headers,
                    })
                }
            };
            let expected =
                matching::first_request_match(&set, &order, source, port, request.as_ref());
            assert_eq!(
                index.first(&set, &source, &port, request.as_ref()),
                expected,
                "{source} port {port:?} {request:?} under\n{text}"
            );
            found[usize::from(expected.is_some())] += 1;
        }
    }
    // Many files, both outcomes often.
    assert!(files > 100, "{files} files");
    assert!(found.iter().all(|&n| n > 5_000), "{found:?}");
}

/// Guards the protocol's spellings (each name its number, a number as it
/// is, 255 refused: the kernel's "unknown protocol") and the words that
/// say what a field of the wrong kind should have been.
#[test]
fn protocols_are_named_or_numbered_and_wrong_kinds_say_what_is_expected() {
    for (spelled, number) in [
        ("tcp", 6),
        ("udp", 17),
        ("icmp", 1),
        ("icmpv6", 58),
        ("sctp", 132),
        ("47", 47),
        ("0", 0),
        ("254", 254),
    ] {
        let set = parse(&format!(
            "rules:\n  - {{ name: a, match: {{ protocol: {spelled} }}, limit: unlimited }}\n"
        ))
        .unwrap_or_else(|e| panic!("{spelled}: {e}"));
        assert_eq!(set.rules[0].matches.protocol, Some(number), "{spelled}");
    }
    let protocols = "tcp, udp, icmp, icmpv6, sctp or a protocol number 0-254 (255 is reserved)";
    for wrong in ["255", "256", "gre", "TCP"] {
        let e = error(&format!(
            "rules:\n  - {{ name: a, match: {{ protocol: {wrong} }}, limit: unlimited }}\n"
        ));
        assert!(
            e.contains("rules[0].match.protocol") && e.contains(protocols),
            "{wrong}: {e}"
        );
    }
    let e = error("rules:\n  - { name: a, key: 5, limit: unlimited }\n");
    assert!(e.contains("a string or a list of strings"), "{e}");
    let e = error("rules:\n  - { name: a, limit: 5 }\n");
    assert!(
        e.contains("`unlimited` or a mapping such as { rate: 100, unit: second }"),
        "{e}"
    );
}

/// Guards the bounds of a rule's name (1 to 31 bytes: the kernel's field
/// holds 32 with its NUL) and of `max_keys` (at most 2^30), each named in
/// its error.
#[test]
fn names_and_max_keys_are_bounded() {
    let named = |name: &str| format!("rules:\n  - {{ name: \"{name}\", limit: unlimited }}\n");
    parse(&named(&"n".repeat(31))).expect("31 bytes");
    parse(&named("n")).expect("1 byte");
    for name in [String::new(), "n".repeat(32)] {
        let e = error(&named(&name));
        assert!(
            e.contains("rules[0].name: must be 1 to 31 bytes long"),
            "{name:?}: {e}"
        );
    }
    let keys = |n: u64| format!("max_keys: {n}\nrules: []\n");
    assert_eq!(parse(&keys(1 << 30)).expect("2^30 keys").max_keys, 1 << 30);
    let e = error(&keys((1 << 30) + 1));
    assert!(
        e.contains("max_keys: 1073741825 keys; at most 1073741824"),
        "{e}"
    );
}

/// Guards the bounds of what a key and a rule may hold: three limits are
/// accepted and four refused; four cost classes accepted and five
/// refused; the credits a class may cost are bounded by the key's packet
/// budgets, a third limit's among them only when it counts packets.
#[test]
fn limits_classes_and_credits_are_bounded() {
    let rule = |fields: &str| format!("rules:\n  - {{ name: k, {fields} }}\n");
    parse(&rule(
        "limits: [ { rate: 10, unit: second }, { rate: 5, unit: minute }, { rate: 3, unit: hour } ]",
    ))
    .expect("three limits");
    let e = error(&rule(
        "limits: [ { rate: 10, unit: second }, { rate: 5, unit: minute }, { rate: 3, unit: hour }, { rate: 2, unit: day } ]",
    ));
    assert!(e.contains("one to three limits per key"), "{e}");
    let classes = |n: usize| {
        let class = "{ match: { tcp_flags: syn }, credits: 2 }";
        rule(&format!(
            "limit: {{ rate: 100, unit: second }}, cost: [ {} ]",
            vec![class; n].join(", ")
        ))
    };
    assert_eq!(
        parse(&classes(4)).expect("four classes").rules[0]
            .costs
            .len(),
        4
    );
    let e = error(&classes(5));
    assert!(e.contains("rules[0].cost: 1 to 4 classes"), "{e}");
    // Burst 50 and a third limit of 3 bytes a second: a class may cost
    // 10 credits (bytes are no packet budget).
    let third = |limit: &str, credits: u64| {
        rule(&format!(
            "limits: [ {{ rate: 100, burst: 50, bytes: 100000, unit: second }}, {limit} ], cost: [ {{ match: {{ tcp_flags: syn }}, credits: {credits} }} ]"
        ))
    };
    parse(&third("{ bytes: 3, unit: second }", 10)).expect("a byte limit");
    // Three limits, the third of 3 bytes an hour: no packet budget.
    parse(&rule(
        "limits: [ { rate: 100, burst: 50, unit: second }, { rate: 60, unit: minute }, { bytes: 3, unit: hour } ], cost: [ { match: { tcp_flags: syn }, credits: 10 } ]",
    ))
    .expect("a byte third limit");
    // Three packet limits, the third of 4 an hour: 4 credits at most.
    let e = error(&rule(
        "limits: [ { rate: 100, burst: 50, unit: second }, { rate: 60, unit: minute }, { rate: 4, unit: hour } ], cost: [ { match: { tcp_flags: syn }, credits: 10 } ]",
    ));
    assert!(
        e.contains("rules[0].cost[0].credits: 10: from 1 to 4"),
        "{e}"
    );
    // A window key holds a packet and a byte rate, not two byte rates.
    parse(&rule(
        "algorithm: fixed_window, limits: [ { rate: 10, unit: second }, { bytes: 1000, unit: second } ]",
    ))
    .expect("a window key's packet and byte rates");
    let e = error(&rule(
        "algorithm: fixed_window, limits: [ { bytes: 10, unit: second }, { bytes: 1000, unit: minute } ]",
    ));
    assert!(e.contains("a window key holds two meters"), "{e}");
    // A third limit of 4 packets a second: 4 at most.
    parse(&third("{ rate: 4, unit: second }", 4)).expect("4 credits");
    let e = error(&third("{ rate: 4, unit: second }", 10));
    assert!(
        e.contains("rules[0].cost[0].credits: 10: from 1 to 4"),
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
