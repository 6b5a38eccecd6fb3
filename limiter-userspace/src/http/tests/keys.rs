//! `max_keys`: one bound over the plain keys and the others.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, atomic::Ordering},
};

use limiter_common::trace::reason;

use super::{Ticks, from, last_seen, limiter};

/// `max_keys` bounds the plain keys and the others together: past it,
/// keys in debt in either are kept and a new key refused; once they
/// rest, the least recently seen of both go first.
#[test]
fn max_keys_bounds_the_plain_keys_and_the_others_together() {
    let text =
        "max_keys: 4\nrules:\n  - { name: api, limit: { rate: 1, unit: minute, burst: 1 } }\n";
    let clock = Arc::new(Ticks(1_000_000_000.into()));
    let limiter = limiter(text, clock.clone());
    let clients: [IpAddr; 5] = [
        Ipv4Addr::new(198, 18, 0, 1).into(),
        // Keys by /64 (the default).
        "2001:db8:0:1::1".parse().expect("an address"),
        Ipv4Addr::new(198, 18, 0, 2).into(),
        "2001:db8:0:2::1".parse().expect("an address"),
        Ipv4Addr::new(198, 18, 0, 3).into(),
    ];
    // Seen in this order, each a few milliseconds after the last.
    for &client in &clients[..4] {
        clock.0.fetch_add(5_000_000, Ordering::Relaxed);
        assert!(limiter.check(&from(client)).allowed, "{client}");
    }
    assert_eq!((limiter.keys.plain.len(), limiter.tracked_keys()), (2, 4));
    let refused = limiter.check(&from(clients[4]));
    assert!(!refused.allowed);
    assert_eq!(refused.refused_by, Some(reason::NO_SLOT));
    // All at rest a minute on: room is made down to half, the two
    // seen first (one of each kind) forgotten.
    clock.0.fetch_add(60_000_000_000, Ordering::Relaxed);
    assert!(limiter.check(&from(clients[4])).allowed);
    let kept = clients.map(|c| last_seen(&limiter, c).is_some());
    assert_eq!(kept, [false, false, true, true, true]);
    assert_eq!(limiter.tracked_keys(), 3);
}
