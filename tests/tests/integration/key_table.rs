//! The key table's policy, through BPF_PROG_TEST_RUN with the clock under
//! the test's control (the test build of the program): a new source takes
//! a free slot, else the slot at rest the longest; a key still in debt is
//! never evicted, so a full bucket refuses the new source instead
//! (`key_alloc_failed`) and the limited source stays limited; forgetting a
//! removed rule's keys frees their slots.
//!
//! `max_keys: 8` makes the table one bucket of 8 slots, so every source
//! shares it.

use std::net::Ipv4Addr;

use limiter_tests::{
    Loaded, XDP_DROP, XDP_PASS, frames, loaded_object, rules, run_at, snapshot, test_clock_object,
};

const HOUR: u64 = 3_600_000_000_000;
/// Far from 0, where a TAT of 0 would look like "at rest since boot".
const T0: u64 = 1_000_000_000_000;

/// One bucket of 8 slots, and key creations unbounded.
macro_rules! one_bucket {
    ($rules:literal) => {
        concat!(
            "max_keys: 8\nnew_keys: { rate: 1000000, unit: second, burst: 1000000 }\nrules:\n",
            $rules
        )
    };
}

const RULES: &str = one_bucket!("  - { name: hourly, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
");

fn source(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, n)
}

/// The program's verdict on a frame from `from`, with its clock at `t`.
fn send(dp: &mut Loaded, from: Ipv4Addr, t: u64) -> u32 {
    run_at(dp, &frames::udp4(from, 9, 0), t)
}

/// The last octet of every source the table holds, sorted.
fn tracked(dp: &Loaded) -> Vec<u8> {
    let mut sources: Vec<u8> = dp
        .maps()
        .keys
        .dump()
        .iter()
        .map(|(key, _)| key.addr[15])
        .collect();
    sources.sort_unstable();
    sources
}

#[test]
fn keys_in_debt_are_never_evicted_and_the_longest_at_rest_goes_first() {
    let mut dp = loaded_object(&test_clock_object(), RULES);
    assert_eq!(dp.maps().keys.capacity(), 8);
    // Eight sources fill the bucket's slots (each its preferred way if
    // free, else the next free one), each spending its burst and owing
    // the table an hour from the nanosecond it came: the debt that ends
    // first is source 4's, the fourth to come.
    const ARRIVAL: [u64; 8] = [5, 3, 8, 1, 6, 2, 7, 4];
    for (n, at) in (1..=8).zip(ARRIVAL) {
        assert_eq!(send(&mut dp, source(n), T0 + at), XDP_PASS);
    }
    assert_eq!(tracked(&dp), (1..=8).collect::<Vec<_>>());

    // A ninth finds every slot in debt: refused, counted, nobody evicted.
    assert_eq!(send(&mut dp, source(9), T0 + 10), XDP_DROP);
    let s = snapshot(&dp);
    assert_eq!(s.global.key_alloc_failed, 1);
    assert_eq!(s.global.key_evictions, 0);
    assert_eq!(tracked(&dp), (1..=8).collect::<Vec<_>>());
    // However many new sources come: the limited ones stay limited.
    for n in 10..=200 {
        assert_eq!(send(&mut dp, source(n), T0 + 20), XDP_DROP);
    }
    assert_eq!(send(&mut dp, source(1), T0 + 30), XDP_DROP);
    assert_eq!(send(&mut dp, source(4), T0 + 30), XDP_DROP);
    assert_eq!(snapshot(&dp).global.key_alloc_failed, 192);

    // Two hours on, every key is at rest: the ninth takes the slot of the
    // one at rest the longest, source 4.
    assert_eq!(send(&mut dp, source(9), T0 + 2 * HOUR), XDP_PASS);
    assert_eq!(tracked(&dp), [1, 2, 3, 5, 6, 7, 8, 9]);
    assert_eq!(snapshot(&dp).global.key_evictions, 1);
    // Source 6, next in line, comes back (its key is found: back in debt);
    // the next newcomer takes the slot of source 2, at rest the longest now.
    assert_eq!(send(&mut dp, source(6), T0 + 2 * HOUR + 1), XDP_PASS);
    assert_eq!(send(&mut dp, source(10), T0 + 2 * HOUR + 2), XDP_PASS);
    assert_eq!(tracked(&dp), [1, 3, 5, 6, 7, 8, 9, 10]);
    assert_eq!(send(&mut dp, source(6), T0 + 2 * HOUR + 3), XDP_DROP);
    assert_eq!(snapshot(&dp).global.key_evictions, 2);
    let c = *snapshot(&dp).rule("hourly").expect("rule");
    assert_eq!(c.new_keys, 10);
}

