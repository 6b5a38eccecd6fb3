//! Refusals counted per CPU for the key each CPU refuses most
//! (`PENDING_DROPS`, see `PendingDrops`): the entry changes hands after
//! 64 refusals of other keys, and the report program, reached by the tail
//! call after the decision, moves the former key's count to its slot.
//! Through BPF_PROG_TEST_RUN on one CPU, the entries read from their pin
//! beside the key table's reading, which adds what they hold.

use std::net::Ipv4Addr;

use aya::{
    maps::{Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions},
};
use limiter_common::abi::{FlowKey, PendingDrops, map_name};
use limiter_tests::{Loaded, XDP_DROP, XDP_PASS, frames, loaded, pin_to_cpu};

/// One packet an hour per source, key creations unbounded.
const HOURLY: &str = "new_keys: { rate: 1000000, unit: second, burst: 1000000 }
rules:
  - { name: hourly, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 1, unit: hour, burst: 1 } }
";

fn run(dp: &Loaded, source: Ipv4Addr) -> u32 {
    dp.program()
        .test_run(TestRunOptions {
            data_in: Some(&frames::udp4(source, 9, 0)),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
}

/// This CPU's entry (CPU 0: the test runs pinned there).
fn entry(dp: &Loaded) -> PendingDrops {
    let data = MapData::from_pin(dp.pin_dir().join(map_name::PENDING_DROPS)).expect("the pin");
    let map: PerCpuArray<_, PendingDrops> =
        PerCpuArray::try_from(Map::PerCpuArray(data)).expect("PENDING_DROPS");
    map.get(&0, 0).expect("entry 0")[0]
}

/// The key table's reading of each source's refusals (slots and entries).
fn refusals(dp: &Loaded) -> Vec<(Ipv4Addr, u32)> {
    let mut out: Vec<(Ipv4Addr, u32)> = dp
        .maps()
        .keys
        .dump()
        .into_iter()
        .map(|(key, state)| (v4(&key), state.dropped_packets))
        .collect();
    out.sort();
    out
}

fn v4(key: &FlowKey) -> Ipv4Addr {
    Ipv4Addr::new(key.addr[12], key.addr[13], key.addr[14], key.addr[15])
}

#[test]
fn a_held_count_moves_to_its_slot_when_another_key_takes_the_entry() {
    pin_to_cpu(0).expect("pinning to CPU 0");
    let dp = loaded(HOURLY);
    let hot = Ipv4Addr::new(198, 18, 0, 1);
    assert_eq!(run(&dp, hot), XDP_PASS, "the burst");
    for _ in 0..10 {
        assert_eq!(run(&dp, hot), XDP_DROP);
    }
    let held = entry(&dp);
    assert_eq!(
        (v4(&held.key), held.count),
        (hot, 10),
        "the entry holds {hot}'s refusals"
    );
    assert_eq!(refusals(&dp), [(hot, 10)], "read with the entry's count");

    // 64 refusals of other keys, each refused once: the entry stays.
    let other = |i: u32| Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 1, 0)) + i);
    for i in 0..PendingDrops::TAKE_OVER_AFTER {
        assert_eq!(run(&dp, other(i)), XDP_PASS);
        assert_eq!(run(&dp, other(i)), XDP_DROP);
    }
    let kept = entry(&dp);
    assert_eq!(
        (v4(&kept.key), kept.count),
        (hot, 10),
        "kept through 64 others"
    );
    assert_eq!(kept.others, PendingDrops::TAKE_OVER_AFTER);

    // The next key refused takes the entry; the report program moved the
    // former key's 10 to its slot in the same run.
    let next = other(PendingDrops::TAKE_OVER_AFTER);
    assert_eq!(run(&dp, next), XDP_PASS);
    assert_eq!(run(&dp, next), XDP_DROP);
    let taken = entry(&dp);
    assert_eq!((v4(&taken.key), taken.count), (next, 1), "taken by {next}");
    assert_eq!(taken.old_count, 0, "the former count moved: {taken:?}");
    assert_eq!(
        taken.flushes, 6,
        "three changes, each bracketed: the free entry taken, taken again, the move"
    );
    let counts = refusals(&dp);
    assert_eq!(counts.len(), 66);
    assert!(
        counts.iter().all(|&(_, n)| n == 1 || n == 10) && counts.contains(&(hot, 10)),
        "every key's refusals, once: {counts:?}"
    );
    // And the hot source refused again counts on its slot now, the entry
    // being another's.
    assert_eq!(run(&dp, hot), XDP_DROP);
    assert!(refusals(&dp).contains(&(hot, 11)));
    assert_eq!(entry(&dp).others, 1);
}
