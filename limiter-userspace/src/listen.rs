//! Listening so that no client, and no number of clients, can tie a
//! listener up: a cap on the connections served at once (one more is told
//! so and closed), a deadline on every request's header (an idle keep-alive
//! connection included: hyper starts the header timer when it waits for a
//! request, not at its first byte), a deadline on every write (a client
//! that stops reading its answers is cut off, not left holding a slot),
//! and accept errors (file descriptors run out under a connection flood)
//! that back off instead of spinning, logged once per interval with a
//! count.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    path::Path,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};

/// What one listener allows.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Connections served at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections served at once from one client address (default: a
    /// quarter of `max_connections`, at least 1), so that one client
    /// cannot hold every slot.
    #[serde(default)]
    pub max_connections_per_source: Option<usize>,
    /// How long a client may take to send a request's header (or, on an
    /// idle connection, to start the next one).
    #[serde(default = "default_header_timeout", with = "humantime_serde")]
    pub header_timeout: Duration,
    /// The largest request header block (bytes; at least 8192): larger
    /// gets 431.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// How long a write to a client may wait for it to read.
    #[serde(default = "default_write_timeout", with = "humantime_serde")]
    pub write_timeout: Duration,
}

fn default_write_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_max_header_bytes() -> usize {
    16384
}

fn default_max_connections() -> usize {
    256
}

fn default_header_timeout() -> Duration {
    Duration::from_secs(10)
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            max_connections_per_source: None,
            header_timeout: default_header_timeout(),
            max_header_bytes: default_max_header_bytes(),
            write_timeout: default_write_timeout(),
        }
    }
}

/// How long to wait after an accept error before accepting again: long
/// enough that a full descriptor table costs no CPU, short enough that
/// service resumes as soon as connections close.
const BACK_OFF: Duration = Duration::from_millis(100);
/// At most one log line per interval about accept errors.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Accept errors of one listener: each backs off; one line per
/// [`LOG_EVERY`] says how many there were.
pub struct AcceptErrors {
    what: &'static str,
    logged: Option<Instant>,
    unlogged: u64,
}

impl AcceptErrors {
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            logged: None,
            unlogged: 0,
        }
    }

    pub async fn back_off(&mut self, error: &io::Error) {
        self.unlogged += 1;
        if self.logged.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
            tracing::warn!(
                "{}: cannot accept connections: {error} ({} errors since the last report; \
                 retrying every {} ms)",
                self.what,
                self.unlogged,
                BACK_OFF.as_millis()
            );
            self.logged = Some(Instant::now());
            self.unlogged = 0;
        }
        tokio::time::sleep(BACK_OFF).await;
    }
}

impl Limits {
    /// `max_connections_per_source`, or its default.
    pub fn per_source(&self) -> usize {
        self.max_connections_per_source
            .unwrap_or_else(|| default_per_source(self.max_connections))
    }
}

/// A listener's connections from one address unless configured: a
/// quarter of all it serves at once, at least 1.
pub fn default_per_source(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}

/// The connections a listener may serve at once, in all and from one
/// client address.
#[derive(Clone)]
pub struct Slots {
    all: Arc<Semaphore>,
    per_source: usize,
    /// Connections held per client address (those with any).
    sources: Held,
    /// Addresses held to no per-source cap (trusted proxies, which carry
    /// many clients' connections).
    exempt: Arc<[ipnet::IpNet]>,
}

/// A connection's slot, given back when dropped.
pub struct Slot {
    _all: OwnedSemaphorePermit,
    source: Option<(Held, IpAddr)>,
}

/// Connections held per client address, shared by a listener's slots.
type Held = Arc<Mutex<HashMap<IpAddr, usize>>>;

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((sources, addr)) = &self.source {
            let mut sources = sources.lock().expect("slots lock");
            if let Some(n) = sources.get_mut(addr) {
                *n -= 1;
                if *n == 0 {
                    sources.remove(addr);
                }
            }
        }
    }
}

impl Slots {
    /// `max` connections at once, `per_source` of them from one address.
    pub fn new(max: usize, per_source: usize) -> Self {
        Self {
            all: Arc::new(Semaphore::new(max)),
            per_source,
            sources: Arc::default(),
            exempt: Arc::new([]),
        }
    }

    /// Slots for `limits`.
    pub fn of(limits: &Limits) -> Self {
        Self::new(limits.max_connections, limits.per_source())
    }

    /// With no per-source cap for these addresses.
    pub fn exempt(self, exempt: &[ipnet::IpNet]) -> Self {
        Self {
            exempt: exempt.into(),
            ..self
        }
    }

