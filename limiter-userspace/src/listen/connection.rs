//! Serving one connection in HTTP/1.1 or HTTP/2 under a listener's
//! limits: a deadline on every request's header (an idle keep-alive
//! connection included: hyper starts the header timer when it waits for a
//! request, not at its first byte), an idle HTTP/2 connection closed, a
//! deadline on every write.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::{limits::Limits, write_deadline::WriteDeadline};

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

/// Serves one connection in HTTP/2 (`h2`) or HTTP/1.1, under `limits`.
pub(super) async fn serve_connection<I, S, B>(
    io: I,
    h2: bool,
    service: S,
    limits: Limits,
) -> hyper::Result<()>
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

/// Requests one HTTP/2 connection may have in flight at once.
pub const MAX_STREAMS: u32 = 100;
