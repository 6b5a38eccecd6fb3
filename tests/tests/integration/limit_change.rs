//! A rule whose limits alone change keeps its keys, their state carried
//! over to the new limits (the same fraction of the burst in use), in the
//! kernel and at layer 7: lowering a limit during a flood hands nobody a
//! fresh burst, and raising one gives each key its share of the new burst.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, atomic::Ordering},
    thread,
    time::{Duration, Instant},
};

use limiter::{
    http::{Limiter, RequestMeta},
    lab::{self, Lab},
    wire::Mode,
};
use limiter_tests::{
    Loaded, TestClock, XDP_DROP, XDP_PASS, assert_close, frames, loaded_object, rules, run_at,
    session_on_receiver, snapshot, sources, test_clock_object,
};

const SECOND: u64 = 1_000_000_000;
/// Far from 0, where a TAT of 0 would look like "at rest since boot".
const T0: u64 = 1_000 * SECOND;

fn rule_file(limit: &str) -> String {
    format!("rules:\n  - {{ name: r, match: {{ source: 198.18.0.0/16 }}, limit: {limit} }}\n")
}

fn send(dp: &mut Loaded, last: u8, t: u64) -> u32 {
    run_at(dp, &frames::udp4(Ipv4Addr::new(198, 18, 0, last), 9, 0), t)
}

/// How many packets of source `last` pass at `t`, sent until one is dropped.
fn passed_at_once(dp: &mut Loaded, last: u8, t: u64) -> u32 {
    let mut n = 0;
    while send(dp, last, t) == XDP_PASS {
        n += 1;
        assert!(n < 1_000, "never dropped");
    }
    n
}

/// Sets the test build's clock (what the engine reads when it carries).
fn set_clock(dp: &mut Loaded, t: u64) {
    let clock = dp.engine.datapath_mut().maps_mut().test_clock.as_mut();
    clock
        .expect("the test build's clock")
        .set(0, t, 0)
        .expect("clock");
}

/// Guards the carrying in the kernel (BPF_PROG_TEST_RUN, the test build's
/// clock): without it, a lower limit gave a key in debt a fresh burst
/// (new buckets) or the difference of the two bursts (the TAT kept as it
/// was); a higher one, a key half spent got its share of the new burst.
#[test]
fn the_kernel_carries_each_keys_state_to_new_limits() {
    let mut dp = loaded_object(
        &test_clock_object(),
        &rule_file("{ rate: 10, unit: second, burst: 10 }"),
    );
    // Source 1 spends its whole burst, source 2 half of it.
    assert_eq!(passed_at_once(&mut dp, 1, T0), 10);
    for _ in 0..5 {
        assert_eq!(send(&mut dp, 2, T0), XDP_PASS);
    }
    set_clock(&mut dp, T0);
    let change = dp
        .engine
        .apply(rules(&rule_file("{ rate: 1, unit: second, burst: 2 }")))
        .expect("lowering the limit");
    assert_eq!(change.carried, ["r"]);
    assert!(change.modified.is_empty() && change.unchanged.is_empty());
    assert_eq!(dp.maps().keys.count(), 2, "the keys are kept");
    // Source 1: all of the new burst in use, as it had all of the old:
    // nothing until a new emission interval has passed (a second).
    assert_eq!(send(&mut dp, 1, T0), XDP_DROP);
    assert_eq!(send(&mut dp, 1, T0 + SECOND - 1), XDP_DROP);
    assert_eq!(passed_at_once(&mut dp, 1, T0 + SECOND), 1);
    // Source 2: half of the new burst left, one packet.
    assert_eq!(passed_at_once(&mut dp, 2, T0), 1);

    // Raised: source 1 (TAT T0 + 3 s at T0 + 2 s, half of a 2 s burst in
    // use) gets half of the new burst of 100.
    set_clock(&mut dp, T0 + 2 * SECOND);
    let change = dp
        .engine
        .apply(rules(&rule_file("{ rate: 100, unit: second, burst: 100 }")))
        .expect("raising the limit");
    assert_eq!(change.carried, ["r"]);
    assert_eq!(passed_at_once(&mut dp, 1, T0 + 2 * SECOND), 50);
    let c = *snapshot(&dp).rule("r").expect("rule");
    assert_eq!(c.new_keys, 2, "no key was created again");

    // A change of key is a new rule: fresh buckets.
    let change = dp
        .engine
        .apply(rules(
            "rules:\n  - { name: r, match: { source: 198.18.0.0/16 }, key: source/24, limit: { rate: 100, unit: second, burst: 100 } }\n",
        ))
        .expect("a new key");
    assert_eq!(change.modified, ["r"]);
    assert!(change.carried.is_empty());
}

