//! `limiter proxy`: a small HTTP/1.1 and HTTP/2 (h2c) reverse proxy that applies the rule
//! file to requests before forwarding them, so an operator gets L7 limits
//! without writing code. Cleartext HTTP/1.1 requests without a body, most
//! of the load, are relayed by the proxy itself ([`relay`]); everything
//! else goes through hyper and the service below.
//!
//! Bad clients cannot tie it up: connections are capped (one more gets
//! 503), headers must arrive within the header timeout (slow senders and
//! idle keep-alive connections are cut off), header blocks are bounded
//! (larger ones get 431), malformed requests get 400, a body must keep
//! arriving (408 when it stalls) and stay under a size cap (413), and a
//! client that drops its connection only ends that connection's task.
//! A chunked upload under a byte limit is charged as it streams and cut
//! (429) when over. CONNECT is refused (405): this is not a forward proxy.
//! An upstream that cannot be reached gets the client a 502, which says
//! nothing of why (the log does); one whose answer stops arriving for the
//! upstream timeout has its answer cut (the connection closes); that request was already charged, since
//! the limiter decides before forwarding.

mod chunked;
mod held;
mod relay;
mod stall;
mod target;
mod upload;
mod upstream;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use axum::body::Body;
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, header,
};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tower::{Service, ServiceBuilder, ServiceExt};

use self::{
    stall::Stalling,
    upload::{Cut, Upload},
    upstream::{Pooled, Upstream},
};
use super::{BodyCharge, ClientAddr, KeyBy, Limiter, RateLimitLayer, Reloadable};
use crate::listen::{self, Limits, Slots};

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
    pub forwarded_field: super::forwarded::ForwardedField,
    /// Serve TLS (HTTP/2 or HTTP/1.1 by ALPN) instead of cleartext.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Threads serving requests, each with its own listener and upstream
    /// pool (0: one per CPU).
    pub workers: usize,
    /// Decisions traced to stdout (`--trace`).
    pub trace: Option<Arc<super::trace::HttpTracer>>,
}

/// Renders the limiter's metrics exposition in the format the scraper's
/// `Accept` header asks for: its content type, and the text. (Given by the
/// caller: layer 7 does not know the renderers, which sit above it.)
pub type RenderMetrics =
    Arc<dyn Fn(&Limiter, Option<&str>) -> (&'static str, String) + Send + Sync>;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Hop-by-hop fields, which a proxy must not forward (RFC 9110 7.6.1),
/// besides those the `Connection` field names.
const HOP_BY_HOP: [HeaderName; 9] = [
    HeaderName::from_static("proxy-connection"),
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

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
    for (n, listener) in listeners.into_iter().enumerate() {
        let (options, limiter, slots, ended) = (
            Arc::clone(&options),
            Arc::clone(&limiter),
            slots.clone(),
            ended.clone(),
        );
        std::thread::Builder::new()
            .name(format!("proxy-{n}"))
            .spawn(move || {
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("a worker's runtime")
                    .and_then(|runtime| {
                        runtime.block_on(worker(listener, local, &options, limiter, slots))
                    });
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
    match response.extensions_mut().remove::<Arc<super::InFlight>>() {
        Some(in_flight) => response.map(|body| Body::new(held::Held::new(body, in_flight))),
        None => response,
    }
}

/// Requests refused before the limiter sees them (and charged nothing):
/// CONNECT, which would make this a tunnel to anywhere, and bodies that
/// say they are over the cap.
fn screen(request: &Request<Incoming>, max_body_bytes: u64) -> Option<Response<Body>> {
    if request.method() == Method::CONNECT {
        let mut response = plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "405 Method Not Allowed: this is a reverse proxy, not a tunnel\n",
        );
        let headers = response.headers_mut();
        headers.insert(
            header::ALLOW,
            HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
        );
        // What follows a CONNECT may be the tunnel's bytes, not a request.
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        return Some(response);
    }
    let length = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if length.is_some_and(|n| n > max_body_bytes) {
        return Some(too_large(max_body_bytes));
    }
    // RFC 9113 8.2.1: such a request is malformed. HTTP/1.1's parser trims
    // the whitespace; HTTP/2's kept it, so `" good"` was a fresh key for a
    // spent `good` that an upstream trimming it served as `good`.
    if request.version() >= http::Version::HTTP_2
        && request.headers().values().any(|v| {
            let padded = |b: Option<&u8>| matches!(b, Some(b' ' | b'\t'));
            padded(v.as_bytes().first()) || padded(v.as_bytes().last())
        })
    {
        return Some(plain(
            StatusCode::BAD_REQUEST,
            "400 Bad Request: a field value begins or ends with whitespace (RFC 9113 8.2.1)\n",
        ));
    }
    None
}

fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::from(text));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

fn too_large(max: u64) -> Response<Body> {
    let mut response = Response::new(Body::from(format!(
        "413 Content Too Large: request bodies are limited to {max} bytes\n"
    )));
    *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Removes the hop-by-hop fields, and those the `Connection` field names.
/// A message carries few or none (an upstream's answer often has
/// `Connection: keep-alive`, which names one): one pass over the names
/// says which are there, and only those are removed.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let present = headers.keys().fold(0u16, |present, name| {
        HOP_BY_HOP
            .iter()
            .position(|h| h == name)
            .map_or(present, |i| present | 1 << i)
    });
    if present == 0 {
        return;
    }
    strip_connection_named(headers);
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & 1 << i != 0 {
            headers.remove(name);
        }
    }
}

