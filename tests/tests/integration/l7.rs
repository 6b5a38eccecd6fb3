//! Layer 7: the conformance corpus replayed over real HTTP connections
//! through the tower layer, the rate-limit response fields, and the
//! `limiter proxy` binary facing bad clients and a dead upstream. All on
//! loopback.

use std::{
    net::{SocketAddr, TcpStream},
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use axum::{Router, body::Body, routing::any};
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use limiter::http::{CostBy, KeyBy, Limiter, RateLimitLayer, Reloadable};
use limiter_conformance::{assert_same, assert_same_over_soft};
use limiter_tests::{
    TempDir, TestClock, exchange, proxy, reference, rules, status, traces::corpus,
};

/// Serves `router` behind the layer on a loopback port.
async fn serve(layer: RateLimitLayer) -> SocketAddr {
    let app = Router::new()
        .route("/", any(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("serve")
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_verdicts_match_the_reference_on_every_trace() {
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let mut softs = 0;
    for trace in corpus() {
        let clock = Arc::new(TestClock::default());
        let limiter = Arc::new(Reloadable::new(Arc::new(Limiter::new(
            rules(&trace.spec.rule_file(&trace.spec.http_cost())),
            clock.clone(),
        ))));
        let layer = RateLimitLayer::reloadable(Arc::clone(&limiter))
            .key_by(KeyBy::Header(HeaderName::from_static("x-key")))
            .cost_by(CostBy::Custom(Arc::new(|parts| {
                parts
                    .headers
                    .get("x-cost")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(0)
            })));
        let addr = serve(layer).await;
        let mut got = Vec::new();
        let mut got_over_soft = Vec::new();
        let mut changes = trace.changes.iter().peekable();
        for (i, a) in trace.arrivals.iter().enumerate() {
            while let Some(change) = changes.next_if(|c| c.at <= i) {
                clock.0.store(change.t, Ordering::SeqCst);
                assert_eq!(
                    limiter.reload(rules(&change.spec.rule_file(&change.spec.http_cost()))),
                    1
                );
                limiter.settle();
            }
            clock.0.store(a.t, Ordering::SeqCst);
            // The rule's costly class is a POST.
            let method = if a.costly { "POST" } else { "GET" };
            let request = Request::builder()
                .method(method)
                .uri(format!("http://{addr}/"))
                .header("x-key", a.key.to_string())
                .header("x-cost", a.cost.to_string())
                .body(Body::empty())
                .unwrap();
            let response = client.request(request).await.expect("request");
            let status = response.status();
            assert!(
                status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
                "{status}"
            );
            got.push(status == StatusCode::OK);
            // Served over the soft limit: the field names the rule.
            let over_soft = response.headers().get("x-ratelimit-over-soft");
            if let Some(rule) = over_soft {
                assert_eq!(rule, "\"trace\"", "{}", trace.name);
            }
            got_over_soft.push(over_soft.is_some());
        }
        let expected = reference::judge(&trace);
        assert_same(&trace, &expected.admitted, &got, "HTTP");
        assert_same_over_soft(&trace, &expected.over_soft, &got_over_soft, "HTTP");
        softs += usize::from(trace.spec.soft.is_some());
    }
    assert_eq!(softs, 3, "traces with a soft limit replayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_requests_get_429_with_the_rate_limit_fields() {
    let clock = Arc::new(TestClock::default());
    clock.0.store(1_000_000_000_000, Ordering::SeqCst);
    let text = "rules:\n  - { name: api, limit: { rate: 2, unit: minute, burst: 2 } }\n";
    let limiter = Arc::new(Limiter::new(rules(text), clock.clone()));
    let addr = serve(RateLimitLayer::new(limiter)).await;
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let get = || {
        Request::get(format!("http://{addr}/"))
            .body(Body::empty())
            .unwrap()
    };
    let first = client.request(get()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let h = first.headers();
    assert_eq!(h["ratelimit-policy"], "\"api\";q=2;w=60");
    assert_eq!(h["x-ratelimit-limit"], "2");
    assert_eq!(h["x-ratelimit-remaining"], "1");
    assert_eq!(h["ratelimit"], "\"api\";r=1;t=30");
    assert!(h.get("retry-after").is_none());
    assert_eq!(
        client.request(get()).await.unwrap().status(),
        StatusCode::OK
    );
    let limited = client.request(get()).await.unwrap();
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    let h = limited.headers().clone();
    assert_eq!(h["retry-after"], "30");
    assert_eq!(h["x-ratelimit-remaining"], "0");
    assert_eq!(h["ratelimit"], "\"api\";r=0;t=60");
    let body = limited.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("rate limited by rule \"api\""));
    // 30 s later one more fits.
    clock.0.fetch_add(30_000_000_000, Ordering::SeqCst);
    assert_eq!(
        client.request(get()).await.unwrap().status(),
        StatusCode::OK
    );
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pacing_holds_requests_until_they_conform() {
    // 10 per second, burst 1, held up to 250 ms: the 2nd and 3rd requests
    // wait 100 and 200 ms; the 4th would wait 300 ms and is refused.
    let text =
        "rules:\n  - { name: paced, limit: { rate: 10, unit: second, burst: 1, delay: 250ms } }\n";
    let limiter = Arc::new(Limiter::new(
        rules(text),
        Arc::new(limiter::http::SystemClock),
    ));
    let addr = serve(RateLimitLayer::new(limiter)).await;
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let get = || {
        Request::get(format!("http://{addr}/"))
            .body(Body::empty())
            .unwrap()
    };
    let start = Instant::now();
    let (a, b, c, d) = tokio::join!(
        client.request(get()),
        client.request(get()),
        client.request(get()),
        client.request(get())
    );
    let mut statuses: Vec<StatusCode> = [a, b, c, d]
        .into_iter()
        .map(|r| r.unwrap().status())
        .collect();
    statuses.sort();
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(190) && elapsed < Duration::from_millis(1000),
        "{elapsed:?}"
    );
}

/// Whether `limiter` admits a request from client `client` (10.0.0.0
/// plus `client`) at `t` ns.
fn admitted(limiter: &Limiter, clock: &TestClock, client: u32, t: u64) -> bool {
    clock.0.store(t, Ordering::SeqCst);
    limiter
        .check(&limiter::http::RequestMeta {
            client: std::net::Ipv4Addr::from(0x0a00_0000 + client).into(),
            port: None,
            key: None,
            bytes: 0,
            http: None,
        })
        .allowed
}

/// Guards the key store against churn: 1,000 other clients cannot make it
/// forget a client in debt (before, 1,001 addresses evicted a limited
/// client's state and it came back with a fresh burst). With every key
/// kept in debt, new clients are refused and counted, as the kernel's key
/// table refuses them, and the store stays within `max_keys`.
#[test]
fn the_key_store_never_forgets_a_client_in_debt() {
    let clock = Arc::new(TestClock::default());
    let text = "max_keys: 100\nrules:\n  - { name: a, limit: { rate: 1, unit: hour, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let check = |client: u32, t: u64| admitted(&limiter, &clock, client, t);
    let limited = 7;
    assert!(check(limited, 1));
    assert!(!check(limited, 2), "spent its one an hour");
    let admitted = (1_000..2_000)
        .filter(|&i| check(i, 3 + u64::from(i)))
        .count();
    assert_eq!(admitted, 99, "room for 99 more keys, all then in debt");
    assert!(limiter.tracked_keys() <= 100);
    assert_eq!(limiter.key_alloc_failures(), 901);
    assert!(!check(limited, 5_000), "the limited client was forgotten");
}

/// A dual-stack listener sees IPv4 clients as `::ffff:a.b.c.d`: they are
/// judged as the IPv4 clients they are, by IPv4 rules and one key each
/// (before, no IPv4 rule matched them, and a catch-all put every IPv4
/// client in one /64 bucket).
#[test]
fn ipv4_clients_seen_as_mapped_ipv6_are_ipv4_clients() {
    let clock = Arc::new(TestClock::default());
    let text = "default: drop\nrules:\n  - { name: v4, match: { source: 10.0.0.0/8 }, limit: { rate: 1, unit: hour, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let mapped = |last: u8| limiter::http::RequestMeta {
        client: std::net::Ipv4Addr::new(10, 0, 0, last)
            .to_ipv6_mapped()
            .into(),
        port: None,
        key: None,
        bytes: 0,
        http: None,
    };
    clock.0.store(1, Ordering::SeqCst);
    let first = limiter.check(&mapped(1));
    assert!(first.allowed);
    assert_eq!(limiter.rule_name(&first), "v4");
    assert!(!limiter.check(&mapped(1)).allowed, "one budget per client");
    assert!(
        limiter.check(&mapped(2)).allowed,
        "another client, another key"
    );
    assert_eq!(limiter.tracked_keys(), 2);
}

/// Guards the store against a cheap lockout: under a per-day limit with a
/// large burst, a client that sent one request is at rest again once its
/// one emission interval has passed (86.4 s at 1,000 a day), not a whole
/// day later (before, 100 one-off clients locked every new client out of
/// a 100-key store for a day).
#[test]
fn a_key_rests_when_its_budget_is_whole_not_a_day_later() {
    let clock = Arc::new(TestClock::default());
    let text =
        "max_keys: 100\nrules:\n  - { name: a, limit: { rate: 1000, unit: day, burst: 1000 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let check = |client: u32, t: u64| admitted(&limiter, &clock, client, t);
    const SECOND: u64 = 1_000_000_000;
    for key in 0..100 {
        assert!(check(key, u64::from(key) + 1));
    }
    assert!(!check(100, 10 * SECOND), "room while every key is in debt");
    assert!(
        check(101, 90 * SECOND),
        "locked out after the keys came to rest"
    );
    assert_eq!(limiter.key_alloc_failures(), 1);
}

/// Guards the eviction order: past `max_keys`, keys at rest (their
/// budget whole again) are forgotten least recently seen first, down to
/// half, and new keys are admitted; a key seen recently stays.
#[test]
fn the_key_store_forgets_keys_at_rest_least_recently_seen_first() {
    let clock = Arc::new(TestClock::default());
    // One a second: a key unseen for a second is at rest.
    let text =
        "max_keys: 100\nrules:\n  - { name: a, limit: { rate: 1, unit: second, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let check = |client: u32, t: u64| admitted(&limiter, &clock, client, t);
    const SECOND: u64 = 1_000_000_000;
    for key in 0..100 {
        assert!(check(key, u64::from(key) + 1));
    }
    // Key 0 is seen again 2 s later (at rest, so admitted, and now the
    // most recent); then key 100 finds the store full, of keys at rest.
    assert!(check(0, 2 * SECOND));
    assert!(check(100, 2 * SECOND + 1));
    assert_eq!(
        limiter.tracked_keys(),
        51,
        "forgotten down to half, then the new key"
    );
    assert_eq!(limiter.key_alloc_failures(), 0);
    // Key 0, seen a moment ago, is in debt again: remembered, so refused.
    assert!(!check(0, 2 * SECOND + 2));
}

#[test]
fn shadow_rules_pass_and_count_the_excess() {
    let clock = Arc::new(TestClock::default());
    clock.0.store(1_000_000_000, Ordering::SeqCst);
    let text =
        "rules:\n  - { name: dry, limit: { rate: 1, unit: minute, burst: 2 }, action: shadow }\n";
    let limiter = Limiter::new(rules(text), clock);
    let request = limiter::http::RequestMeta {
        client: [198, 18, 0, 1].into(),
        port: None,
        key: None,
        bytes: 0,
        http: None,
    };
    let decisions: Vec<(bool, bool)> = (0..4)
        .map(|_| limiter.check(&request))
        .map(|d| (d.allowed, d.shadow))
        .collect();
    assert_eq!(
        decisions,
        [(true, false), (true, false), (true, true), (true, true)]
    );
    let c = &limiter.counters[0];
    let counts = [&c.passed, &c.dropped, &c.shadow].map(|n| n.get());
    assert_eq!(counts, [2, 0, 2]);
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

/// `limiter proxy --trace` whose stdout nobody reads (a pipe that fills
/// after a few hundred lines): every request is still answered, the
/// lines it could not write are dropped, counted in the metrics and
/// warned of. (Before, every worker blocked in a write of stdout after
/// 559 requests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_trace_reader_never_holds_a_request_up() {
    const REQUESTS: usize = 6_000;
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let metrics = limiter_tests::free_loopback_addr();
    let dir = TempDir::new("proxy-trace-stall");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: all, match: { source: 127.0.0.0/8 }, limit: unlimited }\n",
    );
    let log = dir.0.join("proxy.log");
    let p = limiter_tests::proxy_unread(
        &config,
        &upstream,
        &["--trace", "--trace-json", "--metrics", &metrics],
        &log,
    );
    tokio::task::spawn_blocking(move || {
        let get = b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        for i in 0..REQUESTS {
            let answer = exchange(p.addr, get);
            assert_eq!(status(&answer), "200", "request {i}: {answer}");
        }
        let scrape = exchange(metrics.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n");
        let dropped: u64 = scrape
            .lines()
            .find_map(|l| l.strip_prefix("limiter_trace_lines_dropped_total "))
            .unwrap_or_else(|| panic!("no trace drop count: {scrape}"))
            .trim()
            .parse()
            .expect("a count");
        println!("trace lines dropped: {dropped} of {REQUESTS}");
        // The pipe and the queue (4,096 lines) hold the rest.
        assert!(
            dropped >= (REQUESTS - 4_096 - 1_000) as u64 && dropped < REQUESTS as u64,
            "{dropped} of {REQUESTS} lines dropped"
        );
        let logged = std::fs::read_to_string(&log).expect("the proxy's log");
        assert!(
            logged.contains("--trace: 1 lines dropped so far"),
            "{logged}"
        );
        drop(p);
    })
    .await
    .unwrap();
}

/// `limiter proxy --trace`: the same lines as `limiter trace`, for the
/// clients and verdicts asked for, agreeing with the statuses the clients
/// got: a burst of 3 passes with 2, 1, 0 left, then 429s by the key's
/// request meter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_traces_its_decisions() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("proxy-trace");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: clients, match: { source: 198.51.100.0/24 }, limit: { rate: 3, unit: minute, burst: 3 } }\n",
    );
    let out = dir.0.join("trace.jsonl");
    let p = limiter_tests::proxy_printing(
        &config,
        &upstream,
        &[
            "--trusted-proxy",
            "127.0.0.0/8",
            "--trace",
            "--trace-json",
            "--trace-source",
            "198.51.100.1",
        ],
        &out,
    );
    let listen = p.addr.to_string();
    let statuses = tokio::task::spawn_blocking(move || {
        let get = |client: &str| {
            let request = format!(
                "GET /x HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: {client}\r\nConnection: close\r\n\r\n"
            );
            status(&exchange(p.addr, request.as_bytes())).to_owned()
        };
        let traced: Vec<String> = (0..5).map(|_| get("198.51.100.1")).collect();
        assert_eq!(get("198.51.100.2"), "200", "another client, not traced");
        traced
    })
    .await
    .unwrap();
    assert_eq!(statuses, ["200", "200", "200", "429", "429"]);
    let text = std::fs::read_to_string(&out).unwrap();
    // (After the line saying where it listens.)
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 5, "{text}");
    for (i, (line, status)) in lines.iter().zip(&statuses).enumerate() {
        assert_eq!(line["layer"], "http");
        assert_eq!(line["protocol"], "http");
        assert_eq!(line["interface"], listen.as_str());
        assert_eq!(line["source"], "198.51.100.1");
        assert_eq!(line["rule"], "clients");
        let expected = if status == "200" { "passed" } else { "dropped" };
        assert_eq!(line["verdict"], expected, "{line}");
        let left = &line["left"][0];
        assert_eq!(left["meter"], "key packets");
        assert_eq!(left["of"], 3);
        assert_eq!(left["left"], 2u64.saturating_sub(i as u64), "{line}");
        if expected == "dropped" {
            assert_eq!(line["refused_by"], "key packets", "{line}");
        } else {
            assert!(line["refused_by"].is_null(), "{line}");
        }
    }
    // As text, refusals only: the header, then a line per 429, each
    // starting with its time of day.
    let out = dir.0.join("trace.txt");
    let p = limiter_tests::proxy_printing(
        &config,
        &upstream,
        &[
            "--trusted-proxy",
            "127.0.0.0/8",
            "--trace",
            "--trace-verdict",
            "dropped",
        ],
        &out,
    );
    let (p, statuses) = tokio::task::spawn_blocking(move || {
        let request =
            b"GET /x HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 198.51.100.1\r\nConnection: close\r\n\r\n";
        let statuses: Vec<String> = (0..5)
            .map(|_| status(&exchange(p.addr, request)).to_owned())
            .collect();
        (p, statuses)
    })
    .await
    .unwrap();
    assert_eq!(statuses, ["200", "200", "200", "429", "429"]);
    // Lines are written by a thread of their own: read once they are all
    // there (or a second later, if more come), before the proxy stops.
    let after_header = |text: &str| -> Option<Vec<String>> {
        let header = text
            .lines()
            .position(|l| l.starts_with("TIME ") && l.contains("VERDICT"))?;
        Some(
            text.lines()
                .skip(header + 1)
                // (The line saying where it listens comes after the header.)
                .filter(|l| !l.starts_with("limiter proxy: listening"))
                .map(str::to_owned)
                .collect(),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while after_header(&std::fs::read_to_string(&out).unwrap()).map_or(0, |l| l.len()) < 2
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(p);
    let text = std::fs::read_to_string(&out).unwrap();
    let traced = after_header(&text).unwrap_or_else(|| panic!("no header: {text}"));
    assert_eq!(traced.len(), 2, "the refusals only: {text}");
    for line in &traced {
        let time = line.split_whitespace().next().unwrap_or_default();
        let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
        let parts: Vec<&str> = time.split([':', '.']).collect();
        assert!(
            parts.len() == 4 && parts[..3].iter().all(|p| digits(p, 2)) && digits(parts[3], 6),
            "a time of day to the microsecond first: {line}"
        );
        assert!(
            line.contains(" clients ")
                && line.contains(" dropped ")
                && line.contains("by key packets"),
            "{line}"
        );
    }
}

/// Guards client-side pacing against `limiter proxy`: 40 requests at once
/// from a client paced to 15/s, through a proxy allowing 20/s (burst 5),
/// are all answered 200, most of them held first; a client with no budget
/// of its own that heeds the server's `RateLimit` and `Retry-After` fields
/// is never refused by a proxy allowing 2/s (burst 2), where one that
/// sends regardless is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paced_and_heeding_clients_are_not_refused() {
    use hyper_util::client::legacy::connect::HttpConnector;
    use limiter::http::client::PacingLayer;
    use tower::{Layer, Service, ServiceExt};

    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("pacing");
    let limit = |rate, burst| {
        format!(
            "rules:\n  - {{ name: api, match: {{ source: 127.0.0.0/8 }}, limit: {{ rate: {rate}, unit: second, burst: {burst} }} }}\n"
        )
    };
    let fast = proxy(&dir.write("fast.yaml", &limit(20, 5)), &upstream, &[]);
    let slow = proxy(&dir.write("slow.yaml", &limit(2, 2)), &upstream, &[]);
    let client =
        || -> Client<HttpConnector, Body> { Client::builder(TokioExecutor::new()).build_http() };
    let refusals = |s: &[u16]| s.iter().filter(|&&c| c == 429).count();

    let budget = rules("rules:\n  - { name: pace, limit: { rate: 15, unit: second, burst: 5 } }\n");
    let limiter::rules::Limit::Metered {
        packets: budget, ..
    } = budget.rules[0].limit
    else {
        unreachable!()
    };
    let paced = PacingLayer::new(budget, 64, Duration::from_secs(10));
    let stats = paced.stats();
    let service = paced.layer(client());
    let url = format!("http://{}/x", fast.addr);
    let at_once: Vec<_> = (0..40)
        .map(|_| {
            let (mut service, url) = (service.clone(), url.clone());
            tokio::spawn(async move {
                let request = Request::get(&url).body(Body::empty()).unwrap();
                let response = service.ready().await.unwrap().call(request).await;
                response.map(|r| r.status().as_u16()).unwrap_or(0)
            })
        })
        .collect();
    let mut got = Vec::new();
    for request in at_once {
        got.push(request.await.unwrap());
    }
    assert!(got.iter().all(|&c| c == 200), "{got:?}");
    let delayed = stats.delayed.load(Ordering::Relaxed);
    assert!(delayed >= 30, "{delayed} of 40 held");

    let url = format!("http://{}/x", slow.addr);
    let heeding = PacingLayer::new(None, 64, Duration::from_secs(10));
    let heeding_stats = heeding.stats();
    let heed = statuses(heeding.layer(client()), &url, 8).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let blind = statuses(client(), &url, 8).await;
    println!(
        "paced: {delayed} of 40 held; heeding: {heed:?} ({} held); blind: {blind:?}",
        heeding_stats.delayed.load(Ordering::Relaxed)
    );
    assert_eq!(refusals(&heed), 0, "{heed:?}");
    assert!(heeding_stats.delayed.load(Ordering::Relaxed) >= 2);
    assert!(refusals(&blind) >= 1, "{blind:?}");
}

/// The statuses of `n` GETs of `url` sent one after the other through
/// `service` (0: not sent).
async fn statuses<S, R>(mut service: S, url: &str, n: usize) -> Vec<u16>
where
    S: tower::Service<Request<Body>, Response = http::Response<R>>,
    S::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let mut out = Vec::new();
    for _ in 0..n {
        let request = Request::get(url).body(Body::empty()).unwrap();
        let response = service.ready().await.unwrap().call(request).await;
        out.push(response.map(|r| r.status().as_u16()).unwrap_or(0));
    }
    out
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

/// Guards HTTP/2: a client that speaks h2c (prior knowledge) goes through
/// `limiter proxy` to an HTTP/1.1 upstream, on one connection, and the
/// limit applies to it as to HTTP/1.1 (burst 2: the third is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served_and_limited() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("h2c");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: api, match: { source: 127.0.0.0/8 }, limit: { rate: 2, unit: minute, burst: 2 } }\n",
    );
    let p = proxy(&config, &upstream, &[]);
    let client: Client<_, Body> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let mut got = Vec::new();
    for _ in 0..3 {
        let response = client
            .request(
                Request::get(format!("http://{}/x", p.addr))
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .expect("an HTTP/2 exchange");
        assert_eq!(response.version(), http::Version::HTTP_2);
        let status = response.status();
        let fields = rate_limit_fields(response.headers());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        got.push((
            status.as_u16(),
            String::from_utf8_lossy(&body).into_owned(),
            fields,
        ));
    }
    assert_eq!((got[0].0, got[1].0, got[2].0), (200, 200, 429), "{got:?}");
    assert_eq!(got[0].1, "from upstream");
    // The fields HTTP/1.1 responses carry, over HTTP/2 too.
    let policy = || Some("\"api\";q=2;w=60".to_owned());
    assert_eq!(got[1].2, [policy(), None], "{got:?}");
    assert_eq!(got[2].2, [policy(), Some("30".to_owned())], "{got:?}");
}

