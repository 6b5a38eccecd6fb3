//! `limiter proxy` under abuse, as a client on loopback would try it:
//! connection floods, idle and stalled clients, descriptor exhaustion,
//! oversized and chunked bodies, long keys, hop-by-hop fields, CONNECT,
//! and a dead upstream. Each answer is read off the wire; what reached the
//! upstream is counted by the upstream itself.
//!
//! A file per topic; this one holds the proxy, the upstream and the
//! readers they share.

mod backend;
mod connections;
mod judging;
mod messages;
mod requests;
mod streaming;

use std::{
    fs,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, body::Body, routing::any};
use http::Request;
use limiter_tests::{TempDir, limiter_bin, status};

/// A `limiter proxy` child process, killed on drop; its log in a file.
struct Proxy {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Proxy {
    fn start(
        dir: &TempDir,
        rules: &str,
        upstream: SocketAddr,
        extra: &[&str],
        wrapper: &[&str],
    ) -> Self {
        let config = dir.write("rules.yaml", rules);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let log = dir.0.join("proxy.log");
        let out = fs::File::create(&log).unwrap();
        let mut command = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(limiter_bin());
                c
            }
            None => Command::new(limiter_bin()),
        };
        let child = command
            .args(["proxy", "--listen", &addr.to_string()])
            .args(["--upstream", &format!("http://{upstream}")])
            .arg("--config")
            .arg(&config)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("proxy");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "the proxy did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, addr, log }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Resident memory (kB).
    fn rss_kb(&self) -> u64 {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS")
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the upstream saw: requests and body bytes read to their end.
#[derive(Default)]
struct Seen {
    requests: AtomicU64,
    complete_body_bytes: AtomicU64,
}

/// An upstream that answers with the names of the fields it received and
/// counts what it read.
fn upstream(runtime: &tokio::runtime::Runtime) -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let counted = Arc::clone(&seen);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().fallback(any(move |request: Request<Body>| {
        let seen = Arc::clone(&counted);
        async move {
            if request.uri().path() == "/hang" {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            seen.requests.fetch_add(1, Ordering::SeqCst);
            let names: Vec<String> = request.headers().keys().map(|k| k.to_string()).collect();
            let forwarded_for: Vec<String> = request
                .headers()
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| Some(v.to_str().ok()?.to_owned()))
                .collect();
            if let Ok(body) = axum::body::to_bytes(request.into_body(), usize::MAX).await {
                seen.complete_body_bytes
                    .fetch_add(body.len() as u64, Ordering::SeqCst);
            }
            format!(
                "fields: {}\nx-forwarded-for: {}\n",
                names.join(","),
                forwarded_for.join(", ")
            )
        }
    }));
    runtime.spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Reads until the peer closes; `Err` if it is still open after `wait`.
fn closed_within(stream: &mut TcpStream, wait: Duration) -> std::io::Result<String> {
    stream.set_read_timeout(Some(wait))?;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest)?;
    Ok(String::from_utf8_lossy(&rest).into_owned())
}

const OPEN: &str = "rules:\n  - { name: open, limit: { rate: 100000, unit: second } }\n";

/// Sends `n` GETs one after another on one connection to `addr`, `pause`
/// apart, and returns their statuses.
fn statuses_on_one_connection(addr: SocketAddr, n: usize, pause: Duration) -> Vec<String> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut statuses = Vec::new();
    let mut buf = Vec::new();
    for _ in 0..n {
        std::thread::sleep(pause);
        stream
            .write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        // One answer: its head, then the body its length says.
        let answer = loop {
            if let Some((head, _, length)) = whole_message(&buf) {
                break Some((status(&head).to_owned(), length));
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break None,
                Ok(got) => buf.extend_from_slice(&chunk[..got]),
            }
        };
        let Some((answered, length)) = answer else {
            statuses.push("none".to_owned());
            return statuses;
        };
        statuses.push(answered);
        buf.drain(..length);
    }
    statuses
}

/// The message at the start of `buf` once it is all there, framed by its
/// `Content-Length` (none: no body): its head (lower-cased), its body's
/// length and its whole length.
fn whole_message(buf: &[u8]) -> Option<(String, usize, usize)> {
    let end = head_end(buf)?;
    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    let body: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    (buf.len() >= end + body).then_some((head, body, end + body))
}

/// Where the head of the message at the start of `buf` ends (after its
/// blank line), once it is all there.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| at + 4)
}
