//! `limiter proxy`: a small HTTP/1.1 reverse proxy that applies the rule
//! file to requests before forwarding them, so an operator gets L7 limits
//! without writing code.
//!
//! Bad clients cannot tie it up: headers must arrive within the header
//! timeout (slow senders are cut off), header blocks are bounded (larger
//! ones get 431), malformed requests get 400, and a client that drops its
//! connection only ends that connection's task. An upstream that cannot be
//! reached gets the client a 502; that request was already charged, since
//! the limiter decides before forwarding.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use axum::body::Body;
use http::{HeaderValue, Request, Response, StatusCode, Uri, header};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo, TokioTimer},
};
use tokio::net::TcpListener;
use tower::{Service, ServiceBuilder, ServiceExt};

use super::{ClientAddr, KeyBy, Limiter, RateLimitLayer};

/// Proxy settings.
pub struct Options {
    pub listen: SocketAddr,
    pub upstream: Uri,
    pub key_by: KeyBy,
    /// How long a client may take to send its request headers.
    pub header_timeout: Duration,
    /// The largest request header block, in bytes.
    pub max_header_bytes: usize,
    /// How long the upstream may take to answer.
    pub upstream_timeout: Duration,
    /// Where to serve `/metrics` (loopback unless configured otherwise).
    pub metrics: Option<SocketAddr>,
}

/// Renders the limiter's metrics exposition (the caller chooses the format).
pub type RenderMetrics = Arc<dyn Fn(&Limiter) -> String + Send + Sync>;

/// Hop-by-hop fields, which a proxy must not forward.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Serves until the listener fails; `ready` gets the bound address.
pub async fn serve(
    options: Options,
    limiter: Arc<Limiter>,
    render_metrics: RenderMetrics,
    ready: impl FnOnce(SocketAddr),
) -> Result<()> {
    let listener = TcpListener::bind(options.listen)
        .await
        .with_context(|| format!("listening on {}", options.listen))?;
    let local = listener.local_addr()?;
    if let Some(addr) = options.metrics {
        let metrics = TcpListener::bind(addr)
            .await
            .with_context(|| format!("metrics listener on {addr}"))?;
        let limiter = Arc::clone(&limiter);
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let (limiter, render) = (Arc::clone(&limiter), Arc::clone(&render_metrics));
                async move { render(&limiter) }
            }),
        );
        tokio::spawn(async move { axum::serve(metrics, app).await });
    }
    ready(local);
    let client: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new()).build_http();
    let upstream = Arc::new(options.upstream);
    let layer = RateLimitLayer::new(limiter)
        .key_by(options.key_by)
        .port(local.port());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("accept: {e}");
                continue;
            }
        };
        let forward = Forward {
            client: client.clone(),
            upstream: Arc::clone(&upstream),
            timeout: options.upstream_timeout,
        };
        let service = ServiceBuilder::new().layer(layer.clone()).service(forward);
        let (header_timeout, max_header_bytes) = (options.header_timeout, options.max_header_bytes);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
                request.extensions_mut().insert(ClientAddr(peer));
                service.clone().oneshot(request)
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(max_header_bytes.max(8192));
            if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
}

/// Forwards a request to the upstream.
#[derive(Clone)]
struct Forward {
    client: Client<HttpConnector, Body>,
    upstream: Arc<Uri>,
    timeout: Duration,
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
    async fn forward(&self, request: Request<Incoming>) -> Result<Response<Body>> {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut uri = Uri::builder();
        if let Some(scheme) = self.upstream.scheme() {
            uri = uri.scheme(scheme.clone());
        }
        if let Some(authority) = self.upstream.authority() {
            uri = uri.authority(authority.clone());
        }
        let base = self.upstream.path().trim_end_matches('/');
        parts.uri = uri.path_and_query(format!("{base}{path}")).build()?;
        let peer = parts.extensions.get::<ClientAddr>().map(|c| c.0.ip());
        for name in HOP_BY_HOP {
            parts.headers.remove(name);
        }
        if let Some(ip) = peer
            && let Ok(value) = HeaderValue::from_str(&ip.to_string())
        {
            parts.headers.append("x-forwarded-for", value);
        }
        let request = Request::from_parts(parts, Body::new(body));
        let response = tokio::time::timeout(self.timeout, self.client.request(request))
            .await
            .context("the upstream did not answer in time")??;
        let (mut parts, body) = response.into_parts();
        for name in HOP_BY_HOP {
            parts.headers.remove(name);
        }
        Ok(Response::from_parts(parts, Body::new(body)))
    }
}

fn bad_gateway(error: anyhow::Error) -> Response<Body> {
    tracing::warn!("upstream: {error:#}");
    let mut response = Response::new(Body::from(format!("502 Bad Gateway: {error:#}\n")));
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}
