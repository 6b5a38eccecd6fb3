//! The `limiter proxy` binary: bad clients, a dead upstream, a trusted
//! proxy's client, reloads of its rules and their JSON log events.

use std::{
    net::TcpStream,
    time::{Duration, Instant},
};

use limiter_tests::{TempDir, exchange, proxy, status};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_limits_and_survives_bad_clients() {
    let upstream_addr = limiter_tests::upstream().await;
    let dir = TempDir::new("proxy");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: api, match: { source: 127.0.0.0/8 }, limit: { rate: 3, unit: minute, burst: 3 } }\n",
    );
    let metrics = limiter_tests::free_loopback_addr();
    let extra = ["--header-timeout", "1s", "--metrics", &metrics];
    let p = proxy(&config, &format!("http://{upstream_addr}"), &extra);
    tokio::task::spawn_blocking(move || {
        let get = b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        // Malformed, oversized, slow and vanishing clients first: none is charged or breaks anything.
        assert_eq!(
            status(&exchange(p.addr, b"THIS IS NOT HTTP\r\n\r\n")),
            "400"
        );
        let huge = format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        assert_eq!(status(&exchange(p.addr, huge.as_bytes())), "431");
        let started = Instant::now();
        let slow = exchange(p.addr, b"GET / HTTP/1.1\r\nHost: x\r\n"); // never finishes its headers
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a slow sender held the connection"
        );
        assert!(matches!(status(&slow), "408" | "none"), "{slow}");
        drop(TcpStream::connect(p.addr).unwrap()); // connects and leaves
        // Then the limit: burst 3, the fourth is refused with 429.
        for _ in 0..3 {
            let answer = exchange(p.addr, get);
            assert_eq!(status(&answer), "200", "{answer}");
            assert!(answer.contains("from upstream"));
        }
        let limited = exchange(p.addr, get);
        assert_eq!(status(&limited), "429", "{limited}");
        assert!(
            limited.to_ascii_lowercase().contains("retry-after: "),
            "{limited}"
        );
        // The kernel's metric names, with layer="http".
        let scrape = exchange(metrics.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n");
        let line = |verdict: &str, n: u64| {
            format!(
                "limiter_packets_total{{layer=\"http\",rule=\"api\",verdict=\"{verdict}\"}} {n}"
            )
        };
        assert!(scrape.contains(&line("passed", 3)), "{scrape}");
        assert!(scrape.contains(&line("dropped", 1)), "{scrape}");
        // The classic text format unless the scraper asks for OpenMetrics.
        let head = |scrape: &str| {
            scrape
                .split("\r\n\r\n")
                .next()
                .unwrap_or("")
                .to_ascii_lowercase()
        };
        assert!(
            head(&scrape).contains("content-type: text/plain; version=0.0.4"),
            "{scrape}"
        );
        assert!(!scrape.contains("# EOF"), "{scrape}");
        let openmetrics = exchange(
            metrics.parse().unwrap(),
            b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text;version=1.0.0\r\n\r\n",
        );
        assert!(
            head(&openmetrics).contains("content-type: application/openmetrics-text"),
            "{openmetrics}"
        );
        assert!(openmetrics.trim_end().ends_with("# EOF"), "{openmetrics}");
    })
    .await
    .unwrap();
}

