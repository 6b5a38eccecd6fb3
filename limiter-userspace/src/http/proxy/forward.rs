//! The proxy's service behind the rate-limit layer: forwards a request to
//! the upstream, its body watched as it streams, and passes the answer back.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use axum::body::Body;
use http::{HeaderName, HeaderValue, Request, Response, Uri};
use hyper::body::Incoming;
use tower::Service;

use super::{
    answers::{bad_gateway, cut_short},
    hop_by_hop::strip_hop_by_hop,
    stall::Stalling,
    target,
    upload::{Cut, Upload},
    upstream::{Pooled, Upstream},
};
use crate::http::BodyCharge;

pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Forwards a request to the upstream.
#[derive(Clone)]
pub struct Forward {
    /// The client's address, as `X-Forwarded-For` gets it (written once
    /// per connection, not per request).
    pub forwarded_for: Option<HeaderValue>,
    pub upstream: Arc<Upstream>,
    /// The upstream's path, which requests' paths go under.
    pub base: Arc<str>,
    pub timeout: Duration,
    pub max_body_bytes: u64,
    pub body_timeout: Duration,
    pub body_deadline: Duration,
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
    pub fn for_client(&self, peer: SocketAddr) -> Self {
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

/// `X-Forwarded-For`'s value for the client at `peer`.
pub fn forwarded_for(peer: SocketAddr) -> HeaderValue {
    crate::http::headers::written(format_args!("{}", peer.ip()))
}
