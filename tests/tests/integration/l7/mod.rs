//! Layer 7: the conformance corpus replayed over real HTTP connections
//! through the tower layer, the rate-limit response fields, and the
//! `limiter proxy` binary facing bad clients and a dead upstream. All on
//! loopback.
//!
//! A file per topic; this one holds what they share.

mod binary;
mod http2;
mod keys;
mod layer;
mod pacing;
mod tracing;

use std::net::SocketAddr;

use axum::{Router, body::Body, routing::any};
use http::Request;
use limiter::http::RateLimitLayer;

/// Serves `router` behind the layer on a loopback port.
async fn serve(layer: RateLimitLayer) -> SocketAddr {
    let app = Router::new()
        .route("/", any(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("serve")
    });
    addr
}

/// The statuses of `n` GETs of `url` sent one after the other through
/// `service` (0: not sent).
async fn statuses<S, R>(mut service: S, url: &str, n: usize) -> Vec<u16>
where
    S: tower::Service<Request<Body>, Response = http::Response<R>>,
    S::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let mut out = Vec::new();
    for _ in 0..n {
        let request = Request::get(url).body(Body::empty()).unwrap();
        let response = service.ready().await.unwrap().call(request).await;
        out.push(response.map(|r| r.status().as_u16()).unwrap_or(0));
    }
    out
}
