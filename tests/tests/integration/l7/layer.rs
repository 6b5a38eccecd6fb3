//! The tower layer over real HTTP: the conformance corpus replayed, the
//! rate-limit response fields, rules keyed by request fields, Retry-After
//! and what reaches the upstream.

use std::sync::{Arc, atomic::Ordering};

use axum::{Router, body::Body, routing::any};
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use limiter::http::{CostBy, KeyBy, Limiter, RateLimitLayer, Reloadable};
use limiter_conformance::{assert_same, assert_same_over_soft};
use limiter_tests::{
    TempDir, TestClock, exchange, proxy, reference, rules, status, traces::corpus,
};

use super::serve;

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
    let refused = rules.kernel_compatible().unwrap_err().to_string();
    assert!(
        refused.contains("rules[0] (\"per-path\"): key source + path"),
        "{refused}"
    );
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
