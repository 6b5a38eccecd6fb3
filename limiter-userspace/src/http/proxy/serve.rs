//! The proxy's listening: the worker threads, each with its own listener,
//! runtime and upstream pool, and the metrics listener; and the service
//! each connection's requests go through.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use axum::body::Body;
use http::{HeaderMap, Request, Response, Uri, header};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};

use super::{answers::screen, forward::Forward, held, relay, target, upstream::Upstream};
use crate::{
    http::{ClientAddr, KeyBy, Limiter, RateLimitLayer, Reloadable},
    listen::{self, Limits, Slots},
};

/// Proxy settings.
pub struct Options {
    pub listen: SocketAddr,
    pub upstream: Uri,
    pub key_by: KeyBy,
    /// How long a client may take to send its request headers.
    pub header_timeout: Duration,
    /// The largest request header block, in bytes.
    pub max_header_bytes: usize,
    /// Connections served at once (the metrics listener allows 64).
    pub max_connections: usize,
    /// Connections served at once from one client address (trusted
    /// proxies excepted); one more gets 503.
    pub max_connections_per_source: usize,
    /// The largest request body, in bytes.
    pub max_body_bytes: u64,
    /// How long a request body may pause between two chunks.
    pub body_timeout: Duration,
    /// Longest a request body may take in all (`--body-deadline`).
    pub body_deadline: Duration,
    /// How long the upstream may take to answer, once it has the request.
    pub upstream_timeout: Duration,
    /// Where to serve `/metrics` (loopback unless configured otherwise).
    pub metrics: Option<SocketAddr>,
    /// Peers whose forwarding field names the client.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// The field they record it in.
    pub forwarded_field: crate::http::forwarded::ForwardedField,
    /// Serve TLS (HTTP/2 or HTTP/1.1 by ALPN) instead of cleartext.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Threads serving requests, each with its own listener and upstream
    /// pool (0: one per CPU).
    pub workers: usize,
    /// Decisions traced to stdout (`--trace`).
    pub trace: Option<Arc<crate::http::trace::HttpTracer>>,
}

/// Renders the limiter's metrics exposition in the format the scraper's
/// `Accept` header asks for: its content type, and the text. (Given by the
/// caller: layer 7 does not know the renderers, which sit above it.)
pub type RenderMetrics =
    Arc<dyn Fn(&Limiter, Option<&str>) -> (&'static str, String) + Send + Sync>;

/// Serves until a listener fails; `ready` gets the bound address.
///
/// Requests are served by `workers` threads, each with a runtime of its
/// own, its own listening socket on the address (`SO_REUSEPORT`: the
/// kernel spreads connections over them) and its own pool of upstream
/// connections, as nginx's workers: a request is read, judged, forwarded
/// and answered on one thread, with no hand-off between threads. They
/// share the limiter, and the cap on connections. The metrics listener
/// runs on the caller's runtime.
pub async fn serve(
    options: Options,
    limiter: Arc<Reloadable>,
    render_metrics: RenderMetrics,
    ready: impl FnOnce(SocketAddr),
) -> Result<()> {
    let workers = match options.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // Said before anything listens.
    Upstream::new(&options.upstream)?;
    let listeners = reuseport_listeners(options.listen, workers)
        .with_context(|| format!("listening on {}", options.listen))?;
    let local = listeners[0].local_addr()?;
    // Every worker's runtime before any connection is taken: one built
    // after the first worker started accepting could find the process's
    // descriptors gone to its clients, and the proxy would stop.
    let runtimes = (0..workers)
        .map(|_| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("a worker's runtime")
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(addr) = options.metrics {
        let metrics = TcpListener::bind(addr)
            .await
            .with_context(|| format!("metrics listener on {addr}"))?;
        let limiter = Arc::clone(&limiter);
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move |headers: HeaderMap| {
                let (limiter, render) = (Arc::clone(&limiter), Arc::clone(&render_metrics));
                async move {
                    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
                    let (content_type, text) = render(&limiter.current(), accept);
                    ([(header::CONTENT_TYPE, content_type)], text)
                }
            }),
        );
        let limits = Limits {
            max_connections: 64,
            ..Limits::default()
        };
        tokio::spawn(listen::serve_app(metrics, limits, "metrics", app));
    }
    ready(local);
    let options = Arc::new(options);
    let slots = Slots::new(options.max_connections, options.max_connections_per_source)
        .exempt(&options.trusted_proxies);
    let (ended, mut first_end) = tokio::sync::mpsc::unbounded_channel();
    for (n, (listener, runtime)) in listeners.into_iter().zip(runtimes).enumerate() {
        let (options, limiter, slots, ended) = (
            Arc::clone(&options),
            Arc::clone(&limiter),
            slots.clone(),
            ended.clone(),
        );
        std::thread::Builder::new()
            .name(format!("proxy-{n}"))
            .spawn(move || {
                let served = runtime.block_on(worker(listener, local, &options, limiter, slots));
                let _ = ended.send(served);
            })
            .context("starting a worker thread")?;
    }
    first_end.recv().await.unwrap_or(Ok(()))
}

