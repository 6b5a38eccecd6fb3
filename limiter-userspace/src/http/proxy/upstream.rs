//! The upstream leg: HTTP/1.1 connections to the upstream, kept alive and
//! reused. Each worker has its own set (its tasks all run on its thread),
//! so taking a connection and giving it back is a pop and a push under a
//! lock no other thread wants, with no task spawned per request: a
//! connection goes back when the client's copy of its answer has ended,
//! by which time it is ready for the next request.
//!
//! An idle connection the upstream has closed may be taken just as it
//! closes: a request it could not send at all goes on another (or a new)
//! one, as a browser retries; a request it did send is not sent twice.

use std::{
    collections::VecDeque,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::{Body as _, Frame, SizeHint};
use hyper::{body::Incoming, client::conn::http1::SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Idle connections a worker keeps at most (more are closed).
const MAX_IDLE: usize = 256;
/// How long a connection may stay idle before it is closed (as hyper's
/// own pool: upstreams usually end theirs sooner, which is noticed).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Why an upstream cannot be used at all (said at start-up).
#[derive(Debug, thiserror::Error)]
pub enum BadUpstream {
    #[error("the upstream {0} has no scheme: write http://{0}")]
    NoScheme(Uri),
    #[error("the upstream {0}: only http:// is supported (TLS to the upstream is not)")]
    Scheme(Uri),
    #[error("the upstream {0} names no host")]
    NoHost(Uri),
}

/// Why a request got no answer from the upstream.
#[derive(Debug, thiserror::Error)]
pub enum Unanswered {
    #[error("connecting to the upstream {0}: {1}")]
    Connect(String, std::io::Error),
    #[error(transparent)]
    Http(#[from] hyper::Error),
}

/// One worker's connections to the upstream.
pub struct Upstream {
    /// Where to connect (a name is resolved at each new connection).
    host: String,
    port: u16,
    /// `host:port` as written in a URI (an IPv6 address in brackets).
    shown: String,
    /// `Host` for requests that came without one: the upstream's host,
    /// and its port unless 80 (never the URI's user name or password).
    authority: HeaderValue,
    /// Idle connections hyper's client drives.
    senders: Idle<SendRequest<Body>>,
    /// Idle connections the proxy writes requests on itself.
    streams: Idle<TcpStream>,
}

impl Upstream {
    pub fn new(uri: &Uri) -> Result<Arc<Self>, BadUpstream> {
        match uri.scheme_str() {
            Some("http") => {}
            Some(_) => return Err(BadUpstream::Scheme(uri.clone())),
            None => return Err(BadUpstream::NoScheme(uri.clone())),
        }
        let authority = uri
            .authority()
            .filter(|a| !a.host().is_empty())
            .ok_or_else(|| BadUpstream::NoHost(uri.clone()))?;
        let host = authority.host();
        let port = authority.port_u16().unwrap_or(80);
        let host_field = match port {
            80 => host.to_owned(),
            port => format!("{host}:{port}"),
        };
        Ok(Arc::new(Self {
            // An IPv6 literal is written in brackets, and connected to without.
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port,
            shown: format!("{host}:{port}"),
            authority: HeaderValue::from_str(&host_field)
                .map_err(|_| BadUpstream::NoHost(uri.clone()))?,
            senders: Idle::new(),
            streams: Idle::new(),
        }))
    }

    /// Sends `request` (its target in origin form) and returns the
    /// answer's head; reading its body to the end gives the connection
    /// back.
    pub async fn send(
        self: &Arc<Self>,
        mut request: Request<Body>,
    ) -> Result<Response<Pooled>, Unanswered> {
        if !request.headers().contains_key(header::HOST) {
            request
                .headers_mut()
                .insert(header::HOST, self.authority.clone());
        }
        loop {
            let (mut sender, reused) = match self.take_idle() {
                Some(sender) => (sender, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let upstream = Arc::clone(self);
                    return Ok(response.map(|body| Pooled {
                        inner: body,
                        ended: false,
                        connection: Some((sender, upstream)),
                    }));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the connection had closed.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(Unanswered::Http(e.into_error())),
                },
            }
        }
    }

    /// The most recently used idle connection that can take a request now.
    /// Closed ones are let go, and so are those idle too long (a firewall
    /// between may have forgotten them without a word); one still sending
    /// the body of a request answered early stays, for later.
    fn take_idle(&self) -> Option<SendRequest<Body>> {
        self.senders.take(|sender| {
            if sender.is_ready() {
                Usable::Now
            } else if sender.is_closed() {
                Usable::Never
            } else {
                Usable::Later
            }
        })
    }

    fn give_back(&self, sender: SendRequest<Body>) {
        self.senders.give_back(sender);
    }

    /// Closes the connections idle too long, also when no request comes
    /// to notice (an upstream that never ends idle connections would keep
    /// them open for ever), and lets go of those the upstream closed.
    pub fn close_stale(&self) {
        self.senders.close_stale(SendRequest::is_closed);
        self.streams.close_stale(|stream| !is_quiet(stream));
    }

    /// A connection for a request the proxy writes itself, and whether it
    /// was used before: an idle one unless there is none. One the upstream
    /// has closed, or sent anything on unasked, is let go (looking costs a
    /// system call only when the connection has something to read).
    pub async fn stream(&self) -> Result<(TcpStream, bool), Unanswered> {
        let idle = self.streams.take(|stream| {
            if is_quiet(stream) {
                Usable::Now
            } else {
                Usable::Never
            }
        });
        match idle {
            Some(stream) => Ok((stream, true)),
            None => Ok((self.connect_stream().await?, false)),
        }
    }

    /// Keeps `stream` for the next request; it must be between messages.
    pub fn give_back_stream(&self, stream: TcpStream) {
        self.streams.give_back(stream);
    }

    /// A new connection to the upstream.
    pub async fn connect_stream(&self) -> Result<TcpStream, Unanswered> {
        let failed = |e| Unanswered::Connect(self.shown.clone(), e);
        let stream = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(failed)?;
        // Each request is one write: Nagle's algorithm could only delay it.
        stream.set_nodelay(true).map_err(failed)?;
        Ok(stream)
    }

    async fn connect(&self) -> Result<SendRequest<Body>, Unanswered> {
        let stream = self.connect_stream().await?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("upstream connection ended: {e}");
            }
        });
        Ok(sender)
    }
}