/// Issue 35: HTTP/2 kept a field value's surrounding whitespace, so
/// `" good"` was a fresh key for a spent `good` (an upstream trimming it
/// served it as `good`). Such a request is malformed (RFC 9113 8.2.1):
/// refused with 400, charged nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_values_with_surrounding_whitespace_are_refused() {
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("h2-whitespace");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: keyed, key: header:x-api-key, limit: { rate: 1, unit: minute, burst: 1 } }\n",
    );
    let p = proxy(&config, &upstream, &[]);
    let client: Client<_, Body> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let mut got = Vec::new();
    for key in ["good", " good", "good\t", "good"] {
        let response = client
            .request(
                Request::get(format!("http://{}/x", p.addr))
                    .header("x-api-key", key)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .expect("an HTTP/2 exchange");
        got.push(response.status().as_u16());
    }
    assert_eq!(got, [200, 400, 400, 429]);
}

/// A response's `RateLimit-Policy` and `Retry-After`.
fn rate_limit_fields(headers: &http::HeaderMap) -> [Option<String>; 2] {
    ["ratelimit-policy", "retry-after"]
        .map(|name| Some(headers.get(name)?.to_str().ok()?.to_owned()))
}

/// Guards TLS: with a certificate, `limiter proxy` speaks HTTP/2 or
/// HTTP/1.1 over TLS as ALPN says, and limits both (burst 2: the third
/// request, whichever protocol, is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_clients_get_http2_or_http1_by_alpn_and_are_limited() {
    use hyper_util::rt::TokioIo;
    use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};

    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("proxy-tls");
    let (tls, _, _) = limiter::lab::store::certificates(&dir.0).expect("openssl certificates");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: api, match: { source: 127.0.0.0/8 }, limit: { rate: 2, unit: minute, burst: 2 } }\n",
    );
    let (cert, key) = (tls.cert.to_string_lossy(), tls.key.to_string_lossy());
    let p = proxy(
        &config,
        &upstream,
        &["--tls-cert", &cert, "--tls-key", &key],
    );
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(&tls.ca).unwrap())
        .unwrap();
    let connect = |alpn: &'static [u8]| {
        let mut config = rustls::ClientConfig::builder()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        async move {
            let tcp = tokio::net::TcpStream::connect(p.addr).await.unwrap();
            let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
            let stream = connector.connect(name, tcp).await.expect("a TLS handshake");
            assert_eq!(stream.get_ref().1.alpn_protocol(), Some(alpn));
            TokioIo::new(stream)
        }
    };
    let get = || {
        Request::get(format!("https://127.0.0.1:{}/x", p.addr.port()))
            .body(Body::empty())
            .unwrap()
    };
    let (mut h2, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), connect(b"h2").await)
            .await
            .unwrap();
    tokio::spawn(connection);
    let first = h2.send_request(get()).await.unwrap();
    assert_eq!(
        (first.status(), first.version()),
        (StatusCode::OK, http::Version::HTTP_2)
    );
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"from upstream");
    let (mut h1, connection) = hyper::client::conn::http1::handshake(connect(b"http/1.1").await)
        .await
        .unwrap();
    tokio::spawn(connection);
    let second = h1.send_request(get()).await.unwrap();
    assert_eq!(
        (second.status(), second.version()),
        (StatusCode::OK, http::Version::HTTP_11)
    );
    second.into_body().collect().await.unwrap();
    let third = h2.send_request(get()).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        rate_limit_fields(third.headers()),
        [Some("\"api\";q=2;w=60".to_owned()), Some("30".to_owned())]
    );
}

