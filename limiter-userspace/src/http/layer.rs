//! A `tower::Layer` that applies a [`super::Limiter`] to HTTP requests, so
//! it drops into axum, hyper or tonic services.

use std::{
    borrow::Cow,
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use http::{HeaderName, Request, Response, StatusCode};
use tower::{Layer, Service};

use super::{
    body::BodyMeter,
    decision::{Decision, RequestMeta},
    limiter::Limiter,
    reload::Reloadable,
};
use crate::rules::HttpRequest;

/// What identifies a client.
#[derive(Clone)]
pub enum KeyBy {
    /// The peer address (masked as the rule's `key` says), from the
    /// [`ClientAddr`] or axum's `ConnectInfo<SocketAddr>` extension.
    ClientAddr,
    /// The value of a request header (an API key, a user id); requests
    /// without it are keyed by address.
    Header(HeaderName),
    /// Any key the caller extracts.
    Custom(KeyFn),
}

/// A caller's key extractor (`None`: key by address).
pub type KeyFn = Arc<dyn Fn(&http::request::Parts) -> Option<Vec<u8>> + Send + Sync>;

/// What a request costs against byte limits.
#[derive(Clone)]
pub enum CostBy {
    /// Its `Content-Length`; a body without one (chunked) is charged as it
    /// streams, by whoever reads it ([`BodyCharge`]).
    ContentLength,
    Custom(Arc<dyn Fn(&http::request::Parts) -> u64 + Send + Sync>),
}

/// Inserted into an admitted request whose body its rule's byte limits
/// charge as it streams (a chunked upload: its size was not known when it
/// was admitted). Whoever reads the body calls [`BodyCharge::charge`] for
/// each chunk and stops reading when it refuses (`limiter proxy` answers
/// 429 and cuts the upload short).
#[derive(Clone)]
pub struct BodyCharge {
    limiter: Arc<Limiter>,
    meter: BodyMeter,
    /// Whether this body went over its limit already (counted once).
    over: Arc<std::sync::atomic::AtomicBool>,
}

impl BodyCharge {
    /// The most a single charge may be: the smallest burst or window of
    /// the rule's byte limits (more at once could never be admitted).
    pub fn max_cost(&self) -> u64 {
        self.meter.max_cost
    }

    /// Charges `n` more body bytes; `false`: over the limit, stop (under a
    /// dry run, the excess is counted and the body goes on).
    pub fn charge(&self, n: u64) -> bool {
        if self.limiter.charge_body(&self.meter, n) {
            return true;
        }
        let first = !self.over.swap(true, std::sync::atomic::Ordering::Relaxed);
        self.limiter.count_body_over_limit(&self.meter, first)
    }
}

/// The client's address, inserted by whoever accepted the connection.
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub SocketAddr);

#[derive(Clone)]
pub struct RateLimitLayer {
    limiter: Arc<Reloadable>,
    key_by: KeyBy,
    cost_by: CostBy,
    /// The service's port, for rules that name `dest_port`.
    port: Option<u16>,
    /// Peers whose `Forwarded` / `X-Forwarded-For` say who the client is.
    trusted_proxies: Arc<[ipnet::IpNet]>,
    forwarded_field: super::forwarded::ForwardedField,
    /// Where decisions are traced (`limiter proxy --trace`), if anywhere.
    trace: Option<Arc<super::trace::HttpTracer>>,
}

impl RateLimitLayer {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self::reloadable(Arc::new(Reloadable::new(limiter)))
    }

    /// Applies whichever limiter `limiter` holds when a request arrives
    /// (a rule file reloaded without losing buckets: [`Reloadable`]).
    pub fn reloadable(limiter: Arc<Reloadable>) -> Self {
        Self {
            limiter,
            key_by: KeyBy::ClientAddr,
            cost_by: CostBy::ContentLength,
            port: None,
            trusted_proxies: Arc::new([]),
            forwarded_field: Default::default(),
            trace: None,
        }
    }

    /// Traces decisions (`limiter proxy --trace`).
    pub fn trace(mut self, tracer: Option<Arc<super::trace::HttpTracer>>) -> Self {
        self.trace = tracer;
        self
    }

    /// Requests from these proxies are from the client their forwarding
    /// fields name (see [`super::forwarded`]); from anyone else, from the
    /// peer, whatever the fields say.
    pub fn trust_proxies(mut self, proxies: Vec<ipnet::IpNet>) -> Self {
        self.trusted_proxies = proxies.into();
        self
    }

    /// The field the trusted proxies record the client in
    /// (`X-Forwarded-For` unless told otherwise); the other is never read.
    pub fn forwarded_field(mut self, field: super::forwarded::ForwardedField) -> Self {
        self.forwarded_field = field;
        self
    }

    pub fn key_by(mut self, key_by: KeyBy) -> Self {
        self.key_by = key_by;
        self
    }

    pub fn cost_by(mut self, cost_by: CostBy) -> Self {
        self.cost_by = cost_by;
        self
    }

    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            config: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: RateLimitLayer,
}

