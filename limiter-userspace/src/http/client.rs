//! Client-side pacing: a `tower::Layer` for outbound requests, the other
//! half of rate limiting. It holds each request until it conforms to a
//! budget of the caller's (the same GCRA as everywhere, through
//! `limiter-common`'s pacing), and until the server's own word allows it:
//! after a `429` with `Retry-After`, or a response whose `RateLimit` field
//! says no quota is left (`r=0`), nothing is sent before the time it gave.
//! Waiting requests are bounded: beyond `max_queue` waiting, or a wait
//! longer than `max_delay`, a request fails at once instead of piling up.
//! What it delayed and refused is counted ([`PacingStats`]).

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use http::{HeaderMap, Request, Response, StatusCode};
use limiter_common::{gcra::Gcra, meter::acquire_delayed};
use tower::{Layer, Service};

use crate::{clock::monotonic_ns, rules::Rate};

/// Why a request was not sent.
#[derive(Debug, thiserror::Error)]
pub enum PacingError<E> {
    #[error("{0} requests already wait to be sent")]
    QueueFull(usize),
    #[error(
        "the budget (or the server) allows the next request only in {0:?}, past the longest wait"
    )]
    TooLong(Duration),
    #[error(transparent)]
    Inner(E),
}

/// What a pacer did, since it was made.
#[derive(Debug, Default)]
pub struct PacingStats {
    pub sent: AtomicU64,
    /// Requests held before they were sent, and for how long in total.
    pub delayed: AtomicU64,
    pub delayed_ns: AtomicU64,
    /// Requests failed at once: too many waiting, or a wait too long.
    pub refused: AtomicU64,
    /// Responses `429` from the server.
    pub server_refusals: AtomicU64,
}

struct Pacer {
    budget: Option<Gcra>,
    tat: AtomicU64,
    /// Nothing is sent before this (monotonic ns), as the server said.
    server_until: AtomicU64,
    max_queue: usize,
    max_delay: Duration,
    waiting: AtomicU64,
    stats: Arc<PacingStats>,
}

/// Paces the requests of the services it wraps (clones share one budget).
#[derive(Clone)]
pub struct PacingLayer {
    pacer: Arc<Pacer>,
}

impl PacingLayer {
    /// Paces to `budget` (`None`: only to what the server says), holding
    /// at most `max_queue` requests at once for at most `max_delay` each.
    pub fn new(budget: Option<Rate>, max_queue: usize, max_delay: Duration) -> Self {
        Self {
            pacer: Arc::new(Pacer {
                budget: budget.map(|r| r.gcra),
                tat: AtomicU64::new(0),
                server_until: AtomicU64::new(0),
                max_queue,
                max_delay,
                waiting: AtomicU64::new(0),
                stats: Arc::default(),
            }),
        }
    }

    pub fn stats(&self) -> Arc<PacingStats> {
        Arc::clone(&self.pacer.stats)
    }
}

impl<S> Layer<S> for PacingLayer {
    type Service = Paced<S>;

    fn layer(&self, inner: S) -> Paced<S> {
        Paced {
            inner,
            pacer: Arc::clone(&self.pacer),
        }
    }
}

#[derive(Clone)]
pub struct Paced<S> {
    inner: S,
    pacer: Arc<Pacer>,
}

/// Decrements the waiting count however the wait ends.
struct Waiting<'a>(&'a AtomicU64);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pacer {
    /// How long to hold a request sent now; charges the budget for it.
    fn wait(&self) -> Result<Duration, Duration> {
        let now = monotonic_ns();
        let server = self
            .server_until
            .load(Ordering::Relaxed)
            .saturating_sub(now);
        let max = u64::try_from(self.max_delay.as_nanos()).unwrap_or(u64::MAX);
        if server > max {
            return Err(Duration::from_nanos(server));
        }
        let own = match &self.budget {
            None => 0,
            // Charged at the later of the two: the server's wait counts as
            // time the budget refilled.
            Some(gcra) => {
                acquire_delayed(&self.tat, gcra, now + server, 1, max - server).ok_or_else(
                    || Duration::from_nanos(gcra.wait_ns(self.tat.load(Ordering::Relaxed), now, 1)),
                )? + server
            }
        };
        Ok(Duration::from_nanos(own.max(server)))
    }

    /// How long the server still wants nothing sent.
    fn server_wait_left(&self) -> Duration {
        let until = self.server_until.load(Ordering::Relaxed);
        Duration::from_nanos(until.saturating_sub(monotonic_ns()))
    }

    /// Learns from a response how long the server wants nothing sent.
    fn heed<B>(&self, response: &Response<B>) {
        let headers = response.headers();
        let refused = response.status() == StatusCode::TOO_MANY_REQUESTS;
        if refused {
            self.stats.server_refusals.fetch_add(1, Ordering::Relaxed);
        }
        let wait = server_wait(headers, refused);
        if let Some(wait) = wait {
            let until =
                monotonic_ns().saturating_add(u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX));
            self.server_until.fetch_max(until, Ordering::Relaxed);
        }
    }
}