/// The statuses `n` GETs get through a proxy whose upstream is a port
/// nothing listens on.
async fn through_a_dead_upstream(name: &str, rules: &str, n: usize) -> Vec<String> {
    let dir = TempDir::new(name);
    let config = dir.write("rules.yaml", rules);
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let p = proxy(&config, &format!("http://{dead}"), &[]);
    tokio::task::spawn_blocking(move || {
        let get = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        (0..n)
            .map(|_| status(&exchange(p.addr, get)).to_owned())
            .collect()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_gets_502_and_shadow_passes() {
    // Over the limit, but a dry run: forwarded (and the upstream is dead).
    let rules =
        "rules:\n  - { name: dry, limit: { rate: 1, unit: minute, burst: 1 }, action: shadow }\n";
    assert_eq!(
        through_a_dead_upstream("proxy502", rules, 3).await,
        ["502", "502", "502"]
    );
}

/// Guards the README's "that request was charged": the limiter decides
/// before forwarding, so requests that met a dead upstream (502) used the
/// budget, and the next one over it is refused (429), not forwarded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_an_unreachable_upstream_is_charged() {
    let rules = "rules:\n  - { name: api, limit: { rate: 1, unit: hour, burst: 2 } }\n";
    assert_eq!(
        through_a_dead_upstream("proxy502charged", rules, 3).await,
        ["502", "502", "429"]
    );
}

/// Guards `--trusted-proxy`: behind a trusted proxy, the client is the
/// hop it recorded (the rightmost one it did not append itself: a client
/// prepending a lie is still itself), each with its own budget; without
/// it, the fields are ignored and the peer is the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_behind_a_trusted_proxy_is_the_one_it_names() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("trusted-proxy");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: clients, match: { source: 198.51.100.0/24 }, limit: { rate: 2, unit: minute, burst: 2 } }\n",
    );
    let trusting = proxy(&config, &upstream, &["--trusted-proxy", "127.0.0.0/8"]);
    let trusting_nobody = proxy(&config, &upstream, &[]);
    let reading_forwarded = proxy(
        &config,
        &upstream,
        &[
            "--trusted-proxy",
            "127.0.0.0/8",
            "--forwarded-header",
            "forwarded",
        ],
    );
    tokio::task::spawn_blocking(move || {
        let send = |p: &limiter_tests::Proxy, field: &str, value: &str| {
            let request = format!(
                "GET /x HTTP/1.1\r\nHost: x\r\n{field}: {value}\r\nConnection: close\r\n\r\n"
            );
            status(&exchange(p.addr, request.as_bytes())).to_owned()
        };
        let get = |p: &limiter_tests::Proxy, forwarded_for: &str| send(p, "X-Forwarded-For", forwarded_for);
        let statuses = |p, xff, n| (0..n).map(|_| get(p, xff)).collect::<Vec<_>>();
        assert_eq!(statuses(&trusting, "198.51.100.1", 3), ["200", "200", "429"]);
        assert_eq!(statuses(&trusting, "198.51.100.2", 2), ["200", "200"], "a budget of its own");
        assert_eq!(
            get(&trusting, "198.51.100.3, 198.51.100.1"),
            "429",
            "a client chose its address by prepending it"
        );
        // A `Forwarded` field of the client's own, beside the one the
        // proxy appended to, is not read.
        let request = "GET /x HTTP/1.1\r\nHost: x\r\nForwarded: for=198.51.100.50\r\nX-Forwarded-For: 198.51.100.1\r\nConnection: close\r\n\r\n";
        assert_eq!(
            status(&exchange(trusting.addr, request.as_bytes())),
            "429",
            "a client chose its address by a Forwarded field"
        );
        // Not trusted: 127.0.0.1 is the client, and no rule covers it.
        assert_eq!(statuses(&trusting_nobody, "198.51.100.1", 4), ["200"; 4]);
        // Told the proxies write `Forwarded`: that field names the client,
        // and `X-Forwarded-For` is not read.
        let forwarded = |value| send(&reading_forwarded, "Forwarded", value);
        assert_eq!(
            [forwarded("for=198.51.100.7"), forwarded("for=198.51.100.7"), forwarded("for=198.51.100.7")],
            ["200", "200", "429"]
        );
        assert_eq!(statuses(&reading_forwarded, "198.51.100.7", 3), ["200"; 3]);
    })
    .await
    .unwrap();
}