/// Rules with layer-7 conditions and keys, through the real proxy: a rule
/// applies only to the requests whose method, path and headers it names,
/// the most specific first; a key made of a header (or of the client and
/// the path) gives each value its own bucket; a request without the header
/// a rule is keyed by falls to the next rule, of the same match or not.
/// The kernel refuses the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer7_rules_match_and_key_requests_by_their_fields() {
    let upstream_addr = limiter_tests::upstream().await;
    let dir = TempDir::new("proxy-l7");
    let config = dir.write(
        "rules.yaml",
        "rules:
  - name: per-path
    key: [source, path]
    limit: { rate: 1, unit: minute, burst: 1 }
  - name: per-api-key
    match: { path_prefix: /api/ }
    key: header:x-api-key
    limit: { rate: 3, unit: minute, burst: 3 }
  - name: per-client-id
    match: { path_prefix: /api/ }
    key: header:x-client-id
    limit: { rate: 1, unit: minute, burst: 1 }
  - name: login
    match: { method: POST, path: /login, headers: [{ name: x-debug, present: false }] }
    limit: { rate: 2, unit: minute, burst: 2 }
",
    );
    let check = limiter_tests::limiter_command(
        None,
        &["check", "--json", "--config", &config.to_string_lossy()],
    )
    .output()
    .expect("limiter check");
    let checked: serde_json::Value = serde_json::from_slice(&check.stdout).expect("check --json");
    assert_eq!(checked["rules"][3]["layer7_only"], "match.method");
    assert_eq!(
        checked["rules"][0]["key_parts"],
        serde_json::json!(["source", "path"])
    );
    let p = proxy(&config, &format!("http://{upstream_addr}"), &[]);
    tokio::task::spawn_blocking(move || {
        let send = |request: &str| {
            let answer = exchange(p.addr, request.as_bytes());
            let status = status(&answer).to_owned();
            let rule = answer
                .lines()
                .find_map(|l| l.strip_prefix("ratelimit-policy: ").or_else(|| l.strip_prefix("RateLimit-Policy: ")))
                .and_then(|v| v.split('"').nth(1))
                .unwrap_or("-")
                .to_owned();
            (status, rule)
        };
        let req = |line: &str, headers: &str| {
            format!("{line} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\nContent-Length: 0\r\n\r\n")
        };
        let at = |s: &str, rule: &str| (s.to_owned(), rule.to_owned());
        // POST /login: the login rule (three conditions, tried first).
        let login: Vec<_> = (0..3).map(|_| send(&req("POST /login", ""))).collect();
        assert_eq!(login, [at("200", "login"), at("200", "login"), at("429", "login")]);
        // With x-debug, or as a GET, it is not the login rule's: per path.
        assert_eq!(send(&req("POST /login", "x-debug: 1\r\n")), at("200", "per-path"));
        assert_eq!(send(&req("GET /login", "")), at("429", "per-path"), "one bucket for /login");
        assert_eq!(send(&req("GET /other", "")), at("200", "per-path"), "its own bucket");
        // Under /api/, a bucket per API key; without one, per client id
        // (the rule of the same match after it); without either, per path.
        let key_a = |path: &str| send(&req(&format!("GET {path}"), "x-api-key: a\r\n"));
        let a: Vec<_> = ["/api/1", "/api/2", "/api/3", "/api/4"].iter().map(|p| key_a(p)).collect();
        assert_eq!(
            a,
            [at("200", "per-api-key"), at("200", "per-api-key"), at("200", "per-api-key"), at("429", "per-api-key")]
        );
        assert_eq!(send(&req("GET /api/1", "x-api-key: b\r\n")), at("200", "per-api-key"));
        let id = "x-client-id: c\r\n";
        assert_eq!(send(&req("GET /api/1", id)), at("200", "per-client-id"));
        assert_eq!(send(&req("GET /api/2", id)), at("429", "per-client-id"));
        assert_eq!(send(&req("GET /api/1", "")), at("200", "per-path"));
        assert_eq!(send(&req("GET /api/1", "")), at("429", "per-path"));
    })
    .await
    .unwrap();
    // The same file, to the kernel: refused, naming the rule and field.
    let rules = limiter::rules::RuleSet::load(&config).expect("valid for layer 7");
    let refused = rules.kernel_compatible().unwrap_err();
    assert!(
        refused.contains("rules[0] (\"per-path\"): key source + path"),
        "{refused}"
    );
}

