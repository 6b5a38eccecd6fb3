//! HTTP/2 and TLS: clients served and limited, values refused, uploads
//! without a length, idle connections closed, ALPN.

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use axum::{Router, body::Body, routing::any};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use limiter_tests::{TempDir, proxy};

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