/// Whether nothing has come on an idle connection: not the upstream's
/// close, nor bytes no request asked for.
fn is_quiet(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(stream.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Whether an idle connection can take a request.
enum Usable {
    Now,
    /// Not yet (it is still busy with the last one).
    Later,
    Never,
}

/// One kind of idle connection: most recently used last, taken from the
/// back, aged out at the front, at most [`MAX_IDLE`].
struct Idle<T>(Mutex<VecDeque<(T, Instant)>>);

impl<T> Idle<T> {
    fn new() -> Self {
        Self(Mutex::new(VecDeque::new()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(T, Instant)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used that `usable` says can be used now; those
    /// it says never can are let go.
    fn take(&self, usable: impl Fn(&T) -> Usable) -> Option<T> {
        let mut idle = self.lock();
        Self::age_out(&mut idle, Instant::now());
        let mut at = idle.len();
        while at > 0 {
            at -= 1;
            match usable(&idle[at].0) {
                Usable::Now => return idle.remove(at).map(|(connection, _)| connection),
                Usable::Later => {}
                Usable::Never => {
                    idle.remove(at);
                }
            }
        }
        None
    }

    fn give_back(&self, connection: T) {
        let now = Instant::now();
        let mut idle = self.lock();
        Self::age_out(&mut idle, now);
        if idle.len() == MAX_IDLE {
            // The longest idle makes room.
            idle.pop_front();
        }
        idle.push_back((connection, now));
    }

    fn close_stale(&self, closed: impl Fn(&T) -> bool) {
        let mut idle = self.lock();
        Self::age_out(&mut idle, Instant::now());
        idle.retain(|(connection, _)| !closed(connection));
    }

    fn age_out(idle: &mut VecDeque<(T, Instant)>, now: Instant) {
        while idle
            .front()
            .is_some_and(|(_, since)| now.duration_since(*since) > IDLE_TIMEOUT)
        {
            idle.pop_front();
        }
    }
}

/// An answer's body from the upstream. Once it has ended, dropping it
/// gives its connection back for the next request; one dropped before
/// its end takes the connection with it (hyper closes it: what is left
/// of the answer would come before the next one).
pub struct Pooled {
    inner: Incoming,
    ended: bool,
    connection: Option<(SendRequest<Body>, Arc<Upstream>)>,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if (self.ended || self.inner.is_end_stream())
            && let Some((sender, upstream)) = self.connection.take()
        {
            upstream.give_back(sender);
        }
    }
}

impl http_body::Body for Pooled {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        // Trailers end a body too (hyper's server polls no further).
        this.ended |= match &frame {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers(),
            _ => false,
        };
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(uri: &str) -> Result<Arc<Upstream>, BadUpstream> {
        Upstream::new(&uri.parse().unwrap())
    }

    #[test]
    fn an_upstream_must_be_http_with_a_host() {
        let error = |uri| upstream(uri).err().map(|e| e.to_string());
        assert_eq!(
            error("127.0.0.1:8080").as_deref(),
            Some("the upstream 127.0.0.1:8080 has no scheme: write http://127.0.0.1:8080")
        );
        assert!(
            error("https://example.com/")
                .unwrap()
                .contains("only http://")
        );
        assert!(error("/path").unwrap().contains("no scheme"));
        let v6 = upstream("http://[::1]:3000/base").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 3000));
        assert_eq!(v6.authority, "[::1]:3000");
        assert_eq!(v6.shown, "[::1]:3000");
        let named = upstream("http://user:secret@backend:80").unwrap();
        assert_eq!((named.host.as_str(), named.port), ("backend", 80));
        assert_eq!(named.authority, "backend");
    }
}