/// An upstream whose every answer is a head at once and then a body of
/// `n` bytes, one every `gap`: a slow download.
async fn trickling_upstream(n: usize, gap: Duration) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => request.extend_from_slice(&buf[..k]),
                    }
                }
                let head =
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n");
                if stream.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                for _ in 0..n {
                    tokio::time::sleep(gap).await;
                    if stream.write_all(b"x").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// nginx's `limit_conn` through the real proxy: a key with `concurrent:
/// 2` has two slow downloads going (their heads answered, their bodies
/// still arriving), so a third request is refused with 429 and counted;
/// once the downloads end, requests are admitted again, and another client
/// is never affected. Fails if a request stops counting at its head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_are_capped_per_key_until_their_bodies_end() {
    use std::io::{Read, Write};
    let upstream_addr = trickling_upstream(10, Duration::from_millis(100)).await;
    let dir = TempDir::new("proxy-concurrent");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: downloads, key: header:x-user, limit: unlimited, concurrent: 2 }\n",
    );
    let metrics = limiter_tests::free_loopback_addr();
    let p = proxy(
        &config,
        &format!("http://{upstream_addr}"),
        &["--metrics", &metrics],
    );
    tokio::task::spawn_blocking(move || {
        let get = |user: &str| {
            format!("GET /file HTTP/1.1\r\nHost: x\r\nx-user: {user}\r\nConnection: close\r\n\r\n")
        };
        // Two downloads: read until each head has arrived, then leave
        // their bodies arriving.
        let start = |user: &str| {
            let mut stream = TcpStream::connect(p.addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            stream.write_all(get(user).as_bytes()).unwrap();
            let mut head = Vec::new();
            let mut byte = [0; 1];
            while !head.ends_with(b"\r\n\r\n") {
                assert_eq!(stream.read(&mut byte).unwrap(), 1, "the head ended early");
                head.push(byte[0]);
            }
            assert_eq!(status(&String::from_utf8_lossy(&head)), "200");
            stream
        };
        let downloads = [start("alice"), start("alice")];
        let third = exchange(p.addr, get("alice").as_bytes());
        assert_eq!(status(&third), "429", "{third}");
        assert!(third.contains("too many requests in flight"), "{third}");
        assert!(
            third.to_ascii_lowercase().contains("retry-after: 1\r\n"),
            "a hint of when to retry: {third}"
        );
        assert_eq!(
            status(&exchange(p.addr, get("bob").as_bytes())),
            "200",
            "another key"
        );
        for mut download in downloads {
            let mut rest = String::new();
            download.read_to_string(&mut rest).unwrap();
            assert_eq!(rest, "x".repeat(10), "the whole body");
        }
        assert_eq!(
            status(&exchange(p.addr, get("alice").as_bytes())),
            "200",
            "slots given back"
        );
        let scrape = exchange(metrics.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n");
        assert!(
            scrape.contains(
                "limiter_in_flight_refused_requests_total{layer=\"http\",rule=\"downloads\"} 1"
            ),
            "{scrape}"
        );
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

/// A request refused by the rule's aggregate (or a byte limit) is told
/// when that meter takes it, not when its own request meter would (which
/// had room: `Retry-After: 1`, and a client pacing by it retried every
/// second into a refusal).
#[test]
fn retry_after_is_the_refusing_meters_wait() {
    let clock = Arc::new(TestClock::default());
    clock.0.store(1_000_000_000_000, Ordering::SeqCst);
    let text = "rules:\n  - { name: api, limit: { rate: 100, unit: second, burst: 100 }, aggregate: { rate: 2, unit: minute, burst: 1 } }\n";
    let limiter = Limiter::new(rules(text), clock.clone());
    let from = |client: u32| limiter::http::RequestMeta {
        client: std::net::Ipv4Addr::from(0x0a00_0000 + client).into(),
        port: None,
        key: None,
        bytes: 0,
        http: None,
    };
    assert!(limiter.check(&from(1)).allowed);
    let refused = limiter.check(&from(2));
    assert!(!refused.allowed);
    let quota = limiter.quota(&refused).expect("the key's request meter");
    // The aggregate's emission interval is 30 s; the key's own meter,
    // charged nothing, has its whole burst.
    assert_eq!((quota.remaining, quota.retry_after_secs), (100, 30));
    // Half a minute later the aggregate takes it.
    clock
        .0
        .store(1_000_000_000_000 + 30_000_000_000, Ordering::SeqCst);
    assert!(limiter.check(&from(2)).allowed);
}

/// The upstream gets the target the rules judged: a path the upstream
/// would serve as `/login` (`//login`, `/./login`, `/%6cogin`) is judged
/// as `/login` and forwarded so, and an absolute target's host is the
/// `Host` the upstream gets (a rule on `host:` cannot be escaped by
/// naming another host in the target while `Host` names the real one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_gets_the_path_and_host_the_rules_judged() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let echo = Router::new().fallback(any(|request: Request<Body>| async move {
        let host = request
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("-")
            .to_owned();
        format!("upstream got {host} {}", request.uri().path())
    }));
    tokio::spawn(async move { axum::serve(listener, echo).await.unwrap() });
    let dir = TempDir::new("judged-target");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: login, match: { path: /login }, key: all, limit: { rate: 1, unit: minute, burst: 1 } }\n  - { name: api, match: { host: api.example.com }, key: all, limit: { rate: 1, unit: minute, burst: 1 } }\n",
    );
    let p = proxy(&config, &upstream, &[]);
    tokio::task::spawn_blocking(move || {
        let send = |target: &str, host: &str| {
            let request =
                format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
            exchange(p.addr, request.as_bytes())
        };
        let first = send("/login", "site.example");
        assert_eq!(status(&first), "200", "{first}");
        assert!(
            first.contains("upstream got site.example /login"),
            "{first}"
        );
        for path in ["//login", "/./login", "/%6cogin", "/x/../login"] {
            assert_eq!(status(&send(path, "site.example")), "429", "{path}");
        }
        let first = send("/a", "api.example.com");
        assert_eq!(status(&first), "200", "{first}");
        // Another host in the target: judged as that host (no rule), and
        // the upstream is told that host, not api.example.com.
        let other = send("http://other.example/a", "api.example.com");
        assert_eq!(status(&other), "200", "{other}");
        assert!(other.contains("upstream got other.example /a"), "{other}");
        assert_eq!(status(&send("/a", "api.example.com")), "429");
    })
    .await
    .unwrap();
}

