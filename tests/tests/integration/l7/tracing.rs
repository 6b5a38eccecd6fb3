//! The proxy's trace of its decisions, and a reader that stalls.

use std::time::{Duration, Instant};

use limiter_tests::{TempDir, exchange, status};

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