/// Removes the fields the `Connection` field names (besides the hop-by-hop
/// ones, which say how the message is framed and go when it is
/// forwarded): a client may name any field so, and the upstream never
/// sees it, so the rules must not judge it either (`X-Api-Key: k1` with
/// `Connection: x-api-key` was keyed by the key and served as anonymous).
fn strip_connection_named(headers: &mut HeaderMap) {
    if !headers.contains_key(header::CONNECTION) {
        return;
    }
    let is_hop_by_hop = |name: &str| {
        HOP_BY_HOP
            .iter()
            .any(|h| h.as_str().eq_ignore_ascii_case(name))
    };
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|name| !is_hop_by_hop(name))
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect();
    for name in &named {
        headers.remove(name);
    }
}

/// Forwards a request to the upstream.
#[derive(Clone)]
struct Forward {
    /// The client's address, as `X-Forwarded-For` gets it (written once
    /// per connection, not per request).
    forwarded_for: Option<HeaderValue>,
    upstream: Arc<Upstream>,
    /// The upstream's path, which requests' paths go under.
    base: Arc<str>,
    timeout: Duration,
    max_body_bytes: u64,
    body_timeout: Duration,
    body_deadline: Duration,
}

impl Service<Request<Incoming>> for Forward {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<Body>, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(request).await.unwrap_or_else(bad_gateway)) })
    }
}

impl Forward {
    /// This forwarder for the requests of the client at `peer`.
    fn for_client(&self, peer: SocketAddr) -> Self {
        Self {
            forwarded_for: Some(forwarded_for(peer)),
            ..self.clone()
        }
    }