/// A request the pacer holds goes out no sooner than a refusal that
/// arrived while it waited says: the server's `Retry-After` binds the
/// requests already queued too, not only those sent after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_while_requests_wait_holds_them_too() {
    use limiter::http::client::PacingLayer;
    use tower::{Layer, Service, ServiceExt};

    let budget = rules("rules:\n  - { name: pace, limit: { rate: 2, unit: second, burst: 1 } }\n");
    let limiter::rules::Limit::Metered {
        packets: budget, ..
    } = budget.rules[0].limit
    else {
        unreachable!()
    };
    let start = Instant::now();
    let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
    let server = {
        let sent = Arc::clone(&sent);
        tower::service_fn(move |_: Request<Body>| {
            let sent = Arc::clone(&sent);
            async move {
                let n = {
                    let mut sent = sent.lock().unwrap();
                    sent.push(start.elapsed());
                    sent.len()
                };
                // The first is refused after 100 ms: nothing for a second.
                if n == 1 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let status = if n == 1 { 429 } else { 200 };
                let response = http::Response::builder()
                    .status(status)
                    .header("retry-after", "1")
                    .body(Body::empty())
                    .unwrap();
                Ok::<_, std::convert::Infallible>(response)
            }
        })
    };
    let service = PacingLayer::new(budget, 8, Duration::from_secs(10)).layer(server);
    let send = |mut service: limiter::http::client::Paced<_>| async move {
        let request = Request::get("http://x/").body(Body::empty()).unwrap();
        service
            .ready()
            .await
            .unwrap()
            .call(request)
            .await
            .map(|r| r.status().as_u16())
    };
    // Both at once: the second held half a second by the budget, during
    // which (at 100 ms) the first is refused for a second.
    let (first, second) = tokio::join!(send(service.clone()), send(service.clone()));
    assert_eq!((first.ok(), second.ok()), (Some(429), Some(200)));
    let sent = sent.lock().unwrap().clone();
    assert!(
        sent[1] >= Duration::from_millis(1_050),
        "the second went out {:?} after the first, inside the server's second",
        sent[1] - sent[0]
    );
}