    /// A slot for one connection, held until it ends; `None` when full.
    /// With `source`, also `None` when that address holds its share.
    pub fn take(&self, source: Option<IpAddr>) -> Option<Slot> {
        // Given back when dropped, also when this returns `None` below.
        let all = Arc::clone(&self.all).try_acquire_owned().ok()?;
        let source = source
            .map(|a| a.to_canonical())
            .filter(|a| !self.exempt.iter().any(|net| net.contains(a)));
        let source = match source {
            None => None,
            Some(addr) => {
                let mut sources = self.sources.lock().expect("slots lock");
                let n = sources.entry(addr).or_default();
                if *n >= self.per_source {
                    return None;
                }
                *n += 1;
                Some((Arc::clone(&self.sources), addr))
            }
        };
        Some(Slot { _all: all, source })
    }
}

/// Serves an axum app (a metrics endpoint) on `listener` under `limits`.
pub async fn serve_app(
    listener: TcpListener,
    limits: Limits,
    what: &'static str,
    app: axum::Router,
) {
    let slots = Slots::of(&limits);
    serve_http(listener, slots, limits, None, what, move |_| {
        hyper_util::service::TowerToHyperService::new(app.clone())
    })
    .await;
}

/// Serves HTTP/1.1 and HTTP/2 (h2c: a client that starts with HTTP/2's
/// preface) on `listener` for ever, with `make(peer)`'s service for each
/// connection, under `limits`. Which one a client speaks is known from its
/// first bytes, which must come within the header timeout (a connection
/// that sends nothing is closed then, whichever it would have spoken). An
/// HTTP/2 connection carries at most [`MAX_STREAMS`] requests at once and
/// header blocks of at most `max_header_bytes`; HTTP/2 has no header
/// deadline of its own, so an idle one is pinged and closed when it does
/// not answer within the header timeout. At most as many connections at
/// once as `slots` has (shared with other listeners, if cloned).
pub async fn serve_http<M, S, B>(
    listener: TcpListener,
    slots: Slots,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    what: &'static str,
    make: M,
) where
    M: Fn(SocketAddr) -> S,
    S: hyper::service::HttpService<Incoming, ResBody = B> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let http1 = |stream: TcpStream, _: SocketAddr, service: S, limits: Limits| async move {
        serve_http1(stream, service, limits)
            .await
            .map_err(Into::into)
    };
    serve_http_with(listener, slots, limits, tls, what, make, http1).await;
}

/// Why a connection ended early (logged at debug level).
pub type ConnectionError = Box<dyn std::error::Error + Send + Sync>;

/// [`serve_http`], with the cleartext HTTP/1.1 connections served by
/// `http1(stream, peer, service, limits)` (which may hand one over to
/// [`serve_http1`]).
pub async fn serve_http_with<M, S, B, H, F>(
    listener: TcpListener,
    slots: Slots,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    what: &'static str,
    make: M,
    http1: H,
) where
    M: Fn(SocketAddr) -> S,
    S: hyper::service::HttpService<Incoming, ResBody = B> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    H: Fn(TcpStream, SocketAddr, S, Limits) -> F + Clone + Send + 'static,
    F: std::future::Future<Output = Result<(), ConnectionError>> + Send,
{
    let mut errors = AcceptErrors::new(what);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                errors.back_off(&e).await;
                continue;
            }
        };
        // An answer is written whole: Nagle's algorithm could only delay it.
        let _ = stream.set_nodelay(true);
        let Some(slot) = slots.take(Some(peer.ip())) else {
            tokio::spawn(refuse_http(stream));
            continue;
        };
        let service = make(peer);
        let tls = tls.clone();
        let http1 = http1.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let served: Result<(), ConnectionError> = match tls {
                None => match speaks_h2(&stream, limits.header_timeout).await {
                    None => return,
                    Some(true) => serve_connection(stream, true, service, limits)
                        .await
                        .map_err(Into::into),
                    Some(false) => http1(stream, peer, service, limits).await,
                },
                // The handshake within the header timeout; ALPN says which.
                Some(acceptor) => {
                    let handshake = acceptor.accept(stream);
                    let Ok(Ok(stream)) =
                        tokio::time::timeout(limits.header_timeout, handshake).await
                    else {
                        return;
                    };
                    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                    serve_connection(stream, h2, service, limits)
                        .await
                        .map_err(Into::into)
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, "{what}: connection ended: {e}");
            }
        });
    }
}

/// Serves one connection in HTTP/1.1 under `limits`, with hyper.
pub async fn serve_http1<I, S, B>(io: I, service: S, limits: Limits) -> hyper::Result<()>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = B> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_connection(io, false, service, limits).await
}

/// A connection whose first bytes were read already: they are read again
/// first (a connection handed over after its start was looked at).
pub struct Prefixed<T> {
    read: bytes::Bytes,
    inner: T,
}

