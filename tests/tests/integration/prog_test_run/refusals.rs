//! Refusals: counted by cause and by key, by contention for a key's
//! lock, and pins of an incompatible build refused.

use std::net::Ipv4Addr;

use limiter_common::abi::{FlowKey, KeyState};
use limiter_tests::{
    XDP_DROP, XDP_PASS,
    frames::{self},
    loaded,
};

use super::{counters, run};

/// Every key the table holds, with its state.
fn keys(dp: &limiter_tests::Loaded) -> Vec<(FlowKey, KeyState)> {
    dp.engine.datapath().maps().keys.dump()
}

/// Guards the check of pinned state against the object's own map
/// definitions: a `CONFIG` pinned with another value size (as an
/// incompatible build would leave it) is refused with a message naming the
/// map and both sizes, instead of being misread.
#[test]
fn pins_of_an_incompatible_build_are_refused() {
    use aya::maps::MapData;
    use aya_obj::{
        EbpfSectionKind,
        maps::{LegacyMap, bpf_map_def},
    };
    limiter::kernel::pins::ensure_bpffs().expect("bpffs");
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/limiter-test-incompatible-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    // As a limiter makes its pin directory: root's, 0700.
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&dir)
        .expect("pin dir");
    let foreign = aya_obj::Map::Legacy(LegacyMap {
        def: bpf_map_def {
            map_type: 2, // BPF_MAP_TYPE_ARRAY, as CONFIG is
            key_size: 4,
            value_size: 8,
            max_entries: 1,
            ..bpf_map_def::default()
        },
        inner_def: None,
        section_index: 0,
        section_kind: EbpfSectionKind::Maps,
        symbol_index: None,
        data: Vec::new(),
    });
    let map = MapData::create(foreign, "CONFIG", None).expect("creating a map");
    map.pin(dir.join("CONFIG")).expect("pinning it");
    let opened = limiter::kernel::Datapath::open(&dir, 1024).map(drop);
    let _ = std::fs::remove_dir_all(&dir);
    let error = opened
        .expect_err("an incompatible pin must be refused")
        .to_string();
    assert!(
        error.contains("incompatible build")
            && error.contains(&format!(
                "CONFIG: value size is 8, this build uses {}",
                size_of::<limiter_common::abi::GlobalConfig>()
            )),
        "{error}"
    );
}