/// A new key takes its preferred way when it is free, where a lookup
/// looks first: in a table of 512 buckets, 300 sources nearly all sit
/// there (taking the first free way instead puts about one in eight
/// there).
#[test]
fn new_keys_take_their_preferred_way() {
    let rules = "max_keys: 4096\nnew_keys: { rate: 1000000, unit: second, burst: 1000000 }\nrules:\n  - { name: hourly, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }\n";
    let mut dp = loaded_object(&test_clock_object(), rules);
    for n in 0..300u16 {
        let [hi, lo] = n.to_be_bytes();
        let from = Ipv4Addr::new(198, 18, hi, lo);
        assert_eq!(send(&mut dp, from, T0), XDP_PASS);
        // Found again, in whichever way it is: charged, so refused.
        assert_eq!(send(&mut dp, from, T0 + 1), XDP_DROP);
    }
    let (held, preferred) = dp.maps().keys.in_preferred_way();
    assert_eq!(held, 300);
    assert!(
        preferred >= 270,
        "{preferred} of {held} keys in their preferred way"
    );
}

#[test]
fn a_removed_rules_keys_are_forgotten_and_the_others_kept() {
    let two_rules = one_bucket!("  - { name: hourly, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
  - { name: other, match: { source: 198.19.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
");
    let mut dp = loaded_object(&test_clock_object(), two_rules);
    for n in 1..=5 {
        assert_eq!(send(&mut dp, source(n), T0), XDP_PASS);
    }
    for n in 1..=2 {
        assert_eq!(send(&mut dp, Ipv4Addr::new(198, 19, 0, n), T0), XDP_PASS);
    }
    assert_eq!(dp.maps().keys.count(), 7);
    let only_other = one_bucket!("  - { name: other, match: { source: 198.19.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
");
    dp.engine
        .apply(rules(only_other))
        .expect("applying the rule set without `hourly`");
    assert_eq!(dp.maps().keys.count(), 2);
    // The kept keys are the same keys, still in debt.
    assert_eq!(
        send(&mut dp, Ipv4Addr::new(198, 19, 0, 1), T0 + 1),
        XDP_DROP
    );
}

/// Window keys (whose lock is a bit of their packed counts): a key that
/// counted in a window still open is never evicted; once its window is
/// over, a newcomer takes its slot (the claim takes the key's lock, checks
/// again, and starts the newcomer's counts from zero).
#[test]
fn window_keys_are_evicted_only_once_their_window_is_over() {
    let hourly_window = one_bucket!("  - { name: hourly, match: { source: 198.18.0.0/16 }, algorithm: fixed_window, limit: { rate: 1, unit: hour } }
");
    let mut dp = loaded_object(&test_clock_object(), hourly_window);
    for n in 1..=8 {
        assert_eq!(send(&mut dp, source(n), T0), XDP_PASS);
    }
    // Each has counted its 1 of 1 in a window still open.
    assert_eq!(send(&mut dp, source(3), T0 + 1), XDP_DROP);
    assert_eq!(send(&mut dp, source(9), T0 + 2), XDP_DROP);
    let s = snapshot(&dp);
    assert_eq!(s.global.key_alloc_failed, 1);
    assert_eq!(s.global.key_evictions, 0);
    assert_eq!(tracked(&dp), (1..=8).collect::<Vec<_>>());
    // Two hours on, every window is over: the ninth takes a slot, counted
    // from zero (its first packet passes, its second is refused).
    assert_eq!(send(&mut dp, source(9), T0 + 2 * HOUR), XDP_PASS);
    assert_eq!(send(&mut dp, source(9), T0 + 2 * HOUR + 1), XDP_DROP);
    assert_eq!(snapshot(&dp).global.key_evictions, 1);
    assert!(tracked(&dp).contains(&9));
    assert_eq!(dp.maps().keys.count(), 8);
}

/// The distinct bits the held keys set in a filter half, and the bits set
/// in the active half.
fn filter_bits(dp: &Loaded) -> (usize, u64) {
    let config = dp.config().expect("config");
    let words = limiter_common::keytable::filter_words(dp.maps().keys.buckets());
    let mut bits: Vec<(u32, u64)> = dp
        .maps()
        .keys
        .dump()
        .iter()
        .map(|(key, _)| {
            let hash = limiter_common::keytable::hash(key, config.key_seed);
            limiter_common::keytable::filter_bit(hash, words)
        })
        .collect();
    bits.sort_unstable();
    bits.dedup();
    (bits.len(), dp.maps().keys.filter_fill(config.key_filter).0)
}

/// The daemon's periodic check of the filter, with the keys it counts:
/// whether it rebuilt the filter.
fn check_filter(dp: &mut Loaded) -> bool {
    let datapath = dp.engine.datapath_mut();
    let held = datapath.maps().keys.count();
    datapath.refresh_key_filter(held).expect("check")
}

/// The presence filter in front of the tags: every key the kernel stores
/// sets its bit; a rebuild (each half in turn) keeps exactly the bits of
/// the keys held, so a limited source stays found and limited (no fresh
/// burst), and the bits of forgotten keys go; the daemon's periodic check
/// rebuilds only when such bits are in the way.
#[test]
fn the_key_filter_keeps_every_held_key_and_forgets_the_rest() {
    // 32 buckets: each half of the filter is 8 words, so a half's offset
    // (8) and its index (1) differ.
    let two_rules =
        "max_keys: 256\nnew_keys: { rate: 1000000, unit: second, burst: 1000000 }\nrules:
  - { name: hourly, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
  - { name: other, match: { source: 198.19.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
";
    let mut dp = loaded_object(&test_clock_object(), two_rules);
    for n in 1..=40 {
        assert_eq!(send(&mut dp, source(n), T0), XDP_PASS);
    }
    for n in 1..=2 {
        assert_eq!(send(&mut dp, Ipv4Addr::new(198, 19, 0, n), T0), XDP_PASS);
    }
    let (expected, set) = filter_bits(&dp);
    assert!(
        expected >= 35,
        "42 keys in a 512-bit half set {expected} bits"
    );
    assert_eq!(set, expected as u64, "the kernel set each stored key's bit");
    // Nothing is stale: the periodic check leaves the filter alone.
    assert!(!check_filter(&mut dp));
    for round in 0..3 {
        let before = dp.config().expect("config").key_filter;
        dp.engine
            .datapath_mut()
            .rebuild_key_filter()
            .expect("rebuild");
        assert_ne!(dp.config().expect("config").key_filter, before);
        assert_eq!(
            filter_bits(&dp),
            (expected, expected as u64),
            "round {round}"
        );
        // Still found: still in debt, and no key created twice.
        for n in 1..=40 {
            assert_eq!(send(&mut dp, source(n), T0 + 1 + round), XDP_DROP);
        }
        assert_eq!(dp.maps().keys.count(), 42);
        assert_eq!(snapshot(&dp).rule("hourly").expect("rule").new_keys, 40);
    }

    let only_other =
        "max_keys: 256\nnew_keys: { rate: 1000000, unit: second, burst: 1000000 }\nrules:
  - { name: other, match: { source: 198.19.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
";
    dp.engine
        .apply(rules(only_other))
        .expect("applying the rule set without `hourly`");
    assert_eq!(dp.maps().keys.count(), 2);
    let (kept, set) = filter_bits(&dp);
    assert!(set > kept as u64, "forgotten keys' bits are still set");
    // 40 keys gone, their bits over 1/32 of the half: the check rebuilds.
    assert!(check_filter(&mut dp));
    assert_eq!(filter_bits(&dp), (kept, kept as u64));
    assert!(!check_filter(&mut dp));
    assert_eq!(
        send(&mut dp, Ipv4Addr::new(198, 19, 0, 1), T0 + 10),
        XDP_DROP
    );
    // A new source is stored, and found from its second packet on.
    let newcomer = Ipv4Addr::new(198, 19, 0, 77);
    assert_eq!(send(&mut dp, newcomer, T0 + 10), XDP_PASS);
    assert_eq!(send(&mut dp, newcomer, T0 + 11), XDP_DROP);
    assert_eq!(dp.maps().keys.count(), 3);
}
