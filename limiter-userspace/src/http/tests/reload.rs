//! Reloads that make a rule plain or stop it being: each key's debt and
//! block kept, wherever its keys are kept.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, atomic::Ordering},
};

use super::{Ticks, from, limiter};
use crate::http::{limiter::Limiter, reload::Reloadable};

/// Requests `client` gets through at once.
fn admitted_at_once(limiter: &Limiter, client: IpAddr) -> u32 {
    let mut n = 0;
    while limiter.check(&from(client)).allowed {
        n += 1;
        assert!(n < 1_000, "never refused");
    }
    n
}

/// A reload that makes a rule plain, or makes it something else, keeps
/// each key's debt, wherever its keys are kept on either side, carried
/// to new limits (half a burst spent is half of the new one); one that
/// drops a rule forgets its plain keys. By `Limiter::reloaded` and by
/// `Reloadable::reload` (the swap, its second pass, its settling).
#[test]
fn a_reload_keeps_a_keys_debt_as_its_rule_becomes_plain_or_stops_being() {
    for swapped in [false, true] {
        reload_steps(swapped);
    }
}

fn reload_steps(swapped: bool) {
    let rule = |burst: u32, rest: &str| {
        format!("{{ name: api, limit: {{ rate: 1, unit: minute, burst: {burst} }}{rest} }}")
    };
    let rule_file = |rule: &str| {
        crate::rules::RuleSet::parse(
            &format!("rules:\n  - {rule}\n"),
            std::path::Path::new("t.yaml"),
        )
        .expect("rules")
    };
    let clock = Arc::new(Ticks(1_000_000_000.into()));
    let first = limiter(&format!("rules:\n  - {}\n", rule(4, "")), clock.clone());
    let reloadable = Reloadable::new(Arc::new(first));
    let mut limiter = reloadable.current();
    let spend = |limiter: &Limiter, client: IpAddr, n: u32| {
        for _ in 0..n {
            assert!(limiter.check(&from(client)).allowed, "{client}");
        }
    };
    // Clients spent whole before the first reload stay so throughout.
    let spent: [IpAddr; 2] = [
        Ipv4Addr::new(198, 18, 1, 1).into(),
        "2001:db8:1::1".parse().expect("an address"),
    ];
    for client in spent {
        spend(&limiter, client, 4);
    }
    // (rule, plain after, burst before -> after)
    let soft = ", soft: { rate: 1, unit: hour }";
    let escalate = ", escalate: { after: 1m, block: 1m }";
    let steps = [
        (rule(8, soft), false, 4, 8),
        (rule(4, ""), true, 8, 4),
        (rule(8, ""), true, 4, 8),
        (rule(4, escalate), false, 8, 4),
        (rule(4, ""), true, 4, 4),
        (rule(4, ""), true, 4, 4),
    ];
    for (n, (rule, plain, before, after)) in steps.into_iter().enumerate() {
        let what = format!("step {n} ({rule}), swapped: {swapped}");
        // Two clients spend half their burst under the rule before.
        let half: [IpAddr; 2] = [
            Ipv4Addr::new(198, 18, 2, n as u8).into(),
            format!("2001:db8:2:{n}::1").parse().expect("an address"),
        ];
        for client in half {
            spend(&limiter, client, before / 2);
        }
        let next = if swapped {
            assert_eq!(reloadable.reload(rule_file(&rule)), 1, "{what}");
            reloadable.settle();
            reloadable.current()
        } else {
            let (next, kept) = limiter.reloaded(rule_file(&rule));
            assert_eq!(kept, 1, "{what}");
            Arc::new(next)
        };
        assert_eq!(next.plain[0].is_some(), plain, "{what}");
        for client in half {
            assert_eq!(
                admitted_at_once(&next, client),
                after / 2,
                "{client}: {what}"
            );
        }
        for client in spent {
            assert_eq!(admitted_at_once(&next, client), 0, "{client}: {what}");
        }
        // Every client kept, each in the store its rule keeps it in.
        let ipv4_keys = n + 2;
        assert_eq!(next.tracked_keys(), 2 * ipv4_keys, "{what}");
        assert_eq!(
            next.keys.plain.len(),
            usize::from(plain) * ipv4_keys,
            "{what}"
        );
        limiter = next;
    }
    // The debt is the limit's own: a request's worth a minute.
    clock.0.fetch_add(60_000_000_000, Ordering::Relaxed);
    for client in spent {
        assert_eq!(admitted_at_once(&limiter, client), 1, "{client}");
    }
    let other = "{ name: other, match: { source: 10.0.0.0/8 }, limit: { rate: 5, unit: second } }";
    let next = if swapped {
        assert_eq!(reloadable.reload(rule_file(other)), 0);
        reloadable.settle();
        reloadable.current()
    } else {
        Arc::new(limiter.reloaded(rule_file(other)).0)
    };
    assert_eq!(next.tracked_keys(), 0);
    assert_eq!(next.keys.plain.len(), 0);
}

/// A key its escalation blocked stays blocked when a reload makes its
/// rule plain: its block is kept where it is (not among the plain
/// keys), and found there.
#[test]
fn an_escalation_block_outlasts_a_reload_that_makes_its_rule_plain() {
    let limit = "limit: { rate: 1, unit: minute, burst: 1 }";
    let clock = Arc::new(Ticks(1_000_000_000.into()));
    let text =
        format!("rules:\n  - {{ name: api, {limit}, escalate: {{ after: 1s, block: 5m }} }}\n");
    let limiter = limiter(&text, clock.clone());
    let client: IpAddr = Ipv4Addr::new(198, 18, 0, 1).into();
    let at = |ms: u64| {
        clock
            .0
            .store(1_000_000_000 + ms * 1_000_000, Ordering::Relaxed);
        limiter.check(&from(client))
    };
    assert!(at(0).allowed);
    // Over its limit at every request for longer than a second.
    for ms in [10, 600, 1_200, 1_800] {
        assert!(!at(ms).allowed);
    }
    assert!(at(2_000).blocked_for_ns > 0, "never blocked");
    let rules = crate::rules::RuleSet::parse(
        &format!("rules:\n  - {{ name: api, {limit} }}\n"),
        std::path::Path::new("t.yaml"),
    )
    .expect("rules");
    let (next, kept) = limiter.reloaded(rules);
    assert_eq!((kept, next.plain[0].is_some()), (1, true));
    assert_eq!(next.keys.plain.len(), 0);
    let at = |s: u64| {
        clock
            .0
            .store(1_000_000_000 + s * 1_000_000_000, Ordering::Relaxed);
        next.check(&from(client))
    };
    // Its debt alone would be paid in a minute: the block holds.
    let blocked = at(120);
    assert!(!blocked.allowed && blocked.blocked_for_ns > 0);
    assert!(at(310).allowed, "blocked past its block");
}
