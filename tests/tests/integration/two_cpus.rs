//! One key hit from both CPUs at once: the compare-and-swap update of the
//! GCRA state must not lose updates, so exactly the burst is admitted.

use std::{net::Ipv4Addr, sync::Barrier, thread};

use aya::programs::{TestRun, TestRunOptions};
use limiter_tests::{frames, loaded, pin_to_cpu, snapshot};

const BURST: u64 = 200_000;
const PER_CPU: u32 = 300_000;

#[test]
fn concurrent_packets_of_one_key_lose_no_update() {
    let cpus = thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        cpus >= 2,
        "this test needs two CPUs, the machine has {cpus}"
    );
    // One token per hour: only the burst can pass during the test.
    let dp = loaded(&format!(
        "rules:\n  - {{ name: hot, limit: {{ rate: 1, unit: hour, burst: {BURST} }} }}\n"
    ));
    let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, 1), 9, 0);
    let start = Barrier::new(2);
    thread::scope(|scope| {
        for cpu in 0..2 {
            let (dp, frame, start) = (&dp, &frame, &start);
            scope.spawn(move || {
                pin_to_cpu(cpu).expect("pinning");
                start.wait();
                dp.program()
                    .test_run(TestRunOptions {
                        data_in: Some(frame),
                        repeat: PER_CPU,
                        ..TestRunOptions::default()
                    })
                    .expect("BPF_PROG_TEST_RUN");
            });
        }
    });
    let hot = *snapshot(&dp).rule("hot").expect("rule");
    assert_eq!(hot.new_keys, 1, "one key");
    // The key's own count of refusals, which both CPUs hold for it
    // (`PENDING_DROPS`) rather than writing its slot with each, is exact
    // once the table's reader adds them.
    let keys = dp.maps().keys.dump();
    assert_eq!(keys.len(), 1, "one key");
    assert_eq!(
        u64::from(keys[0].1.dropped_packets),
        hot.dropped_packets,
        "the key's refusals against the rule's"
    );
    assert_eq!(
        hot.passed_packets + hot.dropped_packets,
        2 * u64::from(PER_CPU)
    );
    assert_eq!(
        hot.passed_packets, BURST,
        "admitted exactly the burst (contended: {})",
        hot.contended
    );

    // Both CPUs really admitted packets of that key, so the updates raced.
    let per_cpu = &dp.maps().rule_stats;
    let rule_id = snapshot(&dp)
        .rules
        .iter()
        .find(|r| r.name == "hot")
        .expect("rule")
        .id;
    // Slot 0 counts packets of unregistered interfaces, as test runs are.
    let values = per_cpu
        .get(&limiter_common::abi::counter_slot(0, rule_id), 0)
        .expect("read");
    assert!(
        values[0].passed_packets > 0 && values[1].passed_packets > 0,
        "admitted per CPU: {} and {}: the runs did not overlap",
        values[0].passed_packets,
        values[1].passed_packets
    );
}
