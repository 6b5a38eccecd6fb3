//! What the rules judge: a host however spelled, encoded slashes in a
//! path, a field the Connection field names, and paced requests.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use limiter_tests::{TempDir, exchange, nginx::Nginx, status};

use super::{Proxy, runtime, statuses_on_one_connection, upstream};

/// Issue 35: layer 7 judged a host as the client spelled it. A trailing
/// dot (in `Host`, in an absolute-form target, over HTTP/1.0) passed a
/// rule on `admin.example.com` 30 times of 30 against 3 a minute, and ten
/// case variants of a spent host were nine fresh `key: host` keys. The
/// host is judged and keyed in its canonical form now: lowercase, one
/// trailing dot dropped, as nginx routes it. Counted by a real nginx
/// upstream, which also says how it routed what reached it.
#[test]
fn spellings_of_a_host_are_one_host() {
    let rules = "rules:
  - { name: admin, match: { host: admin.example.com }, limit: { rate: 3, unit: minute, burst: 3 } }
  - { name: per-host, key: host, limit: { rate: 1, unit: minute, burst: 1 } }
";
    let dir = TempDir::new("proxy-hosts");
    let nginx_dir = TempDir::new("proxy-hosts-nginx");
    let nginx = Nginx::start(&nginx_dir);
    let p = Proxy::start(&dir, rules, nginx.addr, &[], &[]);
    let ask = |request: String| status(&exchange(p.addr, request.as_bytes())).to_owned();
    let spellings = [
        "admin.example.com.",
        "ADMIN.example.com",
        "Admin.Example.Com.",
        "admin.example.com.:80",
        "aDmIn.ExAmPlE.cOm",
    ];
    let mut answers = Vec::new();
    for i in 0..30 {
        let host = spellings[i % spellings.len()];
        answers.push(match i % 3 {
            0 => ask(format!(
                "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            )),
            1 => ask(format!(
                "GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            )),
            _ => ask(format!("GET / HTTP/1.0\r\nHost: {host}\r\n\r\n")),
        });
    }
    let admitted = answers.iter().filter(|s| *s == "200").count();
    let refused = answers.iter().filter(|s| *s == "429").count();
    assert_eq!((admitted, refused), (3, 27), "{answers:?}");
    let routed = nginx.routed();
    assert_eq!(routed.len(), 3, "what reached nginx: {routed:?}");
    assert!(
        routed
            .iter()
            .all(|(host, _, _)| host == "admin.example.com")
    );

    let variants: Vec<String> = (0..10)
        .map(|i| {
            let name: String = "spent.example.org"
                .chars()
                .enumerate()
                .map(|(j, c)| {
                    if (i >> (j % 4)) & 1 == 1 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect();
            if i % 2 == 1 { format!("{name}.") } else { name }
        })
        .collect();
    let answers: Vec<String> = variants
        .iter()
        .map(|host| {
            ask(format!(
                "GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            ))
        })
        .collect();
    let admitted = answers.iter().filter(|s| *s == "200").count();
    assert_eq!(admitted, 1, "{variants:?}: {answers:?}");
    assert_eq!(nginx.routed().len(), 4, "what reached nginx");
}

/// Issue 35: a field the `Connection` field names never reaches the
/// upstream, yet it was judged: `X-Api-Key: k1` with `Connection:
/// x-api-key` was keyed by the API key and served as anonymous. Such
/// fields go before the rules judge: the request is the anonymous one the
/// upstream sees. Counted by a real nginx upstream.
#[test]
fn a_field_connection_names_is_not_judged() {
    let rules = "rules:
  - { name: by-key, key: header:x-api-key, limit: { rate: 100, unit: minute, burst: 100 } }
  - { name: anonymous, limit: { rate: 2, unit: minute, burst: 2 } }
";
    let dir = TempDir::new("proxy-connection-named");
    let nginx_dir = TempDir::new("proxy-connection-named-nginx");
    let nginx = Nginx::start(&nginx_dir);
    let p = Proxy::start(&dir, rules, nginx.addr, &[], &[]);
    let answers: Vec<String> = (0..10)
        .map(|_| {
            status(&exchange(
                p.addr,
                b"GET / HTTP/1.1\r\nHost: x\r\nX-Api-Key: k1\r\nConnection: x-api-key, close\r\n\r\n",
            ))
            .to_owned()
        })
        .collect();
    let admitted = answers.iter().filter(|s| *s == "200").count();
    assert_eq!(
        admitted, 2,
        "judged as the anonymous request it is: {answers:?}"
    );
    let routed = nginx.routed();
    assert_eq!(routed.len(), 2, "what reached nginx: {routed:?}");
    assert!(
        routed.iter().all(|(_, _, key)| key.is_empty()),
        "{routed:?}"
    );
}

/// Issue 35: nginx decodes `%2F` before it merges slashes and removes dot
/// segments, so it served `/%2Flogin` and `/x/..%2Flogin` as `/login`
/// while the proxy judged them as other paths (30 of 30 past a 3/min
/// rule). The proxy judges, and forwards, the path nginx routes. (The
/// upstream is dead: admitted gets 502, refused 429.)
#[test]
fn encoded_slashes_do_not_escape_a_path_rule() {
    let rules = "rules:
  - { name: login, match: { path: /login }, limit: { rate: 3, unit: minute, burst: 3 } }
  - { name: rest, limit: { rate: 1000, unit: minute } }
";
    let dir = TempDir::new("proxy-encoded-slash");
    let nginx_dir = TempDir::new("proxy-encoded-slash-nginx");
    let nginx = Nginx::start(&nginx_dir);
    let p = Proxy::start(&dir, rules, nginx.addr, &[], &[]);
    let spellings = [
        "/%2Flogin",
        "/x/..%2Flogin",
        "/%2flogin",
        "//login",
        "/login",
    ];
    let answers: Vec<String> = (0..15)
        .map(|i| {
            let path = spellings[i % spellings.len()];
            status(&exchange(
                p.addr,
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            ))
            .to_owned()
        })
        .collect();
    let admitted = answers.iter().filter(|s| *s == "200").count();
    assert_eq!(admitted, 3, "{answers:?}");
    let routed = nginx.routed();
    assert_eq!(routed.len(), 3, "what reached nginx: {routed:?}");
    assert!(
        routed.iter().all(|(_, uri, _)| uri == "/login"),
        "{routed:?}"
    );
}

/// Guards `limit.delay` in the proxy's own relay (`l7.rs`'s pacing test
/// goes through the tower layer instead): on one connection, requests
/// over a burst of 1 at 10 a second are each held until they conform,
/// about 100 ms, then answered.
#[test]
fn paced_requests_are_answered_once_they_conform() {
    let rt = runtime();
    let (up, seen) = upstream(&rt);
    let dir = TempDir::new("proxy-paced");
    let p = Proxy::start(
        &dir,
        "rules:\n  - { name: paced, limit: { rate: 10, unit: second, burst: 1, delay: 1s } }\n",
        up,
        &[],
        &[],
    );
    let started = Instant::now();
    let statuses = statuses_on_one_connection(p.addr, 4, Duration::ZERO);
    let took = started.elapsed();
    assert_eq!(statuses, ["200"; 4]);
    assert_eq!(seen.requests.load(Ordering::SeqCst), 4);
    // A floor only: a slow machine takes longer, never shorter.
    assert!(
        took >= Duration::from_millis(280),
        "3 of 4 held about 100 ms each, answered in {took:?}"
    );
}
