//! One budget shared: by three hosts' kernels, capacity following the
//! flood, and by two proxies over HTTP.

use std::{net::Ipv4Addr, thread, time::Duration};

use limiter_tests::TempDir;

use super::{Fleet, GLOBAL, PARTITIONS, RESERVE, assert_rate, measure, wait_for};

/// Three hosts flooded at once admit the global rate plus their reserves
/// together, counted at their receivers; when the flood moves to one
/// host, the capacity follows it within a few seconds.
#[test]
fn three_hosts_share_one_budget_and_capacity_follows_the_flood() {
    let fleet = Fleet::start("fs");
    let bound = GLOBAL + 3.0 * RESERVE;
    let (all, held) = fleet.flood(&[0, 1, 2], Duration::from_secs(9), || {
        thread::sleep(Duration::from_millis(2500));
        let rates = measure(&fleet, Duration::from_secs(5));
        // Read while all three are still flooded: once the flood stops,
        // an idle host gives its partitions back.
        let held: u64 = (0..3).map(|n| fleet.held(n)).sum();
        (rates, held)
    });
    let total: f64 = all.iter().sum();
    println!("three hosts flooded: {all:.0?} pkts/s, {total:.0} together (bound {bound})");
    assert_rate(total, bound, 5.0, "the fleet's admitted total");
    assert!(
        all.iter().all(|&r| r >= RESERVE * 0.9),
        "a host got less than its reserve: {all:.0?}"
    );
    assert_eq!(held, PARTITIONS, "every partition held, none twice");

    // The flood moves to host 1 alone.
    let (followed, alone) = fleet.flood(&[1], Duration::from_secs(8), || {
        let followed = wait_for(Duration::from_secs(5), || fleet.held(1) == PARTITIONS);
        thread::sleep(Duration::from_millis(500));
        (followed, measure(&fleet, Duration::from_secs(3)))
    });
    let followed = followed.expect("host 1 did not get every partition within 5 s");
    println!("capacity followed the flood to host 1 in {followed:?}: {alone:.0?} pkts/s");
    assert!(
        followed < Duration::from_secs(3),
        "followed in {followed:?}"
    );
    assert_rate(
        alone[1],
        GLOBAL + RESERVE,
        5.0,
        "host 1 holding the whole budget",
    );
    assert_eq!(alone[0] + alone[2], 0.0, "hosts 0 and 2 were not flooded");
}

/// Two `limiter proxy` instances in front of one upstream share one
/// fleet-wide request budget through Redis (on loopback, the test's own):
/// together they answer 200 to the global rate plus their reserves, each
/// flooded beyond it, counted by the clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_share_one_http_budget() {
    use limiter::lab::store::RedisServer;

    let upstream_addr = limiter_tests::upstream().await;
    let dir = TempDir::new("fleet-proxies");
    let password = format!(
        "{:x}",
        u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    );
    let redis = RedisServer::start(None, &[Ipv4Addr::LOCALHOST.into()], 0, Some(&password))
        .expect("redis-server");
    let password_file = dir.write("password", &password);
    let fleet = dir.write(
        "fleet.yaml",
        &format!(
            "store:\n  url: {}\n  password_file: {}\nlease_ttl: 2s\n",
            redis.url(),
            password_file.display()
        ),
    );
    // 200 requests/s for the fleet in 20 partitions, 10/s each proxy keeps.
    let rules = dir.write(
        "rules.yaml",
        "rules:
  - name: api
    match: { source: 127.0.0.0/8 }
    limit: { rate: 1000000, unit: second }
    aggregate: { rate: 200, unit: second, burst: 10, scope: fleet, partitions: 20, reserve: 10 }
",
    );
    let upstream = format!("http://{upstream_addr}");
    let metrics: Vec<String> = (0..2)
        .map(|_| limiter_tests::free_loopback_addr())
        .collect();
    let proxies: Vec<_> = metrics
        .iter()
        .map(|m| {
            let fleet = fleet.to_string_lossy().into_owned();
            limiter_tests::proxy(&rules, &upstream, &["--fleet", &fleet, "--metrics", m])
        })
        .collect();
    // Each proxy offered 400 requests/s by 4 clients for 6 s; 200s counted
    // from 2 s on, once the shares have settled.
    let start = tokio::time::Instant::now();
    let (settle, window) = (Duration::from_secs(2), Duration::from_secs(4));
    let mut clients = Vec::new();
    for p in &proxies {
        for _ in 0..4 {
            let url = format!("http://{}/x", p.addr);
            clients.push(tokio::spawn(async move {
                let client: hyper_util::client::legacy::Client<_, axum::body::Body> =
                    hyper_util::client::legacy::Client::builder(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .build_http();
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                let (mut ok, mut limited) = (0u64, 0u64);
                while start.elapsed() < settle + window {
                    tick.tick().await;
                    let request = http::Request::get(&url)
                        .body(axum::body::Body::empty())
                        .unwrap();
                    let Ok(response) = client.request(request).await else {
                        continue;
                    };
                    let counted = start.elapsed() >= settle && start.elapsed() < settle + window;
                    match response.status().as_u16() {
                        200 if counted => ok += 1,
                        429 if counted => limited += 1,
                        _ => {}
                    }
                }
                (ok, limited)
            }));
        }
    }
    let mut per_proxy = [(0u64, 0u64); 2];
    for (i, client) in clients.into_iter().enumerate() {
        let (ok, limited) = client.await.unwrap();
        per_proxy[i / 4].0 += ok;
        per_proxy[i / 4].1 += limited;
    }
    let scrapes: Vec<String> = metrics
        .iter()
        .map(|m| limiter_tests::exchange(m.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n"))
        .collect();
    let total: u64 = per_proxy.iter().map(|(ok, _)| ok).sum();
    let bound = (200.0 + 2.0 * 10.0) * window.as_secs_f64();
    println!(
        "two proxies: (200s, 429s) = {per_proxy:?}; {total} 200s in {window:?} (bound {bound})"
    );
    assert!(
        per_proxy.iter().all(|(_, limited)| *limited > 0),
        "a proxy was not flooded beyond its share: {per_proxy:?}"
    );
    assert_rate(total as f64, bound, 5.0, "200s of both proxies together");
    let held: u64 = scrapes
        .iter()
        .map(|scrape| {
            scrape
                .lines()
                .find(|l| {
                    l.starts_with("limiter_fleet_partitions_held{layer=\"http\",rule=\"api\"}")
                })
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no partitions gauge in\n{scrape}"))
        })
        .sum();
    assert_eq!(held, 20, "every partition held once: {scrapes:?}");
}
