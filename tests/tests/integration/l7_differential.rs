//! Layer 7 judges the request its upstream serves: many spellings of
//! requests (the host's case, a trailing dot, a port, absolute-form
//! targets; percent-encoded characters and slashes, dot segments, runs of
//! slashes in the path; the key's field duplicated or named by
//! `Connection`) go through `limiter proxy` to a real nginx, and what the
//! proxy judged (`--trace --trace-json`: host, path, the key's field) is
//! compared with what nginx routed (its access log: `$host`, `$uri`, the
//! field). Zero mismatches. `LIMITER_DIFFERENTIAL_REQUESTS` spellings
//! (2,000 by default; `cargo xtask fuzz` sends 100,000).

use std::{
    fs,
    io::{BufRead, Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use limiter_tests::{Rng, TempDir, nginx::Nginx, proxy_printing};

/// One spelling of a request.
struct Spelling {
    host: String,
    /// The path, spelled (escapes, dot segments, runs of slashes).
    path: String,
    /// Absolute-form target (HTTP/1.1; HTTP/2 always names its authority).
    absolute: bool,
    /// The key's field, once or twice.
    keys: Vec<&'static str>,
    /// `Connection: x-api-key` (HTTP/1.1 only: HTTP/2 has no such field).
    connection_named: bool,
}

impl Spelling {
    fn new(rng: &mut Rng) -> Self {
        let name = rng.pick(&["admin.example.com", "api.example.org", "x.test"]);
        let mut host: String = name
            .chars()
            .map(|c| {
                if rng.chance(30) {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();
        if rng.chance(30) {
            host.push('.');
        }
        if rng.chance(20) {
            host.push_str(":8080");
        }
        // A path of plain segments, a space and a question mark among
        // them, then spelled: escapes of any character, dot segments and
        // runs of slashes (never above the root, which nginx refuses).
        let segments = ["login", "api", "users", "v1", "a b", "q?x", "caf\u{e9}"];
        let mut path = String::new();
        for _ in 0..=rng.below(3) {
            let segment = rng.pick(&segments);
            path.push('/');
            if rng.chance(10) {
                path.push_str("x/../");
            }
            if rng.chance(10) {
                path.push_str("./");
            }
            if rng.chance(10) {
                path.push('/');
            }
            for byte in segment.bytes() {
                let must = !(byte.is_ascii_alphanumeric() || b"-._~".contains(&byte));
                if must || rng.chance(15) {
                    path.push_str(&format!("%{byte:02X}"));
                } else {
                    path.push(char::from(byte));
                }
            }
            if rng.chance(10) {
                // An escaped slash inside: nginx decodes it before it merges.
                path.push_str("%2F");
            }
        }
        let absolute = rng.chance(10);
        let mut keys = Vec::new();
        let mut connection_named = false;
        if rng.chance(80) {
            keys.push(rng.pick(&["k1", "K1", "k2"]));
            if rng.chance(10) {
                keys.push("second");
            }
            connection_named = rng.chance(10);
        }
        Self {
            host,
            path,
            absolute,
            keys,
            connection_named,
        }
    }

    /// As HTTP/1.1 bytes.
    fn http1(&self) -> Vec<u8> {
        let target = if self.absolute {
            format!("http://{}{}", self.host, self.path)
        } else {
            self.path.clone()
        };
        let mut request = format!("GET {target} HTTP/1.1\r\nHost: {}\r\n", self.host);
        for key in &self.keys {
            request.push_str(&format!("X-Api-Key: {key}\r\n"));
        }
        if self.connection_named {
            request.push_str("Connection: x-api-key\r\n");
        }
        request.push_str("\r\n");
        request.into_bytes()
    }

    /// As an HTTP/2 request (`:authority` the spelled host).
    fn http2(&self) -> http::Request<http_body_util::Empty<bytes::Bytes>> {
        let mut request = http::Request::get(format!("http://{}{}", self.host, self.path));
        for key in &self.keys {
            request = request.header("x-api-key", *key);
        }
        request
            .body(http_body_util::Empty::new())
            .expect("a request")
    }
}

/// What one side saw of a request: host, path, the key's field.
type Seen = (String, String, String);

#[test]
fn the_proxy_judges_what_nginx_routes() {
    let n: usize = std::env::var("LIMITER_DIFFERENTIAL_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("LIMITER_DIFFERENTIAL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1e55);
    let dir = TempDir::new("l7-differential");
    let nginx = Nginx::start(&dir);
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: keyed, key: header:x-api-key, limit: { rate: 1000000000, unit: second } }\n",
    );
    let trace = dir.0.join("trace.jsonl");
    let p = proxy_printing(
        &config,
        &format!("http://{}", nginx.addr),
        &["--trace", "--trace-json"],
        &trace,
    );
    let mut rng = Rng(seed | 1);
    let mut sent = Vec::with_capacity(n);
    let mut stream = TcpStream::connect(p.addr).expect("the proxy");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a timeout");
    let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
    // Three of four over HTTP/1.1, one over HTTP/2 (h2c), in turn: one
    // answer at a time, so the access log and the trace keep order.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut h2 = runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(p.addr)
            .await
            .expect("the proxy");
        let (send, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("an HTTP/2 connection");
        tokio::spawn(connection);
        send
    });
    for i in 0..n {
        let spelling = Spelling::new(&mut rng);
        if i % 4 == 3 {
            let status = runtime.block_on(async {
                let response = h2
                    .send_request(spelling.http2())
                    .await
                    .expect("an HTTP/2 answer");
                let status = response.status();
                let _ = http_body_util::BodyExt::collect(response.into_body()).await;
                status
            });
            assert_eq!(status, 200, "request {i} over HTTP/2: {}", spelling.path);
            sent.push(format!(
                "h2 {} {} {:?}",
                spelling.host, spelling.path, spelling.keys
            ));
            continue;
        }
        let request = spelling.http1();
        stream.write_all(&request).expect("sending");
        let mut head = String::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).expect("an answer");
            assert!(
                !line.is_empty(),
                "request {i}: the proxy closed the connection"
            );
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        assert!(
            head.starts_with("HTTP/1.1 200"),
            "request {i} ({}): {head}",
            String::from_utf8_lossy(&request)
        );
        let length: usize = head
            .lines()
            .find_map(|l| {
                l.strip_prefix("content-length: ")
                    .or(l.strip_prefix("Content-Length: "))
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        reader.read_exact(&mut body).expect("the body");
        sent.push(String::from_utf8_lossy(&request).into_owned());
    }
    drop(stream);
    // The trace's writer drains its queue; nginx writes each line at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    let judged: Vec<Seen> = loop {
        let lines: Vec<Seen> = fs::read_to_string(&trace)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                let r = &v["request"];
                let key = r["fields"]
                    .as_array()
                    .and_then(|f| f.first())
                    .and_then(|f| f[1].as_str())
                    .unwrap_or_default();
                (
                    r["host"].as_str().unwrap_or_default().to_owned(),
                    r["path"].as_str().unwrap_or_default().to_owned(),
                    key.to_owned(),
                )
            })
            .collect();
        if lines.len() >= n || Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let routed: Vec<Seen> = nginx.routed();
    assert_eq!(
        (judged.len(), routed.len()),
        (n, n),
        "lines traced and logged"
    );
    let mismatches: Vec<String> = (0..n)
        .filter(|&i| judged[i] != routed[i])
        .map(|i| {
            format!(
                "{:?}: judged {:?}, routed {:?}",
                sent[i], judged[i], routed[i]
            )
        })
        .collect();
    println!(
        "{n} spellings (seed {seed:#x}): {} mismatches; the first judged {:?}, routed {:?}",
        mismatches.len(),
        judged[0],
        routed[0]
    );
    assert!(
        mismatches.is_empty(),
        "{} of {n} judged otherwise than nginx routed them, the first: {:#?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(5)]
    );
}
