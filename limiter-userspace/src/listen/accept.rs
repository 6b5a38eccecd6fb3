//! The accept loop: accept errors (file descriptors run out under a
//! connection flood) back off instead of spinning, logged once per
//! interval with a count; a connection past the cap is told so and closed;
//! the rest are handed, by their first bytes or by TLS's ALPN, to HTTP/1.1
//! or HTTP/2.

use std::{
    io,
    net::SocketAddr,
    time::{Duration, Instant},
};

use hyper::body::Incoming;
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
};

use super::{
    connection::{serve_connection, serve_http1},
    limits::Limits,
    slots::Slots,
};

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
/// HTTP/2 connection carries at most [`MAX_STREAMS`](super::MAX_STREAMS)
/// requests at once and header blocks of at most `max_header_bytes`;
/// HTTP/2 has no header deadline of its own, so an idle one is pinged and
/// closed when it does not answer within the header timeout. At most as
/// many connections at once as `slots` has (shared with other listeners,
/// if cloned).
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

/// The answer to a connection beyond the cap.
const TOO_MANY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n\
content-length: 21\r\nconnection: close\r\nretry-after: 1\r\n\r\ntoo many connections\n";

async fn refuse_http(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(TOO_MANY)).await;
}