/// `n` listening sockets on `addr`, all on the first one's port (an
/// `addr` with port 0 gets one port for all).
fn reuseport_listeners(addr: SocketAddr, n: usize) -> Result<Vec<std::net::TcpListener>> {
    use socket2::{Domain, Protocol, Socket, Type};
    let mut addr = addr;
    let mut listeners = Vec::with_capacity(n);
    for _ in 0..n {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        let listener: std::net::TcpListener = socket.into();
        addr = listener.local_addr()?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// One worker: its listener, its upstream pool, the shared limiter.
async fn worker(
    listener: std::net::TcpListener,
    local: SocketAddr,
    options: &Options,
    limiter: Arc<Reloadable>,
    slots: Slots,
) -> Result<()> {
    let listener = TcpListener::from_std(listener)?;
    let upstream = Upstream::new(&options.upstream)?;
    tokio::spawn(close_stale_upstream_connections(Arc::downgrade(&upstream)));
    let forward = Forward {
        upstream,
        base: Arc::from(options.upstream.path().trim_end_matches('/')),
        timeout: options.upstream_timeout,
        max_body_bytes: options.max_body_bytes,
        body_timeout: options.body_timeout,
        body_deadline: options.body_deadline,
        forwarded_for: None,
    };
    let layer = RateLimitLayer::reloadable(limiter)
        .key_by(options.key_by.clone())
        .trust_proxies(options.trusted_proxies.clone())
        .forwarded_field(options.forwarded_field)
        .trace(options.trace.clone())
        .port(local.port());
    let limits = Limits {
        max_connections: options.max_connections,
        header_timeout: options.header_timeout,
        max_header_bytes: options.max_header_bytes,
        ..Limits::default()
    };
    let max_body_bytes = options.max_body_bytes;
    let relay = Arc::new(relay::Relay {
        layer: layer.clone(),
        upstream: Arc::clone(&forward.upstream),
        base: Arc::clone(&forward.base),
        timeout: options.upstream_timeout,
    });
    let make = move |peer| {
        let service = ServiceBuilder::new()
            .layer(layer.clone())
            .service(forward.for_client(peer));
        hyper::service::service_fn(move |mut request: Request<Incoming>| {
            let service = service.clone();
            async move {
                if let Some(refusal) = screen(&request, max_body_bytes) {
                    return Ok(refusal);
                }
                // Judged as forwarded: one host, one path.
                target::canonicalize(&mut request);
                request.extensions_mut().insert(ClientAddr(peer));
                let response = service.oneshot(request).await?;
                Ok::<_, std::convert::Infallible>(hold_in_flight(response))
            }
        })
    };
    // Cleartext HTTP/1.1 is relayed without hyper while it can be.
    let http1 = move |stream, peer, service, limits| {
        let relay = Arc::clone(&relay);
        async move {
            let hyper = |io| listen::serve_http1(io, service, limits);
            relay.serve(stream, peer, limits, hyper).await
        }
    };
    listen::serve_http_with(
        listener,
        slots,
        limits,
        options.tls.clone(),
        "proxy",
        make,
        http1,
    )
    .await;
    Ok(())
}

/// Closes the worker's upstream connections idle too long, now and then,
/// for as long as the worker has them.
async fn close_stale_upstream_connections(upstream: std::sync::Weak<Upstream>) {
    let mut every = tokio::time::interval(Duration::from_secs(10));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        match upstream.upgrade() {
            Some(upstream) => upstream.close_stale(),
            None => return,
        }
    }
}

/// A response whose request its rule counts in flight keeps it counted
/// until the body has been sent (or the client has gone).
fn hold_in_flight(mut response: Response<Body>) -> Response<Body> {
    match response
        .extensions_mut()
        .remove::<Arc<crate::http::InFlight>>()
    {
        Some(in_flight) => response.map(|body| Body::new(held::Held::new(body, in_flight))),
        None => response,
    }
}
