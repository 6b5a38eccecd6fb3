//! The layer-7 key store: who it forgets and who it never forgets, mapped
//! addresses, keys at rest, and shadow rules.

use std::sync::{Arc, atomic::Ordering};

use limiter::http::Limiter;
use limiter_tests::{TestClock, rules};

/// Whether `limiter` admits a request from client `client` (10.0.0.0
/// plus `client`) at `t` ns.
fn admitted(limiter: &Limiter, clock: &TestClock, client: u32, t: u64) -> bool {
    clock.0.store(t, Ordering::SeqCst);
    limiter
        .check(&limiter::http::RequestMeta {
            client: std::net::Ipv4Addr::from(0x0a00_0000 + client).into(),
            port: None,
            key: None,
            bytes: 0,
            http: None,
        })
        .allowed
}

/// Guards the key store against churn: 1,000 other clients cannot make it
/// forget a client in debt (before, 1,001 addresses evicted a limited
/// client's state and it came back with a fresh burst). With every key
/// kept in debt, new clients are refused and counted, as the kernel's key
/// table refuses them, and the store stays within `max_keys`.
#[test]
fn the_key_store_never_forgets_a_client_in_debt() {
    let clock = Arc::new(TestClock::default());
    let text = "max_keys: 100\nrules:\n  - { name: a, limit: { rate: 1, unit: hour, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let check = |client: u32, t: u64| admitted(&limiter, &clock, client, t);
    let limited = 7;
    assert!(check(limited, 1));
    assert!(!check(limited, 2), "spent its one an hour");
    let admitted = (1_000..2_000)
        .filter(|&i| check(i, 3 + u64::from(i)))
        .count();
    assert_eq!(admitted, 99, "room for 99 more keys, all then in debt");
    assert!(limiter.tracked_keys() <= 100);
    assert_eq!(limiter.key_alloc_failures(), 901);
    assert!(!check(limited, 5_000), "the limited client was forgotten");
}

/// A dual-stack listener sees IPv4 clients as `::ffff:a.b.c.d`: they are
/// judged as the IPv4 clients they are, by IPv4 rules and one key each
/// (before, no IPv4 rule matched them, and a catch-all put every IPv4
/// client in one /64 bucket).
#[test]
fn ipv4_clients_seen_as_mapped_ipv6_are_ipv4_clients() {
    let clock = Arc::new(TestClock::default());
    let text = "default: drop\nrules:\n  - { name: v4, match: { source: 10.0.0.0/8 }, limit: { rate: 1, unit: hour, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let mapped = |last: u8| limiter::http::RequestMeta {
        client: std::net::Ipv4Addr::new(10, 0, 0, last)
            .to_ipv6_mapped()
            .into(),
        port: None,
        key: None,
        bytes: 0,
        http: None,
    };
    clock.0.store(1, Ordering::SeqCst);
    let first = limiter.check(&mapped(1));
    assert!(first.allowed);
    assert_eq!(limiter.rule_name(&first), "v4");
    assert!(!limiter.check(&mapped(1)).allowed, "one budget per client");
    assert!(
        limiter.check(&mapped(2)).allowed,
        "another client, another key"
    );
    assert_eq!(limiter.tracked_keys(), 2);
}

/// Guards the store against a cheap lockout: under a per-day limit with a
/// large burst, a client that sent one request is at rest again once its
/// one emission interval has passed (86.4 s at 1,000 a day), not a whole
/// day later (before, 100 one-off clients locked every new client out of
/// a 100-key store for a day).
#[test]
fn a_key_rests_when_its_budget_is_whole_not_a_day_later() {
    let clock = Arc::new(TestClock::default());
    let text =
        "max_keys: 100\nrules:\n  - { name: a, limit: { rate: 1000, unit: day, burst: 1000 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let check = |client: u32, t: u64| admitted(&limiter, &clock, client, t);
    const SECOND: u64 = 1_000_000_000;
    for key in 0..100 {
        assert!(check(key, u64::from(key) + 1));
    }
    assert!(!check(100, 10 * SECOND), "room while every key is in debt");
    assert!(
        check(101, 90 * SECOND),
        "locked out after the keys came to rest"
    );
    assert_eq!(limiter.key_alloc_failures(), 1);
}

/// Guards the eviction order: past `max_keys`, keys at rest (their
/// budget whole again) are forgotten least recently seen first, down to
/// half, and new keys are admitted; a key seen recently stays.
#[test]
fn the_key_store_forgets_keys_at_rest_least_recently_seen_first() {
    let clock = Arc::new(TestClock::default());
    // One a second: a key unseen for a second is at rest.
    let text =
        "max_keys: 100\nrules:\n  - { name: a, limit: { rate: 1, unit: second, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let check = |client: u32, t: u64| admitted(&limiter, &clock, client, t);
    const SECOND: u64 = 1_000_000_000;
    for key in 0..100 {
        assert!(check(key, u64::from(key) + 1));
    }
    // Key 0 is seen again 2 s later (at rest, so admitted, and now the
    // most recent); then key 100 finds the store full, of keys at rest.
    assert!(check(0, 2 * SECOND));
    assert!(check(100, 2 * SECOND + 1));
    assert_eq!(
        limiter.tracked_keys(),
        51,
        "forgotten down to half, then the new key"
    );
    assert_eq!(limiter.key_alloc_failures(), 0);
    // Key 0, seen a moment ago, is in debt again: remembered, so refused.
    assert!(!check(0, 2 * SECOND + 2));
}

#[test]
fn shadow_rules_pass_and_count_the_excess() {
    let clock = Arc::new(TestClock::default());
    clock.0.store(1_000_000_000, Ordering::SeqCst);
    let text =
        "rules:\n  - { name: dry, limit: { rate: 1, unit: minute, burst: 2 }, action: shadow }\n";
    let limiter = Limiter::new(rules(text), clock);
    let request = limiter::http::RequestMeta {
        client: [198, 18, 0, 1].into(),
        port: None,
        key: None,
        bytes: 0,
        http: None,
    };
    let decisions: Vec<(bool, bool)> = (0..4)
        .map(|_| limiter.check(&request))
        .map(|d| (d.allowed, d.shadow))
        .collect();
    assert_eq!(
        decisions,
        [(true, false), (true, false), (true, true), (true, true)]
    );
    let c = &limiter.counters[0];
    let counts = [&c.passed, &c.dropped, &c.shadow].map(|n| n.get());
    assert_eq!(counts, [2, 0, 2]);
}
