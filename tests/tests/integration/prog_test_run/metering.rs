//! What a rule's meter charges and admits: bursts, shadow rules, bytes
//! and packets, the default, IPv6 keys by /64, fixed windows, blocks and
//! `key: all`.

use std::net::{Ipv4Addr, Ipv6Addr};

use limiter::kernel::Datapath;
use limiter_tests::{
    XDP_DROP, XDP_PASS,
    frames::{self},
    loaded,
};

use super::{RULES, SRC4, counters, rule_of, run};

#[test]
fn default_drop() {
    let dp = loaded(&RULES.replace("default: pass", "default: drop"));
    let (verdict, rule, _) = run(&dp, &frames::udp4(Ipv4Addr::new(203, 0, 113, 1), 53, 20));
    assert_eq!((verdict, rule.as_deref()), (XDP_DROP, Some("default")));
    assert_eq!(
        rule_of(&dp, &frames::udp4(SRC4, 53, 20)).as_deref(),
        Some("dns")
    );
}

#[test]
fn burst_then_drop_and_shadow() {
    let dp = loaded(
        "rules:
  - { name: tiny, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: day, burst: 3 } }
  - { name: dry, match: { source: 198.19.0.0/16 }, limit: { rate: 1, unit: day, burst: 3 }, action: shadow }
",
    );
    let verdicts: Vec<u32> = (0..5)
        .map(|_| run(&dp, &frames::udp4(SRC4, 9, 0)).0)
        .collect();
    assert_eq!(verdicts, [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]);
    // Another source has its own bucket.
    assert_eq!(
        run(&dp, &frames::udp4(Ipv4Addr::new(198, 18, 0, 2), 9, 0)).0,
        XDP_PASS
    );
    let c = counters(&dp, "tiny");
    assert_eq!((c.passed_packets, c.dropped_packets, c.new_keys), (4, 2, 2));
    let shadowed = frames::udp4(Ipv4Addr::new(198, 19, 1, 1), 9, 0);
    let verdicts: Vec<u32> = (0..5).map(|_| run(&dp, &shadowed).0).collect();
    assert_eq!(verdicts, [XDP_PASS; 5]);
    let c = counters(&dp, "dry");
    assert_eq!(
        (c.passed_packets, c.shadow_packets, c.dropped_packets),
        (5, 2, 0)
    );
    assert_eq!(c.shadow_bytes, 2 * shadowed.len() as u64);
}

#[test]
fn bytes_and_packets_together_charge_only_what_passes() {
    let dp = loaded(
        "rules:
  - { name: both, limit: { rate: 2, bytes: 1000, unit: day } }
",
    );
    let big = frames::udp4(SRC4, 9, 900 - 42);
    let small = frames::udp4(SRC4, 9, 18);
    assert_eq!((big.len(), small.len()), (900, 60));
    assert_eq!(run(&dp, &big).0, XDP_PASS); // 1 of 2 packets, 900 of 1000 bytes
    assert_eq!(run(&dp, &big).0, XDP_DROP); // bytes deny it; the packet meter is refunded
    assert_eq!(run(&dp, &small).0, XDP_PASS); // so the second packet still fits
    assert_eq!(run(&dp, &small).0, XDP_DROP); // packets exhausted
    let c = counters(&dp, "both");
    assert_eq!(
        (c.passed_packets, c.passed_bytes, c.dropped_packets),
        (2, 960, 2)
    );
}

#[test]
fn ipv6_keys_default_to_the_64() {
    let dp = loaded(
        "rules:\n  - { name: v6, match: { source: \"2001:db8::/32\" }, limit: { rate: 1, unit: day, burst: 2 } }\n",
    );
    let a = frames::udp6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1), 9, 0);
    let b = frames::udp6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0xffff, 0, 0, 2), 9, 0);
    let other = frames::udp6(Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1), 9, 0);
    assert_eq!(
        [run(&dp, &a).0, run(&dp, &b).0, run(&dp, &a).0],
        [XDP_PASS, XDP_PASS, XDP_DROP]
    );
    assert_eq!(run(&dp, &other).0, XDP_PASS);
    assert_eq!(counters(&dp, "v6").new_keys, 2);
}

/// Sleeps until `offset` past the next whole second of the Unix epoch.
fn after_next_epoch_second(offset: std::time::Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let next = std::time::Duration::from_secs(now.as_secs() + 1) + offset;
    std::thread::sleep(next - now);
}

#[test]
fn fixed_windows_turn_over_at_epoch_seconds() {
    let dp = loaded(
        "rules:\n  - { name: win, match: { source: 198.18.0.0/16 }, algorithm: fixed_window, limit: { rate: 3, unit: second } }\n",
    );
    let frame = frames::udp4(SRC4, 9, 0);
    for _ in 0..2 {
        // 20 ms into a second: a fresh window of 3, whatever came before.
        after_next_epoch_second(std::time::Duration::from_millis(20));
        let verdicts: Vec<u32> = (0..5).map(|_| run(&dp, &frame).0).collect();
        assert_eq!(verdicts, [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]);
        // Later in the same second: still the same window.
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(run(&dp, &frame).0, XDP_DROP);
    }
}

/// Guards the block check cached in a tracked key: a block added after the
/// source was tracked (and found unblocked) still drops it, a block of
/// another address leaves it alone, and removing the block lets it through
/// again.
#[test]
fn blocks_apply_to_sources_already_tracked() {
    let mut dp = loaded(RULES);
    let frame = frames::udp4(SRC4, 80, 20);
    let verdict = |dp: &Datapath| run(dp, &frame).0;
    assert_eq!(verdict(&dp), XDP_PASS, "tracked, no blocks");
    dp.engine
        .block("198.18.9.9/32".parse().unwrap(), None)
        .expect("block");
    assert_eq!(verdict(&dp), XDP_PASS, "another address blocked");
    assert_eq!(verdict(&dp), XDP_PASS, "still, from the cached check");
    dp.engine
        .block("198.18.0.1/32".parse().unwrap(), None)
        .expect("block");
    let (result, rule, _) = run(&dp, &frame);
    assert_eq!((result, rule), (XDP_DROP, None), "blocked after tracking");
    assert_eq!(verdict(&dp), XDP_DROP, "and again");
    assert!(dp.engine.unblock("198.18.0.1/32".parse().unwrap()).unwrap());
    assert_eq!(verdict(&dp), XDP_PASS, "unblocked");
}

/// `key: all` at layer 3/4: one bucket for every IPv4 source the rule
/// matches (and one for IPv6), as `source/0` was before `limiter check`
/// asked for the word.
#[test]
fn key_all_is_one_bucket_for_every_source() {
    let dp = loaded(
        "rules:
  - { name: world, match: { source: 198.18.0.0/15 }, key: all, limit: { rate: 1, unit: day, burst: 3 } }
",
    );
    for i in 1..=3 {
        let source = Ipv4Addr::new(198, 18, 0, i);
        assert_eq!(
            run(&dp, &frames::udp4(source, 9, 0)).0,
            XDP_PASS,
            "{source}"
        );
    }
    let other = Ipv4Addr::new(198, 19, 7, 7);
    assert_eq!(
        run(&dp, &frames::udp4(other, 9, 0)).0,
        XDP_DROP,
        "the bucket is shared"
    );
    assert_eq!(counters(&dp, "world").new_keys, 1);
}
