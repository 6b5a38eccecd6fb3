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

use aya::programs::{TestRun, TestRunOptions};
use limiter_tests::{Loaded, frames, loaded_object, rules, snapshot, test_clock_object};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const HOUR: u64 = 3_600_000_000_000;
/// Far from 0, where a TAT of 0 would look like "at rest since boot".
const T0: u64 = 1_000_000_000_000;

const RULES: &str = "
max_keys: 8
new_keys: { rate: 1000000, unit: second, burst: 1000000 }
rules:
  - { name: hourly, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
";

fn source(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, n)
}

/// The program's verdict on a frame from `from`, with its clock at `t`.
fn send(dp: &mut Loaded, from: Ipv4Addr, t: u64) -> u32 {
    dp.engine
        .datapath_mut()
        .maps_mut()
        .test_clock
        .as_mut()
        .expect("the test build has CLOCK")
        .set(0, t, 0)
        .expect("setting the clock");
    dp.program()
        .test_run(TestRunOptions {
            data_in: Some(&frames::udp4(from, 9, 0)),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
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
    // Eight sources fill the bucket's slots in order, each spending its
    // burst and owing the table an hour; the clock runs backwards, one
    // nanosecond a source, so the debt that ends first is in the last
    // slot, not the first.
    for n in 1..=8 {
        assert_eq!(send(&mut dp, source(n), T0 + 9 - u64::from(n)), XDP_PASS);
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
    assert_eq!(send(&mut dp, source(8), T0 + 30), XDP_DROP);
    assert_eq!(snapshot(&dp).global.key_alloc_failed, 192);

    // Two hours on, every key is at rest: the ninth takes the slot of the
    // one at rest the longest (source 8, whose debt ended first).
    assert_eq!(send(&mut dp, source(9), T0 + 2 * HOUR), XDP_PASS);
    assert_eq!(tracked(&dp), [1, 2, 3, 4, 5, 6, 7, 9]);
    assert_eq!(snapshot(&dp).global.key_evictions, 1);
    // Source 7 is back in debt; the next newcomer takes source 6's slot.
    assert_eq!(send(&mut dp, source(7), T0 + 2 * HOUR + 1), XDP_PASS);
    assert_eq!(send(&mut dp, source(10), T0 + 2 * HOUR + 2), XDP_PASS);
    assert_eq!(tracked(&dp), [1, 2, 3, 4, 5, 7, 9, 10]);
    assert_eq!(send(&mut dp, source(7), T0 + 2 * HOUR + 3), XDP_DROP);
    assert_eq!(snapshot(&dp).global.key_evictions, 2);
    let c = *snapshot(&dp).rule("hourly").expect("rule");
    assert_eq!(c.new_keys, 10);
}

#[test]
fn a_removed_rules_keys_are_forgotten() {
    let mut dp = loaded_object(&test_clock_object(), RULES);
    for n in 1..=5 {
        assert_eq!(send(&mut dp, source(n), T0), XDP_PASS);
    }
    assert_eq!(dp.maps().keys.count(), 5);
    dp.engine
        .apply(rules("max_keys: 8\nrules: []\n"))
        .expect("applying an empty rule set");
    assert_eq!(dp.maps().keys.count(), 0);
}