/// Guards rule reloads in `limiter proxy`: on SIGHUP, a rule file that
/// adds a rule keeps the buckets of the rules it leaves alone (a client
/// two requests into a burst of 3 gets one more, then 429); an invalid
/// file changes nothing; with `--watch`, a file changed on disk is read:
/// a rule whose limit alone changed keeps its keys' state, one with a new
/// key starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloading_the_proxys_rules_keeps_the_buckets() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("proxy-reload");
    let api = |rate: u32| {
        format!(
            "  - {{ name: api, match: {{ source: 127.0.0.0/8 }}, limit: {{ rate: {rate}, unit: minute, burst: 3 }} }}\n"
        )
    };
    let other =
        "  - { name: other, match: { source: 10.0.0.0/8 }, limit: { rate: 1, unit: second } }\n";
    let config = dir.write("rules.yaml", &format!("rules:\n{}", api(3)));
    let metrics = limiter_tests::free_loopback_addr();
    let p = proxy(&config, &upstream, &["--watch", "--metrics", &metrics]);
    tokio::task::spawn_blocking(move || {
        let get = || {
            exchange(
                p.addr,
                b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
        };
        let scrape = || exchange(metrics.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n");
        assert_eq!(status(&get()), "200");
        assert_eq!(status(&get()), "200");
        std::fs::write(&config, format!("rules:\n{}{other}", api(3))).unwrap();
        p.hang_up();
        limiter_tests::wait_until(
            || scrape().contains("rule=\"other\""),
            "the new rule never showed",
        );
        assert_eq!(status(&get()), "200", "the third of the burst");
        assert_eq!(status(&get()), "429", "the reload handed out a fresh burst");
        std::fs::write(&config, "rules: [ {").unwrap();
        p.hang_up();
        limiter_tests::wait_until(
            || scrape().contains("limiter_rule_file_rejections_total{layer=\"http\"} 1"),
            "the invalid file was never refused",
        );
        assert_eq!(status(&get()), "429", "an invalid file changed something");
        assert!(scrape().contains("rule=\"other\""));
        // Changed on disk, read without a signal: `api`'s limit alone
        // changed keeps its keys, the spent burst spent.
        std::fs::write(&config, format!("rules:\n{}", api(5))).unwrap();
        limiter_tests::wait_until(
            || {
                get()
                    .to_ascii_lowercase()
                    .contains("ratelimit-policy: \"api\";q=5")
            },
            "the changed file was not read",
        );
        assert_eq!(status(&get()), "429", "a new limit handed out a fresh burst");
        assert!(
            !scrape().contains("rule=\"other\""),
            "a removed rule is still counted"
        );
        // A new key is a new rule: it starts afresh.
        let by_24 = "  - { name: api, match: { source: 127.0.0.0/8 }, key: source/24, limit: { rate: 5, unit: minute, burst: 3 } }\n";
        std::fs::write(&config, format!("rules:\n{by_24}")).unwrap();
        limiter_tests::wait_until(
            || status(&get()) == "200",
            "a rule with a new key did not start afresh",
        );
    })
    .await
    .unwrap();
}

/// Guards a lowered limit in `limiter proxy` (SIGHUP): a client five
/// requests into a burst of 10 at 60 an hour has half its burst left;
/// lowered to 6 an hour with a burst of 4, it keeps that fraction in use
/// (2 of 4), so two more pass and the next is refused (an hour's units,
/// so the seconds the reload takes change nothing). A fresh bucket
/// would have passed 4, the old state read under the new limit 3. Keyed
/// by a header, so polls for the reload (each its own key) spend nothing
/// of the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_a_limit_in_the_proxy_hands_out_no_burst() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("proxy-lower");
    let rule = |rate: u32, burst: u32| {
        format!(
            "rules:\n  - {{ name: api, match: {{ source: 127.0.0.0/8 }}, key: header:x-user, limit: {{ rate: {rate}, unit: hour, burst: {burst} }} }}\n"
        )
    };
    let config = dir.write("rules.yaml", &rule(60, 10));
    let p = proxy(&config, &upstream, &[]);
    tokio::task::spawn_blocking(move || {
        let get = |user: &str| {
            exchange(
                p.addr,
                format!(
                    "GET /x HTTP/1.1\r\nHost: x\r\nX-User: {user}\r\nConnection: close\r\n\r\n"
                )
                .as_bytes(),
            )
        };
        for _ in 0..5 {
            assert_eq!(status(&get("alice")), "200");
        }
        std::fs::write(&config, rule(6, 4)).unwrap();
        p.hang_up();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut probe = 0;
        while !get(&format!("probe-{probe}"))
            .to_ascii_lowercase()
            .contains("ratelimit-policy: \"api\";q=6;")
        {
            assert!(Instant::now() < deadline, "the lowered limit never applied");
            probe += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        let after: Vec<String> = (0..3).map(|_| status(&get("alice")).to_owned()).collect();
        assert_eq!(after, ["200", "200", "429"], "2 of the new burst of 4 left");
    })
    .await
    .unwrap();
}

/// Guards `limiter proxy --log-format json`: a reload and a rejected file
/// are events with their fields, every line one JSON object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_logs_reloads_as_json_events() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("proxy-jsonlog");
    let rules = |rate: u32| {
        format!("rules:\n  - {{ name: api, limit: {{ rate: {rate}, unit: second }} }}\n")
    };
    let config = dir.write("rules.yaml", &rules(5));
    let log = dir.0.join("proxy.log");
    let p = limiter_tests::proxy_logged(&config, &upstream, &["--log-format", "json"], &log);
    tokio::task::spawn_blocking(move || {
        let events = |name: &str| -> Vec<serde_json::Value> {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            limiter_tests::json_lines(&text)
                .into_iter()
                .filter(|e| e["event"] == name)
                .collect()
        };
        let wait_for = |name: &str| {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(e) = events(name).pop() {
                    return e;
                }
                assert!(Instant::now() < deadline, "no {name} event");
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        std::fs::write(&config, rules(9)).unwrap();
        p.hang_up();
        let applied = wait_for("rules_applied");
        assert_eq!(
            (applied["kept"].as_u64(), applied["total"].as_u64()),
            (Some(1), Some(1))
        );
        assert!(
            applied["origin"]
                .as_str()
                .is_some_and(|o| o.ends_with("rules.yaml"))
        );
        assert!(applied["timestamp"].is_string() && applied["level"] == "INFO");
        std::fs::write(&config, "rules: [ {").unwrap();
        p.hang_up();
        let rejected = wait_for("rules_rejected");
        assert_eq!(rejected["level"], "ERROR");
        assert!(
            rejected["error"]
                .as_str()
                .is_some_and(|e| e.contains("rules.yaml")),
            "{rejected}"
        );
    })
    .await
    .unwrap();
}
