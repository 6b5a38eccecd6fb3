//! A plain rule's shortcut, and what a key makes only when its rule needs
//! it.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, atomic::Ordering},
};

use super::{Ticks, from, key_state, last_seen, limiter};
use crate::http::clock::SystemClock;

/// A plain rule's shortcut decides as the whole decision does: the
/// same verdicts and fields, at random times and clients (IPv4 ones
/// among the plain keys, IPv6 ones not), the same counts, the same
/// last-seen of every key.
#[test]
fn a_plain_rule_is_judged_as_the_whole_decision_would() {
    let text = "rules:\n  - { name: fast, match: { source: 10.0.0.0/8 }, limit: { rate: 5, unit: second, burst: 3 } }\n  - { name: fast6, match: { source: 2001:db8::/32 }, limit: { rate: 5, unit: second, burst: 3 } }\n  - { name: slow, limit: { rate: 100, unit: minute } }\n";
    let clock = Arc::new(Ticks(1_000_000_000.into()));
    let (shortcut, mut whole) = (limiter(text, clock.clone()), limiter(text, clock.clone()));
    assert!(shortcut.plain.iter().all(Option::is_some));
    whole.plain.fill(None);
    let clients: [IpAddr; 5] = [
        Ipv4Addr::new(10, 0, 0, 1).into(),
        Ipv4Addr::new(10, 0, 0, 2).into(),
        Ipv4Addr::new(192, 0, 2, 1).into(),
        "2001:db8::1".parse().expect("an address"),
        "2001:db9::1".parse().expect("an address"),
    ];
    // By rule: requests refused, passed.
    let (mut seed, mut outcomes) = (7u64, [[0u32; 2]; 3]);
    for _ in 0..2_000 {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        clock
            .0
            .fetch_add((seed >> 33) % 100_000_000, Ordering::Relaxed);
        let request = from(clients[(seed >> 20) as usize % clients.len()]);
        let decision = shortcut.check(&request);
        assert_eq!(decision, whole.check(&request));
        let rule = decision.rule.expect("a rule applies");
        outcomes[rule][usize::from(decision.allowed)] += 1;
    }
    assert!(outcomes.iter().flatten().all(|&n| n > 30), "{outcomes:?}");
    for (a, b) in shortcut.counters.iter().zip(&whole.counters) {
        assert_eq!(
            [a.passed.get(), a.dropped.get(), a.shadow.get()],
            [b.passed.get(), b.dropped.get(), b.shadow.get()]
        );
    }
    for client in clients {
        let seen = last_seen(&shortcut, client);
        assert!(seen.is_some(), "{client} has no state");
        assert_eq!(seen, last_seen(&whole, client), "{client}");
    }
    // The IPv4 clients' keys are the plain ones.
    assert_eq!(shortcut.keys.plain.len(), 3);
    assert_eq!(whole.keys.plain.len(), 0);
    assert_eq!(shortcut.tracked_keys(), 5);
}

/// What only some rules use is made only for their keys, and for an
/// escalation rule's only once the key is over its limit: a plain
/// GCRA key, or one within its limit, stays one cache line.
#[test]
fn a_key_makes_its_cold_part_only_when_its_rule_needs_it() {
    // An IPv6 client's key of a plain rule: one not among the plain
    // keys (which have no cold part at all).
    let text = "rules:\n  - { name: plain, match: { source: 2001:db8::/32 }, limit: { rate: 2, unit: second, burst: 2 } }\n  - { name: watched, limit: { rate: 2, unit: second, burst: 2 }, escalate: { after: 1s, block: 2s } }\n";
    let limiter = limiter(text, Arc::new(SystemClock));
    let (plain, watched) = (
        "2001:db8::1".parse().expect("an address"),
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
    );
    let cold_made =
        |client: IpAddr| key_state(&limiter, client, |state| state.cold.get().is_some());
    // One request of a burst of two: neither key is over its limit.
    for client in [plain, watched] {
        assert!(limiter.check(&from(client)).allowed);
    }
    assert!(!cold_made(plain) && !cold_made(watched));
    // Over it (the third in a burst of two is refused): the watched
    // key keeps a watch, the plain one still nothing.
    for client in [plain, watched, plain, watched] {
        limiter.check(&from(client));
    }
    assert!(!cold_made(plain), "a plain GCRA key made its cold part");
    assert!(cold_made(watched), "escalation's watch was not kept");
}
