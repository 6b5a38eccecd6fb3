//! Failures never let the fleet over its budget: a dead host, a dead
//! store, and a share that lapses by itself.

use std::{net::Ipv4Addr, thread, time::Duration};

use super::{
    Fleet, GLOBAL, PARTITIONS, RESERVE, TTL, assert_rate, lease_owners, measure, wait_for,
    wait_for_every,
};

/// A host killed with -9 keeps enforcing in its kernel, but its share
/// lapses there by itself before its leases expire in the store, and the
/// others take them within a TTL; with the store gone every host falls
/// back to its reserve within a TTL, the fleet never above its budget;
/// with the store back, leasing resumes.
#[test]
fn a_dead_host_and_a_dead_store_never_let_the_fleet_over_its_budget() {
    let fleet = Fleet::start("fd");
    let bound = GLOBAL + 3.0 * RESERVE;
    let mut store = fleet.lab.store_connection().expect("watching the store");
    let (taken, after_kill) = fleet.flood(&[0, 1, 2], Duration::from_secs(10), || {
        thread::sleep(Duration::from_secs(2));
        assert!(fleet.held(1) > 0, "host 1 held nothing before the kill");
        let mut host1 = fleet.daemons[1].lock().unwrap();
        // Its leases' token names its process.
        let token = format!("-{}-", host1.pid().expect("host 1 runs"));
        host1.kill9();
        drop(host1);
        let taken = wait_for_every(TTL * 3, Duration::from_millis(2), || {
            let owners = lease_owners(&mut store);
            owners
                .iter()
                .all(|o| o.as_ref().is_some_and(|o| !o.contains(&token)))
        });
        assert!(
            wait_for(TTL, || fleet.held(0) + fleet.held(2) == PARTITIONS).is_some(),
            "hosts 0 and 2 do not count every partition"
        );
        thread::sleep(TTL.saturating_sub(taken.unwrap_or_default()));
        (taken, measure(&fleet, Duration::from_secs(3)))
    });
    let taken = taken.expect("the dead host's partitions were not taken");
    println!("host 1 killed: its partitions taken in {taken:?}; then {after_kill:.0?} pkts/s");
    // Its last renewal reached the store before the kill, so its leases
    // expired within a TTL of it; the hungry hosts take them as they do
    // (the margin: the store watched every 2 ms, a retry's 2 ms, a busy
    // machine's scheduling).
    assert!(
        taken <= TTL + Duration::from_millis(30),
        "taken in {taken:?}"
    );
    assert_rate(
        after_kill.iter().sum(),
        bound,
        5.0,
        "the fleet with a dead host",
    );
    assert_rate(
        after_kill[1],
        RESERVE,
        10.0,
        "the dead host's kernel, its share lapsed to its reserve",
    );

    fleet.daemons[1]
        .lock()
        .unwrap()
        .spawn()
        .expect("restarting host 1");
    let (during_ttl, fallen, shares) = fleet.flood(&[0, 1, 2], Duration::from_secs(9), || {
        thread::sleep(Duration::from_secs(2));
        fleet.lab.stop_store();
        let during_ttl = measure(&fleet, TTL);
        let fallen = measure(&fleet, Duration::from_secs(3));
        let shares: Vec<serde_json::Value> = (0..3).map(|n| fleet.share(n)).collect();
        (during_ttl, fallen, shares)
    });
    println!("store stopped: {during_ttl:.0?} pkts/s within the TTL, then {fallen:.0?} pkts/s");
    assert!(
        during_ttl.iter().sum::<f64>() <= bound * 1.05,
        "over the budget while the store went away: {during_ttl:.0?}"
    );
    for (n, rate) in fallen.iter().enumerate() {
        assert_rate(*rate, RESERVE, 10.0, &format!("host {n} without the store"));
        assert_eq!(shares[n]["store_up"], false, "host {n}: {}", shares[n]);
    }

    fleet.lab.start_store().expect("restarting redis");
    let resumed = fleet.flood(&[0, 1, 2], Duration::from_secs(11), || {
        let held = wait_for(Duration::from_secs(6), || {
            (0..3).map(|n| fleet.held(n)).sum::<u64>() == PARTITIONS
        });
        // The shares settle to equal parts.
        thread::sleep(Duration::from_secs(1));
        (held, measure(&fleet, Duration::from_secs(2)))
    });
    let (held, rates) = resumed;
    println!("store back: every partition leased again in {held:?}; {rates:.0?} pkts/s");
    assert!(held.is_some(), "leasing did not resume");
    assert_rate(
        rates.iter().sum(),
        bound,
        5.0,
        "the fleet with the store back",
    );
}

