//! A `limiter proxy` child process on loopback, in front of an upstream
//! the test serves.

use std::{
    fs,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use crate::fixtures::TempDir;
use crate::process::{hang_up, limiter_command};

/// A `limiter proxy` child process, killed on drop.
pub struct Proxy {
    child: Child,
    pub addr: std::net::SocketAddr,
}

impl Proxy {
    /// Sends it SIGHUP (re-read the rule file).
    pub fn hang_up(&self) {
        hang_up(&self.child);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn proxy(config: &std::path::Path, upstream: &str, extra: &[&str]) -> Proxy {
    proxy_logging(config, upstream, extra, Stdio::null(), Stdio::null())
}

/// [`proxy`], what it prints (`--trace`) written to `out`.
pub fn proxy_printing(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    out: &std::path::Path,
) -> Proxy {
    let out = fs::File::create(out).expect("creating the proxy's output");
    proxy_logging(config, upstream, extra, Stdio::from(out), Stdio::null())
}

/// [`proxy`], its stdout a pipe nobody reads (a `--trace` reader that
/// stalls), its log (stderr) written to `log`.
pub fn proxy_unread(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    log: &std::path::Path,
) -> Proxy {
    proxy_logging_to(config, upstream, extra, Stdio::piped(), log)
}

/// [`proxy`], its log (stderr) written to `log`.
pub fn proxy_logged(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    log: &std::path::Path,
) -> Proxy {
    proxy_logging_to(config, upstream, extra, Stdio::null(), log)
}

fn proxy_logging_to(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    stdout: Stdio,
    log: &std::path::Path,
) -> Proxy {
    let log = fs::File::create(log).expect("creating the proxy's log");
    proxy_logging(config, upstream, extra, stdout, Stdio::from(log))
}

fn proxy_logging(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    stdout: Stdio,
    stderr: Stdio,
) -> Proxy {
    let listen = free_loopback_addr();
    let mut args = vec![
        "proxy",
        "--listen",
        &listen,
        "--upstream",
        upstream,
        "--config",
    ];
    let config = config.to_string_lossy().into_owned();
    args.push(&config);
    args.extend_from_slice(extra);
    let child = limiter_command(None, &args)
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("proxy");
    let addr: std::net::SocketAddr = listen.parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the proxy did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Proxy { child, addr }
}

/// `127.0.0.1:PORT` with a port free a moment ago.
pub fn free_loopback_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    format!("127.0.0.1:{port}")
}

/// An upstream that answers "from upstream" to everything, on loopback.
pub async fn upstream() -> std::net::SocketAddr {
    use axum::{Router, routing::any};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/{*path}", any(|| async { "from upstream" }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// `limiter proxy` in front of a fresh upstream, with `rules`; the
/// directory holding them lives as long as it is kept.
pub async fn proxy_for(name: &str, rules: &str, extra: &[&str]) -> (Proxy, TempDir) {
    let upstream = format!("http://{}", upstream().await);
    let dir = TempDir::new(name);
    let config = dir.write("rules.yaml", rules);
    (proxy(&config, &upstream, extra), dir)
}
