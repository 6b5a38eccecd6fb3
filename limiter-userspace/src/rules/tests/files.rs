//! The file's fields and their errors, each with its file, line and
//! field: the examples valid, sources, ports, protocols, units, rates,
//! keys, names and `max_keys` bounded, unknown and duplicate fields.

use super::common::{error, parse};
use crate::rules::*;

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
