//! Costs: classes of segments or of requests, and the credits a class may
//! cost within the key's budgets.

use super::common::{error, parse};
use crate::rules::*;

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
    let e = set.kernel_compatible().unwrap_err().to_string();
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