/// How long the server asks to wait: `Retry-After` (seconds, or an HTTP
/// date) on a refusal, or the longest `t` of the `RateLimit` field's
/// policies whose `r` is 0.
fn server_wait(headers: &HeaderMap, refused: bool) -> Option<Duration> {
    let retry_after = refused
        .then(|| {
            let value = headers
                .get(http::header::RETRY_AFTER)?
                .to_str()
                .ok()?
                .trim();
            match value.parse::<u64>() {
                Ok(secs) => Some(Duration::from_secs(secs)),
                Err(_) => {
                    let at = httpdate::parse_http_date(value).ok()?;
                    Some(
                        at.duration_since(std::time::SystemTime::now())
                            .unwrap_or_default(),
                    )
                }
            }
        })
        .flatten();
    let exhausted = headers
        .get_all("ratelimit")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(policies)
        .filter_map(|params| {
            let get = |k: &str| {
                params
                    .iter()
                    .find(|(n, _)| *n == k)
                    .and_then(|(_, v)| v.parse::<u64>().ok())
            };
            (get("r")? == 0).then(|| get("t")).flatten()
        })
        .max()
        .map(Duration::from_secs);
    retry_after.into_iter().chain(exhausted).max()
}

/// The parameters of each policy of a `RateLimit` field
/// (`"a";r=5;t=1, "b";r=0;t=30`): items split at commas outside the
/// policies' quoted names.
fn policies(field: &str) -> Vec<Vec<(&str, &str)>> {
    let mut items = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in field.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                items.push(&field[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&field[start..]);
    items
        .into_iter()
        .map(|item| {
            // The name, then `;`-separated parameters (after the closing
            // quote: a name may hold a `;`).
            let params = item.rfind('"').map_or(item, |end| &item[end + 1..]);
            params
                .split(';')
                .filter_map(|p| p.trim().split_once('='))
                .map(|(k, v)| (k.trim(), v.trim()))
                .collect()
        })
        .collect()
}

impl<S, B, R> Service<Request<B>> for Paced<S>
where
    S: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    R: Send + 'static,
{
    type Response = Response<R>;
    type Error = PacingError<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Response<R>, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(PacingError::Inner)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let pacer = Arc::clone(&self.pacer);
        // The service that was made ready serves this request; a clone
        // takes its place for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let stats = &pacer.stats;
            let queued = pacer.waiting.fetch_add(1, Ordering::Relaxed) as usize;
            let waiting = Waiting(&pacer.waiting);
            if queued >= pacer.max_queue {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                return Err(PacingError::QueueFull(queued));
            }
            let wait = pacer.wait().map_err(|too_long| {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                PacingError::TooLong(too_long)
            })?;
            let mut waited = Duration::ZERO;
            let mut wait = wait;
            while !wait.is_zero() {
                if waited.is_zero() {
                    stats.delayed.fetch_add(1, Ordering::Relaxed);
                }
                stats
                    .delayed_ns
                    .fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
                tokio::time::sleep(wait).await;
                waited += wait;
                // The server may have refused another request meanwhile:
                // nothing goes out before the time it gave, and the held
                // requests go out then at the budget's pace again (its slot
                // taken anew), not all at once.
                if pacer.server_wait_left().is_zero() {
                    break;
                }
                wait = match pacer.wait() {
                    Ok(wait) if waited + wait <= pacer.max_delay => wait,
                    Ok(wait) | Err(wait) => {
                        stats.refused.fetch_add(1, Ordering::Relaxed);
                        return Err(PacingError::TooLong(waited + wait));
                    }
                };
            }
            drop(waiting);
            stats.sent.fetch_add(1, Ordering::Relaxed);
            let response = inner.call(request).await.map_err(PacingError::Inner)?;
            pacer.heed(&response);
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::test_headers as headers;

    #[test]
    fn the_server_says_how_long_to_wait() {
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(
            server_wait(&headers(&[("retry-after", "3")]), true),
            secs(3)
        );
        assert_eq!(
            server_wait(&headers(&[("retry-after", "3")]), false),
            None,
            "only on a refusal"
        );
        let spent = headers(&[("ratelimit", "\"api\";r=0;t=7")]);
        assert_eq!(server_wait(&spent, false), secs(7));
        let left = headers(&[("ratelimit", "\"api\";r=4;t=7")]);
        assert_eq!(server_wait(&left, false), None);
        let both = headers(&[("retry-after", "2"), ("ratelimit", "\"api\";r=0;t=5")]);
        assert_eq!(server_wait(&both, true), secs(5), "the longer");
        // A date: as long as until then (none, once past).
        assert_eq!(
            server_wait(
                &headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]),
                true
            ),
            Some(Duration::ZERO)
        );
        let later =
            httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(100));
        let wait = server_wait(&headers(&[("retry-after", &later)]), true).unwrap();
        assert!(
            (Duration::from_secs(98)..=Duration::from_secs(100)).contains(&wait),
            "{wait:?}"
        );
        // Several policies: the spent one's wait, whichever comes first.
        let two = headers(&[("ratelimit", "\"a\";r=5;t=1, \"b,;\";r=0;t=30")]);
        assert_eq!(server_wait(&two, false), secs(30));
        let two = headers(&[
            ("ratelimit", "\"a\";r=0;t=3"),
            ("ratelimit", "\"b\";r=9;t=30"),
        ]);
        assert_eq!(server_wait(&two, false), secs(3));
    }
}
