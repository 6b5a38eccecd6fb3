//! Soft limits: what goes over a rule's soft limit is counted and passed,
//! what goes over its hard limit is refused; in the kernel (exactly, with
//! the program's clock set by the test; and on real traffic, arrivals
//! counted at the receiver) and through the proxy (statuses, the field
//! that says so, the metric).

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use limiter::lab::Lab;
use limiter_tests::{
    TempDir, XDP_PASS, exchange, flood, frames, limiter_command, loaded_object, run_at, run_in_lab,
    snapshot, sources, status, test_clock_object,
};

/// Hard 10/s with a burst of 5, soft 2/s with a burst of 2. Five packets
/// at once pass, three of them over the soft limit; a second later the
/// same again (both buckets whole once more); a rule without `soft`
/// counts nothing over it.
#[test]
fn the_kernel_counts_what_goes_over_the_soft_limit_and_passes_it() {
    let mut dp = loaded_object(
        &test_clock_object(),
        "rules:
  - { name: soft, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 10, unit: second, burst: 5 }, soft: { rate: 2, unit: second, burst: 2 } }
  - { name: hard, match: { source: 198.19.0.0/16 }, key: source, limit: { rate: 10, unit: second, burst: 5 } }
",
    );
    let t0 = 100_000_000_000;
    let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, 1), 53, 20);
    let other = frames::udp4(Ipv4Addr::new(198, 19, 0, 1), 53, 20);
    for t in [t0, t0 + 1_000_000_000] {
        for _ in 0..5 {
            assert_eq!(
                run_at(&mut dp, &frame, t),
                XDP_PASS,
                "within the hard limit"
            );
            assert_eq!(run_at(&mut dp, &other, t), XDP_PASS);
        }
    }
    // The sixth at once is over the hard limit: refused, not counted soft.
    assert_ne!(run_at(&mut dp, &frame, t0 + 1_000_000_000), XDP_PASS);
    let counters = snapshot(&dp);
    let rule = |name: &str| {
        counters
            .rules
            .iter()
            .find(|r| r.name == name)
            .expect("rule")
            .clone()
    };
    assert_eq!(rule("soft").counters.passed_packets, 10);
    assert_eq!(rule("soft").counters.dropped_packets, 1);
    assert_eq!(rule("soft").over_soft, 6, "3 of each 5 over the soft limit");
    assert_eq!(rule("hard").over_soft, 0);
}

/// A source at 300 packets a second, under a hard limit of 1,000 a second
/// and a soft one of 100 (burst 10): everything arrives (counted by
/// nftables at the receiver), and what the soft limit would not have
/// admitted, about 300·t − (10 + 100·t), is counted over it.
#[test]
fn over_the_soft_limit_on_real_traffic_everything_arrives_and_is_counted() {
    let lab = Lab::create("lt-soft").expect("lab");
    let dir = TempDir::new("soft");
    let running = run_in_lab(
        &lab,
        &dir,
        "soft",
        "rules:
  - { name: soft, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 1000, unit: second, burst: 100 }, soft: { rate: 100, unit: second, burst: 10 } }
",
    );
    let pin_dir = running.pin_dir.clone();
    let source = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));
    let duration = Duration::from_secs(3);
    let (report, received) = flood(&lab, &sources(&lab, 0, &[source], 300, 32), duration);
    let sent = report.sent[0];
    let arrived = received.get(&source).copied().unwrap_or(0);
    assert_eq!(arrived, sent, "everything within the hard limit arrives");
    let out = limiter_command(
        None,
        &["stats", "--json", "--pin-dir", &pin_dir.to_string_lossy()],
    )
    .output()
    .expect("limiter stats");
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    let rule = limiter_tests::stats_rule(&stats, "soft");
    assert_eq!(rule["passed_packets"], sent);
    assert_eq!(rule["dropped_packets"], 0);
    let over = rule["over_soft"].as_u64().expect("over_soft");
    // What the soft meter admits over the flood's span, give or take the
    // sender's pacing: a tenth of the rest either way.
    let admitted_soft = 10.0 + 100.0 * duration.as_secs_f64();
    let expected = sent as f64 - admitted_soft;
    assert!(
        (over as f64 - expected).abs() <= expected / 10.0,
        "over the soft limit: {over}, expected about {expected:.0} of {sent}"
    );
    // The same count in the metrics (as the daemon exports them, from the
    // pinned maps) and in `limiter stats`'s table.
    let maps = limiter::kernel::Maps::open_pinned(&pin_dir).expect("the pinned maps");
    let snapshot = limiter::kernel::counters::read(&maps).expect("counters");
    let metrics = limiter::render::openmetrics::render(&snapshot, Default::default());
    let exported: u64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("limiter_over_soft_packets_total{")
                && l.contains("layer=\"xdp\"")
                && l.contains("rule=\"soft\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(
        exported, over,
        "limiter_over_soft_packets_total in:\n{metrics}"
    );
    let table = limiter_command(None, &["stats", "--pin-dir", &pin_dir.to_string_lossy()])
        .output()
        .expect("limiter stats");
    let table = String::from_utf8_lossy(&table.stdout);
    let header: Vec<&str> = table
        .lines()
        .next()
        .expect("a header")
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    let column = header
        .iter()
        .position(|c| *c == "OVER SOFT pkts")
        .unwrap_or_else(|| panic!("no OVER SOFT column: {table}"));
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("soft "))
        .expect("the rule's row")
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(row[column], limiter::units::count(over), "{table}");
    running.stop().expect("limiter run stops cleanly");
}

/// Through the proxy: hard 3 a minute, soft 1. The first request is within
/// both; the next two are served with `X-RateLimit-Over-Soft` naming the
/// rule; the fourth is refused (429) and charged nothing soft; the metric
/// counts the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_over_the_soft_limit_and_says_so() {
    let metrics = limiter_tests::free_loopback_addr();
    let (p, _dir) = limiter_tests::proxy_for(
        "proxy-soft",
        "rules:\n  - { name: api, match: { source: 127.0.0.0/8 }, limit: { rate: 3, unit: minute, burst: 3 }, soft: { rate: 1, unit: minute, burst: 1 } }\n",
        &["--metrics", &metrics],
    )
    .await;
    tokio::task::spawn_blocking(move || {
        let get = b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let answers: Vec<String> = (0..4).map(|_| exchange(p.addr, get)).collect();
        let statuses: Vec<&str> = answers.iter().map(|a| status(a)).collect();
        assert_eq!(statuses, ["200", "200", "200", "429"]);
        let over: Vec<bool> = answers
            .iter()
            .map(|a| {
                a.to_ascii_lowercase()
                    .contains("x-ratelimit-over-soft: \"api\"")
            })
            .collect();
        assert_eq!(over, [false, true, true, false], "{answers:#?}");
        let scrape = exchange(metrics.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n");
        assert!(
            scrape.contains("limiter_over_soft_packets_total{layer=\"http\",rule=\"api\"} 2"),
            "{scrape}"
        );
    })
    .await
    .unwrap();
}