impl<T> Prefixed<T> {
    pub fn new(read: bytes::Bytes, inner: T) -> Self {
        Self { read, inner }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Prefixed<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.read.is_empty() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let n = this.read.len().min(buf.remaining());
        buf.put_slice(&this.read.split_to(n));
        if this.read.is_empty() {
            // Let go of the buffer they were read into.
            this.read = bytes::Bytes::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Prefixed<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Serves one connection in HTTP/2 (`h2`) or HTTP/1.1, under `limits`.
async fn serve_connection<I, S, B>(io: I, h2: bool, service: S, limits: Limits) -> hyper::Result<()>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = B> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = WriteDeadline::new(TokioIo::new(io), limits.write_timeout);
    if h2 {
        // HTTP/2 has no header timeout to end an idle connection (one that
        // answers pings and asks nothing would hold its slot for ever):
        // one that starts no request for the header timeout is shut down
        // gracefully (GOAWAY; streams under way finish).
        let start = tokio::time::Instant::now();
        let last_request_ms = Arc::new(AtomicU64::new(0));
        let counted = {
            let last_request_ms = Arc::clone(&last_request_ms);
            hyper::service::service_fn(move |request| {
                let now = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
                last_request_ms.store(now, Ordering::Relaxed);
                let mut service = service.clone();
                service.call(request)
            })
        };
        let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(MAX_STREAMS)
            .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
            .keep_alive_interval(Some(limits.header_timeout))
            .keep_alive_timeout(limits.header_timeout)
            .serve_connection(io, counted);
        tokio::pin!(connection);
        let idle = limits.header_timeout;
        let mut look = tokio::time::interval(idle / 4);
        let mut closing = false;
        loop {
            tokio::select! {
                served = connection.as_mut() => return served,
                _ = look.tick(), if !closing => {
                    let last = Duration::from_millis(last_request_ms.load(Ordering::Relaxed));
                    if start.elapsed().saturating_sub(last) >= idle {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                    }
                }
            }
        }
    } else {
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_buf_size(limits.max_header_bytes.max(8192))
            .serve_connection(io, service)
            .await
    }
}

/// A TLS server configuration from a certificate chain and its key (PEM
/// files), offering HTTP/2 and HTTP/1.1 by ALPN.
pub fn tls_acceptor(cert: &Path, key: &Path) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use anyhow::Context;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .with_context(|| format!("--tls-cert {}", cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("--tls-cert {}: no PEM certificate in it", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--tls-key {}", key.display()))?;
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("--tls-cert and --tls-key do not make a certificate and its key")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// What an HTTP/2 client sends first (RFC 9113 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the client speaks HTTP/2, from its first bytes (peeked, left
/// for the connection to read); `None` when it sent none within `timeout`
/// or closed.
async fn speaks_h2(stream: &TcpStream, timeout: Duration) -> Option<bool> {
    let detect = async {
        let mut buf = [0u8; H2_PREFACE.len()];
        loop {
            let n = stream.peek(&mut buf).await.ok().filter(|&n| n > 0)?;
            if buf[..n] != H2_PREFACE[..n] {
                return Some(false);
            }
            if n == H2_PREFACE.len() {
                return Some(true);
            }
            // A part of the preface: peek returns it at once until more comes.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(timeout, detect).await.ok().flatten()
}

/// Requests one HTTP/2 connection may have in flight at once.
pub const MAX_STREAMS: u32 = 100;

/// The answer to a connection beyond the cap.
const TOO_MANY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n\
content-length: 21\r\nconnection: close\r\nretry-after: 1\r\n\r\ntoo many connections\n";

async fn refuse_http(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(TOO_MANY)).await;
}

/// A connection whose writes must make progress: one that waits longer
/// than `timeout` for the client to read fails, and the connection ends.
struct WriteDeadline<T> {
    inner: T,
    timeout: Duration,
    /// Armed while a write waits.
    waiting: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> WriteDeadline<T> {
    fn new(inner: T, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            waiting: None,
        }
    }

    /// After a write that could not proceed: pending until the deadline,
    /// then an error.
    fn wait<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        let timeout = self.timeout;
        let timer = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progressed<R>(
        &mut self,
        result: Poll<io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<R>> {
        match result {
            Poll::Pending => self.wait(cx),
            ready => {
                self.waiting = None;
                ready
            }
        }
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for WriteDeadline<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for WriteDeadline<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progressed(result, cx)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_flush(cx);
        this.progressed(result, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progressed(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progressed(result, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A share per address within the whole: a slot refused for the
    /// address gives its place in the whole back, a slot dropped gives
    /// both back, and an exempt address has only the whole.
    #[test]
    fn slots_are_shared_per_source_within_the_whole() {
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let slots = Slots::new(3, 2);
        let a1 = slots.take(Some(a)).expect("a's first");
        let _a2 = slots.take(Some(a)).expect("a's second");
        assert!(slots.take(Some(a)).is_none(), "a's share is 2");
        let _b1 = slots.take(Some(b)).expect("b has the third");
        assert!(slots.take(Some(b)).is_none(), "the whole is 3");
        drop(a1);
        assert!(slots.take(Some(a)).is_some(), "a's slot given back");
        let exempt = Slots::new(3, 1).exempt(&["192.0.2.0/24".parse().unwrap()]);
        let held: Vec<Slot> = (0..3)
            .map(|_| exempt.take(Some(a)).expect("exempt"))
            .collect();
        assert!(exempt.take(Some(b)).is_none());
        drop(held);
        assert!(exempt.take(None).is_some());
    }
}