/// Guards the kernel's side of a share: it lapses to the reserve by itself
/// at its deadline (a daemon that died cannot keep a partition), and a
/// share never lands on a rule that a reload renamed or changed: the
/// renamed rule starts at its reserve, and the old loop's grants are
/// refused. The program's clock is set by the test (BPF_PROG_TEST_RUN).
#[test]
fn a_kernel_share_lapses_by_itself_and_never_outlives_its_rule() {
    use limiter::fleet::{Grant, RuleRef};
    use limiter_tests::{
        XDP_DROP, XDP_PASS, frames, loaded_object, rules, run_at, test_clock_object,
    };

    let file = |name: &str, rate: u32| {
        format!(
            "rules:
  - name: {name}
    match: {{ source: 198.18.0.0/15 }}
    limit: {{ rate: 1000000, unit: second }}
    aggregate: {{ rate: {rate}, unit: second, burst: 10, scope: fleet, partitions: 10, reserve: 1 }}
"
        )
    };
    let mut dp = loaded_object(&test_clock_object(), &file("edge", 1000));
    let edge = RuleRef::of(&rules(&file("edge", 1000)).rules[0]);
    let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, 1), 9, 18);
    let sec = 1_000_000_000u64;
    let t0 = 1000 * sec;
    // Leases say 1,000/s (burst 10) until t0 + 1 s.
    dp.engine
        .set_fleet_share(
            &edge,
            Grant {
                local: 1000,
                until_ns: t0 + sec,
            },
        )
        .expect("a share for the rule in force");
    let passed = |dp: &mut _, at: u64, n: usize| {
        (0..n)
            .filter(|_| run_at(dp, &frame, at) == XDP_PASS)
            .count()
    };
    assert_eq!(passed(&mut dp, t0, 12), 10, "the share's burst");
    // Past the deadline, nobody renewed: the reserve (1/s, burst 1).
    assert_eq!(
        passed(&mut dp, t0 + 2 * sec, 3),
        1,
        "the share outlived its deadline"
    );
    // A rename keeps the fingerprint, not the share: the renamed rule is
    // another rule in the store, at its reserve, and the old loop's grant
    // is refused.
    dp.engine
        .set_fleet_share(
            &edge,
            Grant {
                local: 1000,
                until_ns: t0 + 10 * sec,
            },
        )
        .unwrap();
    dp.engine
        .apply(rules(&file("edge2", 1000)))
        .expect("rename");
    assert_eq!(
        passed(&mut dp, t0 + 4 * sec, 3),
        1,
        "a share carried across a rename"
    );
    assert!(
        dp.engine
            .set_fleet_share(
                &edge,
                Grant {
                    local: 1000,
                    until_ns: t0 + 10 * sec
                }
            )
            .is_err()
    );
    // A changed rule: the old loop's grant is refused too.
    let edge2 = RuleRef::of(&rules(&file("edge2", 1000)).rules[0]);
    dp.engine
        .apply(rules(&file("edge2", 2000)))
        .expect("change");
    assert!(
        dp.engine
            .set_fleet_share(
                &edge2,
                Grant {
                    local: 1000,
                    until_ns: t0 + 10 * sec
                }
            )
            .is_err()
    );
    assert_ne!(
        run_at(&mut dp, &frame, t0 + 6 * sec),
        XDP_DROP,
        "the reserve admits one"
    );
}
