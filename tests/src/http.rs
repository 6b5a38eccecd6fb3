//! HTTP from the test's side: raw exchanges and GETs (from inside a
//! namespace), and the layer-7 library's requests and clock.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context, Result, bail};

/// A layer-7 request from `client`, known by its address alone (no port,
/// key, body or HTTP fields).
pub fn request_from(client: IpAddr) -> limiter::http::RequestMeta<'static> {
    limiter::http::RequestMeta {
        client,
        port: None,
        key: None,
        bytes: 0,
        http: None,
    }
}

/// One HTTP/1.0 GET with extra header lines from inside a namespace;
/// returns the status line and header block, and the body, whatever the
/// status.
pub fn http_request(
    ns: &limiter::lab::Netns,
    port: u16,
    path: &str,
    headers: &str,
) -> Result<(String, String)> {
    use std::io::{Read, Write};
    let (path, headers) = (path.to_owned(), headers.to_owned());
    ns.enter(move || -> Result<(String, String)> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "GET {path} HTTP/1.0\r\nHost: localhost\r\n{headers}\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("no HTTP header end")?;
        Ok((head.to_owned(), body.to_owned()))
    })?
}

/// One HTTP GET from inside a namespace; returns the body.
pub fn http_get(ns: &limiter::lab::Netns, port: u16, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let path = path.to_owned();
    ns.enter(move || -> Result<String> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        // HTTP/1.0: a plain body, no chunked encoding, closed at the end.
        write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("no HTTP header end")?;
        if head.split(' ').nth(1) != Some("200") {
            bail!("GET {path}: {head}");
        }
        Ok(body.to_owned())
    })?
}

/// One raw HTTP exchange: writes `bytes`, reads the answer to the end (or
/// 15 s).
pub fn exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    let _ = stream.write_all(bytes);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// The status code of an HTTP answer (`none` for no answer).
pub fn status(answer: &str) -> &str {
    answer.split_whitespace().nth(1).unwrap_or("none")
}

/// The `Accept` field with which Prometheus asks for OpenMetrics.
pub const OPENMETRICS_ACCEPT: &str = "Accept: application/openmetrics-text;version=1.0.0\r\n";

/// A layer-7 clock the test sets: monotonic and epoch time alike.
#[derive(Default)]
pub struct TestClock(pub std::sync::atomic::AtomicU64);

impl limiter::http::Clock for TestClock {
    fn monotonic_ns(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn epoch_ns(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}