/// Guards byte limits on HTTP/2 uploads, which carry no
/// `Transfer-Encoding` and here no `Content-Length` either: before, such a
/// body was charged nothing and went through whole; now it is charged as
/// it streams and cut with 429 once past the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_uploads_without_a_length_are_charged_as_they_stream() {
    // An upstream that reads each body whole before it answers, and
    // counts those it got whole (one answering at once would race the
    // cut: its 200 could come first).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let whole = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = {
        let whole = Arc::clone(&whole);
        Router::new().fallback(any(move |body: Body| {
            let whole = Arc::clone(&whole);
            async move {
                if body.collect().await.is_ok() {
                    whole.fetch_add(1, Ordering::SeqCst);
                }
                "from upstream"
            }
        }))
    };
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let dir = TempDir::new("h2-upload");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: uploads, limit: { bytes: 1000, unit: second, burst_bytes: 20000 } }\n",
    );
    let p = proxy(&config, &upstream, &["--max-body-bytes", "10000000"]);
    let client: Client<_, Body> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let chunks = futures_util::stream::iter(
        (0..16).map(|_| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(vec![b'a'; 65_536]))),
    );
    let request = Request::post(format!("http://{}/up", p.addr))
        .body(Body::from_stream(chunks))
        .unwrap();
    assert!(
        request
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .is_none()
    );
    let response = client.request(request).await.expect("an HTTP/2 exchange");
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        whole.load(Ordering::SeqCst),
        0,
        "a whole upload reached the upstream"
    );
}