impl<S, B, R> Service<Request<B>> for RateLimit<S>
where
    S: Service<Request<B>, Response = Response<R>> + Send,
    S::Future: Send + 'static,
    R: From<String> + Send + 'static,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<R>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let extensions = request.extensions();
        let peer = extensions.get::<ClientAddr>().map(|c| c.0).or_else(|| {
            extensions
                .get::<axum::extract::ConnectInfo<SocketAddr>>()
                .map(|c| c.0)
        });
        let Judged {
            decision,
            fields,
            refusal,
            body_charge,
        } = self.config.judge(&request, peer);
        if let Some(charge) = body_charge {
            request.extensions_mut().insert(charge);
        }
        if let Some(refusal) = refusal {
            let mut response = Response::new(R::from(refusal));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            fields.apply(response.headers_mut());
            return Box::pin(async move { Ok(response) });
        }
        let future = self.inner.call(request);
        Box::pin(async move {
            if decision.delay_ns > 0 {
                tokio::time::sleep(std::time::Duration::from_nanos(decision.delay_ns)).await;
            }
            let mut response = future.await?;
            fields.apply(response.headers_mut());
            // In flight until the response is dropped: with its head, or,
            // for whoever takes it from here and holds it with the body
            // (`limiter proxy` does), when the body ends.
            if let Some(in_flight) = decision.in_flight {
                response.extensions_mut().insert(in_flight);
            }
            Ok(response)
        })
    }
}

/// A request judged: whether it goes on, and what its answer says.
pub(crate) struct Judged {
    pub decision: Decision,
    /// The rate-limit fields of its answer.
    pub fields: super::headers::Fields,
    /// The body of its 429, when refused.
    pub refusal: Option<String>,
    /// Set when its body is charged as it streams.
    pub body_charge: Option<BodyCharge>,
}

impl RateLimitLayer {
    /// Judges `request`, from the client at `peer` (unknown: `0.0.0.0`).
    pub(crate) fn judge<B>(&self, request: &Request<B>, peer: Option<SocketAddr>) -> Judged {
        let limiter = self.limiter.load();
        let (decision, body_charge) = self.admit(request, peer, &limiter);
        let fields = super::headers::fields(
            &decision,
            limiter.rule_fields(&decision),
            limiter.quota(&decision),
        );
        let refusal = (!decision.allowed).then(|| {
            let rule = limiter.rule_name(&decision);
            if decision.too_many_in_flight {
                format!("429 Too Many Requests: too many requests in flight (rule {rule:?})\n")
            } else if decision.blocked_for_ns > 0 {
                format!(
                    "429 Too Many Requests: blocked by rule {rule:?} for {} s more, after staying over its limit\n",
                    decision.blocked_for_ns.div_ceil(1_000_000_000)
                )
            } else {
                format!("429 Too Many Requests: rate limited by rule {rule:?}\n")
            }
        });
        Judged {
            decision,
            fields,
            refusal,
            body_charge,
        }
    }

    fn admit<B>(
        &self,
        request: &Request<B>,
        peer: Option<SocketAddr>,
        limiter: &Arc<Limiter>,
    ) -> (Decision, Option<BodyCharge>) {
        let client = peer.map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
        let client = if self.trusted_proxies.is_empty() {
            client
        } else {
            super::forwarded::client(
                client,
                request.headers(),
                &self.trusted_proxies,
                self.forwarded_field,
            )
        };
        let headers = request.headers();
        // Parts without the body, for the caller's extractors only: a copy
        // of the headers is an allocation per request.
        let parts = || {
            let mut parts = Request::new(()).into_parts().0;
            parts.method = request.method().clone();
            parts.uri = request.uri().clone();
            parts.headers = headers.clone();
            parts
        };
        let key: Option<Cow<'_, [u8]>> = match &self.key_by {
            KeyBy::ClientAddr => None,
            KeyBy::Header(name) => headers.get(name).map(|v| Cow::Borrowed(v.as_bytes())),
            KeyBy::Custom(f) => f(&parts()).map(Cow::Owned),
        };
        let length = headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let bytes = match &self.cost_by {
            CostBy::ContentLength => length.unwrap_or(0),
            CostBy::Custom(f) => f(&parts()),
        };
        let meta = RequestMeta {
            client,
            port: self.port,
            key: key.as_deref(),
            bytes,
            http: Some(HttpRequest {
                method: request.method(),
                uri: request.uri(),
                headers,
            }),
        };
        let decision = limiter.check(&meta);
        if let Some(tracer) = &self.trace {
            tracer.record(
                &decision,
                limiter,
                client,
                self.port,
                bytes,
                meta.http.as_ref(),
            );
        }
        // Without Content-Length, a body is charged as it streams: in
        // HTTP/1.1 a request has one only if it says how it is framed
        // (Transfer-Encoding); in HTTP/2 and later, which frame bodies
        // themselves, any request may (one without is charged nothing).
        let streams = matches!(self.cost_by, CostBy::ContentLength)
            && length.is_none()
            && (headers.contains_key(http::header::TRANSFER_ENCODING)
                || request.version() >= http::Version::HTTP_2);
        let charge = (decision.allowed && streams)
            .then(|| limiter.body_meter(&meta))
            .flatten()
            .map(|meter| BodyCharge {
                limiter: Arc::clone(limiter),
                meter,
                over: Default::default(),
            });
        (decision, charge)
    }
}