    async fn forward(&self, request: Request<Incoming>) -> Result<Response<Body>> {
        let (mut parts, body) = request.into_parts();
        parts.uri = self.upstream_uri(&parts.uri)?;
        // The client may speak HTTP/2; the upstream leg is HTTP/1.1.
        if parts.version >= http::Version::HTTP_2 {
            target::join_cookies(&mut parts.headers);
        }
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        if let Some(client) = &self.forwarded_for {
            parts.headers.append(X_FORWARDED_FOR, client.clone());
        }
        if http_body::Body::is_end_stream(&body) {
            // No body (a GET): nothing to watch but the upstream's time.
            let request = Request::from_parts(parts, Body::empty());
            let response = tokio::time::timeout(self.timeout, self.upstream.send(request))
                .await
                .map_err(|_| anyhow::anyhow!("the upstream did not answer in time"))??;
            return Ok(self.answer(response));
        }
        let charge = parts.extensions.get::<BodyCharge>().cloned();
        let upload = Upload::new(body, self.max_body_bytes, charge);
        let progress = upload.progress();
        let request = Request::from_parts(parts, Body::new(upload));
        let answer = self.upstream.send(request);
        // Watches the exchange from outside the body (an upstream that stops
        // reading stops polling it): a body may pause up to the body
        // timeout; the upstream's time starts when it has the whole request,
        // so a slow upload is the body timeout's business.
        // And the whole body within the body deadline, however it trickles.
        let deadline = tokio::time::Instant::now() + self.body_deadline;
        let watchdog = async {
            loop {
                let (moved, whole) = progress.get();
                let due = if whole {
                    moved + self.timeout
                } else {
                    (moved + self.body_timeout).min(deadline)
                };
                if tokio::time::Instant::now() >= due {
                    return whole;
                }
                // Until the deadline, or until the body moves (which may
                // end it, and start the upstream's time).
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    () = progress.moved_since() => {}
                }
            }
        };
        let response = tokio::select! {
            response = answer => response,
            whole = watchdog => {
                if whole {
                    anyhow::bail!("the upstream did not answer in time");
                }
                if !progress.waiting_on_client() {
                    // The body is not being read: the upstream is slow to
                    // connect or to take it, the client is not at fault.
                    anyhow::bail!("the upstream did not take the request in time");
                }
                let cut = Cut::timed_out(deadline);
                progress.cut_short(cut);
                return Ok(cut_short(cut, self.max_body_bytes));
            }
        };
        // Answered before the body is whole: hyper goes on sending it, and
        // it must keep arriving.
        if !progress.get().1 {
            tokio::spawn(Arc::clone(&progress).watch(self.body_timeout, deadline));
        }
        let response = match (response, progress.cut()) {
            (_, Some(cut)) => return Ok(cut_short(cut, self.max_body_bytes)),
            (response, None) => response?,
        };
        Ok(self.answer(response))
    }

    /// The upstream's answer, for the client: without hop-by-hop fields,
    /// its body watched for stalls.
    fn answer(&self, response: Response<Pooled>) -> Response<Body> {
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let body = Stalling::new(body, self.timeout);
        Response::from_parts(parts, Body::new(body))
    }

    /// The request's target on the upstream, in origin form: its path
    /// (and query) under the upstream's.
    fn upstream_uri(&self, uri: &Uri) -> Result<Uri> {
        let mut parts = http::uri::Parts::default();
        parts.path_and_query = match (&*self.base, uri.path_and_query()) {
            // Shared, not copied.
            ("", Some(path)) => Some(path.clone()),
            (base, path) => Some(
                format!("{base}{}", path.map_or("/", |p| p.as_str()))
                    .parse()
                    .context("the upstream path")?,
            ),
        };
        Ok(Uri::from_parts(parts)?)
    }
}

/// The answer to a request whose body the proxy stopped reading.
fn cut_short(cut: Cut, max_body_bytes: u64) -> Response<Body> {
    let mut response = match cut {
        Cut::TooLarge => return too_large(max_body_bytes),
        Cut::OverLimit => plain(
            StatusCode::TOO_MANY_REQUESTS,
            "429 Too Many Requests: the request body is over its byte limit\n",
        ),
        Cut::Stalled => plain(
            StatusCode::REQUEST_TIMEOUT,
            "408 Request Timeout: the request body stopped arriving\n",
        ),
        Cut::TooSlow => plain(
            StatusCode::REQUEST_TIMEOUT,
            "408 Request Timeout: the request body took longer than allowed\n",
        ),
    };
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The body of a 502, which tells the client nothing about the upstream.
const BAD_GATEWAY: &str = "502 Bad Gateway\n";

/// A 502 that tells the client nothing about the upstream (the log does).
fn bad_gateway(error: anyhow::Error) -> Response<Body> {
    log_unanswered(&error);
    plain(StatusCode::BAD_GATEWAY, BAD_GATEWAY)
}

/// Says in the log why the upstream did not answer.
fn log_unanswered(error: &anyhow::Error) {
    tracing::warn!("upstream: {error:#}");
}

/// `X-Forwarded-For`'s value for the client at `peer`.
fn forwarded_for(peer: SocketAddr) -> HeaderValue {
    super::headers::written(format_args!("{}", peer.ip()))
}