/// Guards connection slots against idle HTTP/2 clients: a connection that
/// answers every ping but starts no request is shut down (GOAWAY, then
/// closed) after the header timeout, as an idle HTTP/1.1 one is; before,
/// it held its slot for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed() {
    use std::io::{Read, Write};
    let upstream = format!("http://{}", limiter_tests::upstream().await);
    let dir = TempDir::new("h2-idle");
    let config = dir.write("rules.yaml", "rules: []\n");
    let p = proxy(&config, &upstream, &["--header-timeout", "1s"]);
    let (goaway, closed_after) = tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(p.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(8)))
            .unwrap();
        // The client preface and an empty SETTINGS frame.
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .unwrap();
        let start = Instant::now();
        let mut goaway = false;
        while start.elapsed() < Duration::from_secs(8) {
            let mut head = [0u8; 9];
            if stream.read_exact(&mut head).is_err() {
                // Closed (or the read timed out: then `start` says so).
                return (goaway, start.elapsed());
            }
            let length =
                usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; length];
            if stream.read_exact(&mut payload).is_err() {
                return (goaway, start.elapsed());
            }
            let (kind, flags) = (head[3], head[4]);
            match kind {
                // SETTINGS: acknowledged.
                0x4 if flags & 1 == 0 => {
                    let _ = stream.write_all(b"\0\0\0\x04\x01\0\0\0\0");
                }
                // PING: answered, so the connection is alive, only idle.
                0x6 if flags & 1 == 0 => {
                    // (It may have closed meanwhile: the read says so.)
                    let _ = stream.write_all(b"\0\0\x08\x06\x01\0\0\0\0");
                    let _ = stream.write_all(&payload);
                }
                // GOAWAY with NO_ERROR: a graceful shutdown, not a
                // protocol error of this test's making.
                0x7 => goaway = payload.get(4..8) == Some(&[0, 0, 0, 0][..]),
                _ => {}
            }
        }
        (goaway, start.elapsed())
    })
    .await
    .unwrap();
    assert!(goaway, "no graceful GOAWAY before the close");
    assert!(
        closed_after < Duration::from_secs(6),
        "still open after {closed_after:?}"
    );
}
