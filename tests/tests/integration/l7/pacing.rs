//! Requests held until they conform, refusals while they wait, and the
//! cap on requests in flight per key.

use std::{
    net::{SocketAddr, TcpStream},
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use axum::body::Body;
use http::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use limiter::http::{Limiter, RateLimitLayer};
use limiter_tests::{TempDir, exchange, proxy, rules, status};

use super::{serve, statuses};

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
