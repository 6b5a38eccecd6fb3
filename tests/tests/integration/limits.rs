//! Several limits in one rule (`limits: [...]`): a packet passes only if
//! every limit allows it, and one refused is charged to none. Exactly,
//! with the program's clock set by the test; on real traffic (arrivals
//! counted at the receiver); through the proxy.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use limiter::{
    http::{Limiter, RequestMeta},
    lab::Lab,
};
use limiter_tests::{
    TempDir, TestClock, XDP_DROP, XDP_PASS, exchange, flood, frames, loaded_object, rules, run_at,
    run_in_lab, snapshot, sources, status, test_clock_object,
};

const SECOND: u64 = 1_000_000_000;

/// 2 a second (burst 2) and 3 a minute (burst 3): two at once pass, the
/// third is refused by the per-second limit (and charges the per-minute
/// one nothing); a second later one more passes, and the next is refused
/// by the per-minute limit though the per-second one has room. A rule of
/// packets and bytes keeps working as before.
#[test]
fn the_kernel_passes_only_what_every_limit_allows() {
    let mut dp = loaded_object(
        &test_clock_object(),
        "rules:
  - { name: two, match: { source: 198.18.0.0/16 }, key: source, limits: [ { rate: 2, unit: second }, { rate: 3, unit: minute } ] }
  - { name: bytes, match: { source: 198.19.0.0/16 }, key: source, limits: [ { rate: 10, unit: second }, { bytes: 100, unit: minute } ] }
",
    );
    let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, 1), 53, 20);
    let t0 = 100 * SECOND;
    let at = |dp: &mut limiter_tests::Loaded, t| run_at(dp, &frame, t);
    assert_eq!(
        [at(&mut dp, t0), at(&mut dp, t0), at(&mut dp, t0)],
        [XDP_PASS, XDP_PASS, XDP_DROP]
    );
    assert_eq!(
        [at(&mut dp, t0 + SECOND), at(&mut dp, t0 + SECOND)],
        [XDP_PASS, XDP_DROP],
        "the third of the minute passes, the fourth is refused"
    );
    assert_eq!(
        at(&mut dp, t0 + 2 * SECOND),
        XDP_DROP,
        "the minute's budget is spent"
    );
    // 72 bytes a frame against 100 a minute: one passes, the next is refused.
    let small = frames::udp4(Ipv4Addr::new(198, 19, 0, 1), 53, 30);
    assert_eq!(
        [run_at(&mut dp, &small, t0), run_at(&mut dp, &small, t0)],
        [XDP_PASS, XDP_DROP]
    );
    let counters = snapshot(&dp);
    let two = counters.rules.iter().find(|r| r.name == "two").unwrap();
    assert_eq!(
        (two.counters.passed_packets, two.counters.dropped_packets),
        (3, 3)
    );
}

/// Three limits on one key, the third kept in the key state's third
/// word: 10 a second (burst 5), 200 bytes a second and 4 a minute. Three
/// 62-byte frames pass, the fourth is refused by the bytes (and charges
/// the minute nothing); a second later one more passes, and the next is
/// refused by the minute though the others have room. A third limit in
/// bytes (150 a minute) refuses the third frame.
#[test]
fn the_kernel_passes_only_what_all_three_limits_allow() {
    let mut dp = loaded_object(
        &test_clock_object(),
        "rules:
  - { name: three, match: { source: 198.18.0.0/16 }, key: source, limits: [ { rate: 10, unit: second, burst: 5 }, { bytes: 200, unit: second }, { rate: 4, unit: minute } ] }
  - { name: third-bytes, match: { source: 198.19.0.0/16 }, key: source, limits: [ { rate: 100, unit: second }, { bytes: 1000, unit: second }, { bytes: 150, unit: minute } ] }
",
    );
    let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, 1), 53, 20);
    assert_eq!(frame.len(), 62);
    let t0 = 100 * SECOND;
    let at = |dp: &mut limiter_tests::Loaded, t| run_at(dp, &frame, t);
    assert_eq!(
        [
            at(&mut dp, t0),
            at(&mut dp, t0),
            at(&mut dp, t0),
            at(&mut dp, t0)
        ],
        [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP],
        "the fourth frame's 62 bytes exceed 200 a second"
    );
    assert_eq!(
        [at(&mut dp, t0 + SECOND), at(&mut dp, t0 + SECOND)],
        [XDP_PASS, XDP_DROP],
        "the fourth of the minute passes (the refused frame charged it nothing), the fifth is refused"
    );
    let other = frames::udp4(Ipv4Addr::new(198, 19, 0, 1), 53, 20);
    assert_eq!(
        [
            run_at(&mut dp, &other, t0),
            run_at(&mut dp, &other, t0),
            run_at(&mut dp, &other, t0)
        ],
        [XDP_PASS, XDP_PASS, XDP_DROP],
        "124 bytes of 150 a minute pass, 186 would not"
    );
    let counters = snapshot(&dp);
    let count = |name: &str| {
        let r = counters.rules.iter().find(|r| r.name == name).unwrap();
        (r.counters.passed_packets, r.counters.dropped_packets)
    };
    assert_eq!(count("three"), (4, 2));
    assert_eq!(count("third-bytes"), (2, 1));
}