/// Lowered during a flood, on real traffic counted at the receiver (once,
/// at the end): each source gets B + R·t before the change and R'·t after
/// it, no new burst (it was using all of its old one); new buckets would
/// have given it the new burst of 20 more, the TAT kept as it was 18 more.
#[test]
fn lowering_a_limit_under_flood_hands_out_no_burst() {
    const OLD: (f64, f64) = (100.0, 10.0);
    const NEW_RATE: f64 = 20.0;
    let lab = Lab::create("lt-carry").expect("lab");
    let mut session = session_on_receiver(
        &lab,
        &rules(&rule_file("{ rate: 100, unit: second, burst: 10 }")),
        Mode::Native,
        "/sys/fs/bpf/limiter-test-carry",
    );
    let addrs: Vec<IpAddr> = (1..=4)
        .map(|n| IpAddr::V4(Ipv4Addr::new(198, 18, 0, n)))
        .collect();
    let flood = sources(&lab, 0, &addrs, 1000, 64);
    let socket = lab.sender(0).expect("opening the sender");
    let (report, before, after) = thread::scope(|scope| {
        let started = Instant::now();
        let flooding = scope.spawn(|| lab::flood(&socket, &flood, Duration::from_secs(4), |_| {}));
        thread::sleep(Duration::from_secs(2));
        let applying = Instant::now();
        let change = session
            .engine_mut()
            .apply(rules(&rule_file("{ rate: 20, unit: second, burst: 20 }")))
            .expect("lowering the limit");
        let applied = Instant::now();
        assert_eq!(change.carried, ["r"]);
        let report = flooding.join().expect("flood thread").expect("flooding");
        (
            report,
            applying.duration_since(started),
            applied.duration_since(started),
        )
    });
    thread::sleep(Duration::from_millis(300));
    let received = lab.received().expect("counting");
    // The change took effect somewhere within the apply call.
    let change_at = (before + after).as_secs_f64() / 2.0;
    let expected =
        OLD.1 + OLD.0 * change_at + NEW_RATE * (report.elapsed.as_secs_f64() - change_at);
    let uncertain = OLD.0 * (after - before).as_secs_f64() / 2.0;
    let margin = OLD.1 / 4.0 + uncertain + 1.0;
    // Tight enough to tell the two wrong answers (18 and 20 more) apart
    // from the right one: an apply slower than about 250 ms would make
    // this test pass whatever the state became.
    assert!(
        margin < 16.0,
        "the apply took {:?}: too long for the count to say anything",
        after - before
    );
    for addr in &addrs {
        assert_close(
            received[addr],
            expected,
            margin,
            &format!("{addr}: arrivals, the limit lowered after {change_at:.3} s"),
        );
    }
}

fn admitted_at_once(limiter: &Limiter, last: u8) -> u32 {
    let request = RequestMeta {
        client: Ipv4Addr::new(198, 18, 0, last).into(),
        port: None,
        key: None,
        bytes: 0,
        http: None,
    };
    let mut n = 0;
    while limiter.check(&request).allowed {
        n += 1;
        assert!(n < 1_000, "never refused");
    }
    n
}

/// Layer 7 carries as the kernel does (the same function, `Gcra::carried`).
#[test]
fn layer7_carries_each_keys_state_to_new_limits() {
    let clock = Arc::new(TestClock::default());
    clock.0.store(T0, Ordering::SeqCst);
    let limiter = Limiter::new(
        rules(&rule_file("{ rate: 10, unit: second, burst: 10 }")),
        clock.clone(),
    );
    assert_eq!(admitted_at_once(&limiter, 1), 10);
    let (lower, kept) = limiter.reloaded(rules(&rule_file("{ rate: 1, unit: second, burst: 2 }")));
    assert_eq!(kept, 1);
    assert_eq!(admitted_at_once(&lower, 1), 0);
    clock.0.store(T0 + SECOND - 1, Ordering::SeqCst);
    assert_eq!(admitted_at_once(&lower, 1), 0);
    clock.0.store(T0 + SECOND, Ordering::SeqCst);
    assert_eq!(admitted_at_once(&lower, 1), 1);
    // Half of the 2 s burst in use at T0 + 2 s: half of the new one left.
    clock.0.store(T0 + 2 * SECOND, Ordering::SeqCst);
    let (higher, _) = lower.reloaded(rules(&rule_file("{ rate: 100, unit: second, burst: 100 }")));
    assert_eq!(admitted_at_once(&higher, 1), 50);
}