/// Guards the refusal counters by cause and by key: an aggregate's
/// refusals are counted as `aggregate_excess`, a spent key-creation
/// budget's as `unadmitted` (each only as itself), and each key's
/// refusals on that key, also when two keys are refused in turns (so the
/// CPU's pending entry changes hands), as `limiter top` and escalation
/// read them.
#[test]
fn refusals_are_counted_by_cause_and_by_key() {
    let dp = loaded(
        "new_keys: { rate: 1, unit: day, burst: 3 }
rules:
  - { name: agg, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 100, unit: day }, aggregate: { rate: 4, unit: day } }
  - { name: fresh, match: { source: 198.20.0.0/16 }, key: source, limit: { rate: 100, unit: day } }
  - { name: keyed, match: { source: 198.19.0.0/16 }, key: source, limit: { rate: 2, unit: day } }
  - { name: window, match: { source: 198.21.0.0/16 }, key: source, algorithm: fixed_window, limit: { rate: 100, unit: day }, aggregate: { rate: 2, unit: day } }
",
    );
    let send =
        |a: u8, b: u8, c: u8, d: u8| run(&dp, &frames::udp4(Ipv4Addr::new(a, b, c, d), 9, 0)).0;
    let sent: Vec<u32> = [1, 1, 2, 2, 3, 3]
        .iter()
        .map(|&d| send(198, 18, 0, d))
        .collect();
    assert_eq!(
        sent,
        [XDP_PASS, XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]
    );
    let agg = counters(&dp, "agg");
    assert_eq!(
        (agg.dropped_packets, agg.aggregate_excess, agg.unadmitted),
        (2, 2, 0),
        "{agg:?}"
    );
    let fresh: Vec<u32> = (1..=4).map(|d| send(198, 20, 0, d)).collect();
    assert_eq!(fresh, [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP]);
    let c = counters(&dp, "fresh");
    assert_eq!(
        (
            c.dropped_packets,
            c.unadmitted,
            c.aggregate_excess,
            c.new_keys
        ),
        (1, 1, 0, 3),
        "{c:?}"
    );
    // Two keys of two packets a day, each spent, then refused in turns.
    for d in [1, 1, 2, 2] {
        assert_eq!(send(198, 19, 0, d), XDP_PASS);
    }
    for d in [1, 2, 1, 2, 1, 1, 2, 1] {
        assert_eq!(send(198, 19, 0, d), XDP_DROP);
    }
    let mut refused: Vec<(u8, u32)> = keys(&dp)
        .into_iter()
        .filter(|(key, _)| key.addr[12..15] == [198, 19, 0])
        .map(|(key, state)| (key.addr[15], state.dropped_packets))
        .collect();
    refused.sort_unstable();
    assert_eq!(refused, [(1, 5), (2, 3)], "refusals by key");
    let keyed = counters(&dp, "keyed");
    assert_eq!(
        (keyed.dropped_packets, keyed.aggregate_excess),
        (8, 0),
        "refused by the key's own meter: {keyed:?}"
    );
    // A window's aggregate: its refusals are the aggregate's too (the
    // windows' subprogram returns which meter refused).
    let window: Vec<u32> = (1..=3).map(|d| send(198, 21, 0, d)).collect();
    assert_eq!(window, [XDP_PASS, XDP_PASS, XDP_DROP]);
    let c = counters(&dp, "window");
    assert_eq!((c.dropped_packets, c.aggregate_excess), (1, 1), "{c:?}");
}

/// Another CPU holding an aggregate's lock through every attempt (its lock
/// word set here, as that CPU would leave it mid-update): the packet is
/// refused by contention and counted so, and nothing stays locked after.
#[test]
fn a_lock_held_elsewhere_refuses_by_contention() {
    let mut dp = loaded(
        "rules:
  - { name: window, match: { source: 198.21.0.0/16 }, key: source, algorithm: fixed_window, limit: { rate: 100, unit: day }, aggregate: { rate: 100, unit: day } }
",
    );
    let source = Ipv4Addr::new(198, 21, 0, 1);
    let send = |dp: &limiter_tests::Loaded| run(dp, &frames::udp4(source, 9, 0)).0;
    assert_eq!(send(&dp), XDP_PASS);
    let rule = keys(&dp)
        .into_iter()
        .find(|(key, _)| key.addr[12..] == source.octets())
        .expect("the source's key")
        .0
        .rule_id();
    let set_lock = |dp: &mut limiter_tests::Loaded, held: u32| {
        let aggregates = &mut dp.engine.datapath_mut().maps_mut().aggregates;
        let mut state = aggregates.get(&rule, 0).expect("the rule's aggregate");
        state.lock = held;
        aggregates.set(rule, state, 0).expect("aggregate written");
    };
    set_lock(&mut dp, 1);
    assert_eq!(send(&dp), XDP_DROP, "the aggregate's lock held elsewhere");
    let c = counters(&dp, "window");
    let len = frames::udp4(source, 9, 0).len() as u64;
    assert_eq!(
        (
            c.contended,
            c.dropped_packets,
            c.dropped_bytes,
            c.passed_packets,
            c.passed_bytes
        ),
        (1, 1, len, 1, len),
        "{c:?}"
    );
    set_lock(&mut dp, 0);
    // The key's own lock, taken before the aggregate's, was released.
    assert_eq!(send(&dp), XDP_PASS, "the lock free again");
    let c = counters(&dp, "window");
    assert_eq!((c.contended, c.passed_packets), (1, 2), "{c:?}");
}