/// A source at 300 packets a second against 100 a second (burst 10) and
/// 150 a minute: over 2 s it gets the minute's burst of 150 and what the
/// minute refills meanwhile (2.5 a second), not the 210 the per-second
/// limit alone would pass.
#[test]
fn several_limits_hold_on_real_traffic() {
    let lab = Lab::create("lt-limits").expect("lab");
    let dir = TempDir::new("limits");
    let running = run_in_lab(
        &lab,
        &dir,
        "limits",
        "rules:
  - { name: two, match: { source: 198.18.0.0/16 }, key: source, limits: [ { rate: 100, unit: second, burst: 10 }, { rate: 150, unit: minute } ] }
",
    );
    let source = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));
    let (_, received) = flood(
        &lab,
        &sources(&lab, 0, &[source], 300, 32),
        Duration::from_secs(2),
    );
    let got = received.get(&source).copied().unwrap_or(0);
    assert!(
        (150..=158).contains(&got),
        "got {got}: 150 + 2.5/s for about 2 s"
    );
    running.stop().expect("limiter run stops cleanly");
}

/// The shape on real traffic, counted at the receiver: 300
/// packets a second of 74-byte frames against 100 a second (burst 10), 1
/// MB a second and 150 a minute (the third limit, in the key's third
/// word): over 2 s the minute's 150 and what it refills meanwhile pass.
/// A second source against 1,000 a second, 1 MB a second and 7,400
/// bytes a minute (a third limit in bytes) gets 100 frames and what the
/// minute refills (about 3).
#[test]
fn three_limits_hold_on_real_traffic() {
    let lab = Lab::create("lt-three").expect("lab");
    let dir = TempDir::new("three-limits");
    let running = run_in_lab(
        &lab,
        &dir,
        "three-limits",
        "rules:
  - { name: three, match: { source: 198.18.0.0/16 }, key: source, limits: [ { rate: 100, unit: second, burst: 10 }, { bytes: 1000000, unit: second }, { rate: 150, unit: minute } ] }
  - { name: third-bytes, match: { source: 198.19.0.0/16 }, key: source, limits: [ { rate: 1000, unit: second }, { bytes: 1000000, unit: second }, { bytes: 7400, unit: minute } ] }
",
    );
    let packets = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));
    let bytes = IpAddr::V4(Ipv4Addr::new(198, 19, 0, 1));
    let (_, received) = flood(
        &lab,
        &sources(&lab, 0, &[packets, bytes], 300, 32),
        Duration::from_secs(2),
    );
    let got = |source| received.get(&source).copied().unwrap_or(0);
    assert!(
        (150..=158).contains(&got(packets)),
        "got {}: 150 + 2.5/s for about 2 s",
        got(packets)
    );
    assert!(
        (100..=105).contains(&got(bytes)),
        "got {}: 100 frames of 74 bytes + 1.7/s for about 2 s",
        got(bytes)
    );
    running.stop().expect("limiter run stops cleanly");
}

/// Through the proxy: 10 a second (burst 2), 4 a minute, and 180 an hour
/// with a burst of 3 (the third limit, one request per 20 s, the longest
/// unit so kept in the third word). Requests 600 ms apart: three pass, the
/// fourth is refused by the third limit, and its fields say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_passes_only_what_all_three_limits_allow() {
    the_fourth_request_waits_for_the_minute(
        "proxy-three",
        "[ { rate: 10, unit: second, burst: 2 }, { rate: 4, unit: minute }, { rate: 180, unit: hour, burst: 3 } ]",
    )
    .await;
}

/// Through the proxy: 10 a second (burst 2) and 3 a minute. Requests
/// 600 ms apart (each within the per-second limit): three pass, the
/// fourth is refused by the per-minute limit, and its fields say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_passes_only_what_every_limit_allows() {
    the_fourth_request_waits_for_the_minute(
        "proxy-limits",
        "[ { rate: 10, unit: second, burst: 2 }, { rate: 3, unit: minute } ]",
    )
    .await;
}

/// Four requests 600 ms apart through a proxy whose rule has `limits`
/// of which the tightest allows 3 at once and one per 20 s: 200, 200,
/// 200, 429, the refusal saying to wait about 20 s, not 1;
/// and a fifth at once, which the per-second burst of 2 would allow, is
/// refused by the minute too.
async fn the_fourth_request_waits_for_the_minute(name: &str, limits: &str) {
    let (p, _dir) = limiter_tests::proxy_for(
        name,
        &format!(
            "rules:\n  - {{ name: api, match: {{ source: 127.0.0.0/8 }}, limits: {limits} }}\n"
        ),
        &[],
    )
    .await;
    tokio::task::spawn_blocking(move || {
        let get = b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let mut answers = Vec::new();
        for _ in 0..4 {
            answers.push(exchange(p.addr, get));
            std::thread::sleep(Duration::from_millis(600));
        }
        let statuses: Vec<&str> = answers.iter().map(|a| status(a)).collect();
        assert_eq!(statuses, ["200", "200", "200", "429"]);
        let refused = answers[3].to_ascii_lowercase();
        let retry: u64 = refused
            .lines()
            .find_map(|l| l.strip_prefix("retry-after: "))
            .and_then(|v| v.trim().parse().ok())
            .expect("a Retry-After field");
        assert!((10..=20).contains(&retry), "Retry-After {retry}: {refused}");
        assert!(refused.contains("x-ratelimit-remaining: 0"), "{refused}");
        assert_eq!(status(&exchange(p.addr, get)), "429");
    })
    .await
    .unwrap();
}

/// A streamed body is charged to the byte limits only: a third limit on
/// requests (5 a minute) is not charged its bytes, so 3 KB in 1 KB chunks
/// pass; a third limit on bytes (3,000 a minute) is, so the fourth 1 KB
/// chunk is refused.
#[test]
fn a_streamed_body_charges_a_third_limit_only_in_bytes() {
    let clock = std::sync::Arc::new(TestClock::default());
    let limiter = Limiter::new(
        rules(
            "rules:
  - { name: requests, match: { source: 10.1.0.0/16 }, limits: [ { rate: 10, unit: second }, { bytes: 1000000, unit: second }, { rate: 5, unit: minute } ] }
  - { name: bytes, match: { source: 10.2.0.0/16 }, limits: [ { rate: 100, unit: second }, { bytes: 1000000, unit: second }, { bytes: 3000, unit: minute } ] }
",
        ),
        clock.clone(),
    );
    clock
        .0
        .store(100 * SECOND, std::sync::atomic::Ordering::SeqCst);
    let chunks = |client: [u8; 4]| {
        let meta = RequestMeta {
            client: IpAddr::V4(Ipv4Addr::from(client)),
            port: None,
            key: None,
            bytes: 0,
            http: None,
        };
        assert!(limiter.check(&meta).allowed, "{client:?}: the request");
        let body = limiter.body_meter(&meta).expect("a rule with byte limits");
        (0..4)
            .map(|_| limiter.charge_body(&body, 1000))
            .collect::<Vec<_>>()
    };
    assert_eq!(chunks([10, 1, 0, 1]), [true; 4]);
    assert_eq!(chunks([10, 2, 0, 1]), [true, true, true, false]);
}

/// `limiter check --json` says what a script needs of the limits: each
/// with the unit it counts, shortest first whatever the file's order, the
/// credit classes and the escalation.
#[test]
fn check_json_lists_every_limit_and_policy() {
    let dir = TempDir::new("check-json");
    let config = dir.write(
        "rules.yaml",
        "rules:
  - name: three
    match: { source: 198.18.0.0/16, protocol: tcp }
    limits: [ { rate: 250, unit: day }, { bytes: 1000000, unit: second }, { rate: 10, unit: second } ]
    cost: [ { match: { tcp_flags: syn }, credits: 3 } ]
    escalate: { after: 10s, block: 10m }
",
    );
    let out = limiter_tests::limiter_command(
        None,
        &["check", "--json", "--config", &config.to_string_lossy()],
    )
    .output()
    .expect("limiter check");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let checked: serde_json::Value = serde_json::from_slice(&out.stdout).expect("check --json");
    let policies = &checked["rules"][0]["policies"];
    let limits: Vec<(u64, u64, &str)> = policies["limits"]
        .as_array()
        .expect("limits")
        .iter()
        .map(|l| {
            (
                l["rate"].as_u64().unwrap(),
                l["period_ns"].as_u64().unwrap(),
                l["counts"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        limits,
        [
            (10, SECOND, "packets"),
            (1_000_000, SECOND, "bytes"),
            (250, 86_400 * SECOND, "packets")
        ]
    );
    assert_eq!(policies["costs"][0]["tcp_flags"], "syn");
    assert_eq!(policies["costs"][0]["credits"], 3);
    assert_eq!(policies["escalate"]["after_ns"], 10 * SECOND);
    assert_eq!(policies["escalate"]["block_ns"], 600 * SECOND);
}
