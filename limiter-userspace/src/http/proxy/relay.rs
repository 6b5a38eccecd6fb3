//! Cleartext HTTP/1.1 requests without a body (most requests), relayed by
//! the proxy itself: the head is read with httparse, judged by the same
//! layer as every other request, written to one of the worker's upstream
//! connections in one write, and the answer passed back as it comes, its
//! head and first bytes in one write. No task, channel or body object per
//! request: this is the path that carries the load, and it does what
//! nginx does for it.
//!
//! Anything else a connection brings (a body, an upgrade, `Expect`,
//! HTTP/1.0, a target not in origin form, a head httparse refuses or
//! that is too large) hands the connection, with the bytes already read,
//! to hyper and the proxy's full service for the rest of its life: they
//! answer it as before, 400 and 431 included.

use std::{
    future::Future, mem::MaybeUninit, net::SocketAddr, ops::Range, pin::Pin, sync::Arc,
    time::Duration,
};

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    time::Instant,
};

use super::{
    answers::{BAD_GATEWAY, log_unanswered},
    chunked::ChunkedEnd,
    forward::{X_FORWARDED_FOR, forwarded_for},
    hop_by_hop::{HOP_BY_HOP, strip_hop_by_hop},
    target,
    upstream::Upstream,
};
use crate::{
    http::{
        RateLimitLayer,
        headers::{Fields, write_field},
    },
    listen::{ConnectionError, Limits, Prefixed},
};

/// What relays requests for one worker.
pub struct Relay {
    pub layer: RateLimitLayer,
    pub upstream: Arc<Upstream>,
    /// The upstream's path, which requests' paths go under.
    pub base: Arc<str>,
    /// How long the upstream may take to answer, and pause within one.
    pub timeout: Duration,
}

/// Header lines a request relayed here may have (more: hyper's).
const MAX_REQUEST_FIELDS: usize = 64;
/// Header lines an answer may have (as hyper's client).
const MAX_ANSWER_FIELDS: usize = 100;
/// The largest answer head taken from the upstream.
const MAX_ANSWER_HEAD: usize = 65536;
/// Room made in a buffer before each read.
const READ_SIZE: usize = 8192;

impl Relay {
    /// Serves the client at `peer` on `client` until it closes, or hands
    /// the connection over (see the module).
    pub async fn serve<F, Fut>(
        &self,
        mut client: TcpStream,
        peer: SocketAddr,
        limits: Limits,
        hand_over: F,
    ) -> Result<(), ConnectionError>
    where
        F: FnOnce(Prefixed<TcpStream>) -> Fut,
        Fut: Future<Output = hyper::Result<()>>,
    {
        let forwarded_for = forwarded_for(peer);
        let mut read = BytesMut::with_capacity(READ_SIZE);
        let mut answer = BytesMut::with_capacity(READ_SIZE);
        // What is written: to the upstream, and to the client.
        let (mut request_bytes, mut out) = (Vec::with_capacity(1024), Vec::with_capacity(1024));
        // Positions in a head are kept as u32.
        let max_head = limits.max_header_bytes.min(u32::MAX as usize);
        let (mut head_deadline, mut answer_deadline) = (Deadline::new(), Deadline::new());
        let handed_over = 'relay: loop {
            // Sent (begun) before the last answer ended: pipelined.
            let pipelined = !read.is_empty();
            // Idle or mid-head, a client has the header timeout.
            head_deadline.set(limits.header_timeout);
            let (mut request, close) = loop {
                match parse_request(&read) {
                    Parsed::Complete(head) if head.len <= max_head => match head.take(&mut read) {
                        Ok(taken) => break taken,
                        Err(all) => break 'relay all,
                    },
                    Parsed::Partial if read.len() < max_head => {}
                    _ => break 'relay read,
                }
                read.reserve(READ_SIZE);
                match head_deadline.within(client.read_buf(&mut read)).await {
                    // Closed, or silent past the deadline.
                    Some(Ok(0)) | None => return Ok(()),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e.into()),
                }
            };
            // Judged as forwarded: one host, one path.
            target::canonicalize(&mut request);
            let verdict = self.layer.judge(&request, Some(peer));
            let exchange = Exchange {
                fields: &verdict.fields,
                close,
                head: request.method() == Method::HEAD,
                safe: request.method().is_safe(),
            };
            out.clear();
            if let Some(refusal) = &verdict.refusal {
                exchange.write_own(&mut out, "429 Too Many Requests", refusal);
                write_client(&mut client, &out, limits).await?;
                if close {
                    return Ok(());
                }
                continue;
            }
            // Counted in flight until its answer has been passed on.
            let _in_flight = verdict.admission.in_flight;
            strip_hop_by_hop(request.headers_mut());
            request
                .headers_mut()
                .append(X_FORWARDED_FOR, forwarded_for.clone());
            request_bytes.clear();
            write_request(&mut request_bytes, &request, &self.base);
            let delay = Duration::from_nanos(verdict.admission.delay_ns);
            let asked = async {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let deadline = &mut answer_deadline;
                self.ask(&exchange, &request_bytes, &mut out, &mut answer, deadline)
                    .await
            };
            // A client that leaves while it waits takes its request with it.
            let asked = tokio::select! {
                biased;
                asked = asked => asked,
                () = client_gone(&client, pipelined || !read.is_empty()) => return Ok(()),
            };
            match asked {
                Ok((upstream, framing)) => {
                    let open = self
                        .relay_body(
                            &mut client,
                            upstream,
                            framing,
                            &mut out,
                            &mut answer,
                            limits,
                        )
                        .await?;
                    if !open {
                        return Ok(());
                    }
                }
                Err(e) => {
                    log_unanswered(&e);
                    out.clear();
                    exchange.write_own(&mut out, "502 Bad Gateway", BAD_GATEWAY);
                    write_client(&mut client, &out, limits).await?;
                }
            }
            if close {
                return Ok(());
            }
        };
        drop((answer, out, request_bytes, head_deadline, answer_deadline));
        let io = Prefixed::new(handed_over.freeze(), client);
        hand_over(io).await.map_err(Into::into)
    }

    /// Passes the rest of an answer whose head is in `out` (its first
    /// bytes perhaps in `answer`) to the client; whether the client's
    /// connection stays open. The upstream connection is kept if it is
    /// between messages at the end.
    async fn relay_body(
        &self,
        client: &mut TcpStream,
        mut upstream: TcpStream,
        framing: Framing,
        out: &mut Vec<u8>,
        answer: &mut BytesMut,
        limits: Limits,
    ) -> Result<bool, ConnectionError> {
        let Framing {
            mut body,
            reusable,
            close_client,
        } = framing;
        loop {
            let take = body.advance(answer)?;
            out.extend_from_slice(&answer[..take]);
            answer.advance(take);
            if !out.is_empty() {
                write_client(client, out, limits).await?;
                out.clear();
            }
            if body.done() {
                break;
            }
            answer.reserve(READ_SIZE);
            match tokio::time::timeout(self.timeout, upstream.read_buf(answer)).await {
                Ok(Ok(0)) if matches!(body, Body::UntilClose) => break,
                Ok(Ok(0)) => return Err("the upstream's answer was cut short".into()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err("the upstream's answer stopped arriving".into()),
            }
        }
        // Anything after the answer was not asked for: not a connection to reuse.
        if reusable && answer.is_empty() && !matches!(body, Body::UntilClose) {
            self.upstream.give_back_stream(upstream);
        }
        answer.clear();
        Ok(!close_client)
    }

    /// Sends `request` and reads its answer's head (1xx answers skipped),
    /// written for the client in `out`, its bytes gone from `answer`: the
    /// connection, and how the body follows; all within the upstream
    /// timeout. A safe request (GET, HEAD) whose reused connection turns
    /// out closed before a byte of answer goes again on a new one, once.
    async fn ask(
        &self,
        exchange: &Exchange<'_>,
        request: &[u8],
        out: &mut Vec<u8>,
        answer: &mut BytesMut,
        deadline: &mut Deadline,
    ) -> anyhow::Result<(TcpStream, Framing)> {
        use anyhow::{Context, bail};
        deadline.set(self.timeout);
        let late = "the upstream did not answer in time";
        let mut first = true;
        loop {
            answer.clear();
            let connection = if first {
                deadline.within(self.upstream.stream()).await
            } else {
                let connecting = self.upstream.connect_stream();
                deadline
                    .within(async { Ok((connecting.await?, false)) })
                    .await
            };
            let (mut upstream, reused) = connection.context(late)??;
            let may_retry = reused && first && exchange.safe;
            first = false;
            match deadline.within(write_all(&mut upstream, request)).await {
                Some(Ok(())) => {}
                Some(Err(_)) if may_retry => continue,
                Some(Err(e)) => return Err(e).context("sending the request to the upstream"),
                None => bail!("the upstream did not take the request in time"),
            }
            let mut heard = false;
            loop {
                match answer_head(answer, out, exchange)? {
                    Some(framing) => return Ok((upstream, framing)),
                    None if answer.len() >= MAX_ANSWER_HEAD => {
                        bail!("the upstream's answer head is too large")
                    }
                    None => {}
                }
                answer.reserve(READ_SIZE);
                match deadline.within(upstream.read_buf(answer)).await {
                    Some(Ok(n)) if n > 0 => heard = true,
                    Some(_) if may_retry && !heard => break,
                    Some(Ok(_)) => bail!("the upstream closed the connection without answering"),
                    Some(Err(e)) => return Err(e).context("reading the upstream's answer"),
                    None => bail!(late),
                }
            }
        }
    }
}

/// A deadline moved at every request and seldom reached: moving it later
/// is a store, and the timer under it is re-armed only when it goes off
/// early (once a timeout's length, not once a request: arming a timer
/// for each request and disarming it was a tenth of the relay's time).
struct Deadline {
    due: Instant,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Deadline {
    fn new() -> Self {
        Self {
            due: Instant::now(),
            timer: None,
        }
    }

    /// Puts it `after` from now (far off for a duration too long to add).
    fn set(&mut self, after: Duration) {
        let now = Instant::now();
        self.due = now
            .checked_add(after)
            .unwrap_or_else(|| now + Duration::from_secs(1 << 30));
        match &mut self.timer {
            Some(timer) if timer.deadline() <= self.due => {}
            Some(timer) => timer.as_mut().reset(self.due),
            None => self.timer = Some(Box::pin(tokio::time::sleep_until(self.due))),
        }
    }

    /// `work`'s output, or `None` if the deadline passes first (never set:
    /// no deadline).
    async fn within<F: Future>(&mut self, work: F) -> Option<F::Output> {
        let due = self.due;
        let Some(timer) = self.timer.as_mut() else {
            return Some(work.await);
        };
        let passed = async {
            loop {
                timer.as_mut().await;
                if Instant::now() >= due {
                    return;
                }
                timer.as_mut().reset(due);
            }
        };
        tokio::select! {
            biased;
            out = work => Some(out),
            () = passed => None,
        }
    }
}

/// Writes all of `bytes`, trying at once first (a small message almost
/// always goes whole, and then no future waits on the socket).
async fn write_all(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let sent = write_now(stream, bytes)?;
    if sent < bytes.len() {
        stream.write_all(&bytes[sent..]).await?;
    }
    Ok(())
}

/// As much of `bytes` as the socket takes now.
fn write_now(stream: &TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    match stream.try_write(bytes) {
        Ok(n) => Ok(n),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// Ends when the client closes its connection (or it fails) while its
/// request waits; never for a pipelined request, one sent with others
/// before their answers (a half close may well follow a pipeline: the
/// client has said all it will, and waits for every answer, the last
/// included). A client that half-closes after a request it sent alone is
/// taken to have left, as hyper and nginx take it.
async fn client_gone(client: &TcpStream, pipelined: bool) {
    if !pipelined && matches!(client.peek(&mut [0u8; 1]).await, Ok(0) | Err(_)) {
        return;
    }
    std::future::pending().await
}

/// Writes the `Date` field (RFC 9110 6.6.1), its value formatted once a
/// second per thread.
fn write_date(out: &mut Vec<u8>) {
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static DATE: std::cell::RefCell<(u64, String)> = const {
            std::cell::RefCell::new((0, String::new()))
        };
    }
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, date)| {
        if *at != second || date.is_empty() {
            *date = httpdate::fmt_http_date(now);
            *at = second;
        }
        write_field(out, b"date", date.as_bytes());
    });
}

/// What answering a request needs to know of it.
struct Exchange<'a> {
    /// The rate-limit fields its answer gets.
    fields: &'a Fields,
    /// The client asked to close after this answer.
    close: bool,
    /// A HEAD: its answer has no body.
    head: bool,
    /// Safe to send twice (GET, HEAD).
    safe: bool,
}

impl Exchange<'_> {
    /// An answer of the proxy's own: `status` (code and reason), the
    /// rate-limit fields, and `text` (none to a HEAD).
    fn write_own(&self, out: &mut Vec<u8>, status: &str, text: &str) {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_bytes());
        out.extend_from_slice(b"\r\ncontent-type: text/plain\r\n");
        let mut length = itoa::Buffer::new();
        write_field(out, b"content-length", length.format(text.len()).as_bytes());
        write_date(out);
        self.fields.write_to(out);
        if self.close {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !self.head {
            out.extend_from_slice(text.as_bytes());
        }
    }
}

/// Writes all of `bytes` to the client, which must read them within the
/// write timeout.
async fn write_client(
    client: &mut TcpStream,
    bytes: &[u8],
    limits: Limits,
) -> Result<(), ConnectionError> {
    // All of it at once, as an answer almost always goes: no timer.
    let sent = write_now(client, bytes)?;
    if sent == bytes.len() {
        return Ok(());
    }
    let rest = &bytes[sent..];
    match tokio::time::timeout(limits.write_timeout, client.write_all(rest)).await {
        Ok(written) => Ok(written?),
        Err(_) => Err("the client stopped reading".into()),
    }
}

/// Where a part of a head is in its bytes: start and end (a head is at
/// most `max_header_bytes` long).
#[derive(Clone, Copy, Default)]
struct Span(u32, u32);

impl Span {
    fn range(self) -> Range<usize> {
        self.0 as usize..self.1 as usize
    }
}

/// A request head, by where its parts are in the bytes read.
struct Head {
    len: usize,
    method: Span,
    target: Span,
    fields: [(Span, Span); MAX_REQUEST_FIELDS],
    count: usize,
    /// `Connection: close`.
    close: bool,
}

// On the stack, once per request: boxed, it would be an allocation each.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    Complete(Head),
    Partial,
    /// Not a request relayed here: hyper's.
    Elsewhere,
}

/// The request head at the start of `buf`, if it is one relayed here: an
/// HTTP/1.1 request in origin form with one `Host` and no body, that asks
/// for no upgrade or `Expect`, and whose `Connection` names no field.
fn parse_request(buf: &[u8]) -> Parsed {
    let mut fields = [const { MaybeUninit::uninit() }; MAX_REQUEST_FIELDS];
    let mut request = httparse::Request::new(&mut []);
    let len = match request.parse_with_uninit_headers(buf, &mut fields) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Elsewhere,
    };
    let (Some(method), Some(target), Some(1)) = (request.method, request.path, request.version)
    else {
        return Parsed::Elsewhere;
    };
    if method == "CONNECT" || !target.starts_with('/') {
        return Parsed::Elsewhere;
    }
    let (mut close, mut hosts) = (false, 0);
    for field in request.headers.iter() {
        let (name, value) = (field.name.as_bytes(), field.value);
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        if is(b"host") {
            hosts += 1;
        } else if is(b"content-length") {
            if value.trim_ascii() != b"0" {
                return Parsed::Elsewhere;
            }
        } else if is(b"transfer-encoding") || is(b"upgrade") || is(b"expect") {
            return Parsed::Elsewhere;
        } else if is(b"connection") {
            for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"keep-alive") {
                    return Parsed::Elsewhere;
                }
            }
        }
    }
    if hosts != 1 {
        return Parsed::Elsewhere;
    }
    let start = buf.as_ptr() as usize;
    let at = |part: &[u8]| {
        let from = part.as_ptr() as usize - start;
        Span(from as u32, (from + part.len()) as u32)
    };
    let mut head = Head {
        len,
        method: at(method.as_bytes()),
        target: at(target.as_bytes()),
        fields: [(Span::default(), Span::default()); MAX_REQUEST_FIELDS],
        count: request.headers.len(),
        close,
    };
    for (slot, field) in head.fields.iter_mut().zip(request.headers.iter()) {
        *slot = (at(field.name.as_bytes()), at(field.value));
    }
    Parsed::Complete(head)
}

impl Head {
    /// Takes the head from `read`: the request, and whether the client
    /// asked to close after it; or, if the `http` types refuse a part
    /// httparse took, all that was read, for hyper.
    fn take(self, read: &mut BytesMut) -> Result<(Request<()>, bool), BytesMut> {
        let bytes = read.split_to(self.len).freeze();
        match self.request(&bytes) {
            Some(request) => Ok((request, self.close)),
            None => {
                let mut all = BytesMut::from(&bytes[..]);
                all.extend_from_slice(read);
                Err(all)
            }
        }
    }

    /// The request, its target and values shared with `bytes` (the head's
    /// bytes); `None` if the `http` types refuse a part httparse took.
    fn request(&self, bytes: &Bytes) -> Option<Request<()>> {
        let mut request = Request::new(());
        *request.method_mut() = Method::from_bytes(&bytes[self.method.range()]).ok()?;
        *request.uri_mut() = Uri::from_maybe_shared(bytes.slice(self.target.range())).ok()?;
        let headers = request.headers_mut();
        headers.reserve(self.count);
        for (name, value) in &self.fields[..self.count] {
            let name = HeaderName::from_bytes(&bytes[name.range()]).ok()?;
            let value = HeaderValue::from_maybe_shared(bytes.slice(value.range())).ok()?;
            headers.append(name, value);
        }
        Some(request)
    }
}

/// Writes the request for the upstream: its target under `base`.
fn write_request(out: &mut Vec<u8>, request: &Request<()>, base: &str) {
    out.extend_from_slice(request.method().as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(base.as_bytes());
    let target = request.uri().path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in request.headers() {
        write_field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// Once the answer head at the start of `answer` is all there: writes it
/// for the client in `out`, takes it from `answer`, and says how its body
/// follows (`None` until then). 1xx answers before it are dropped (none
/// was asked for: no request relayed here has `Expect`).
fn answer_head(
    answer: &mut BytesMut,
    out: &mut Vec<u8>,
    exchange: &Exchange<'_>,
) -> anyhow::Result<Option<Framing>> {
    loop {
        let mut fields = [const { MaybeUninit::uninit() }; MAX_ANSWER_FIELDS];
        let mut parsed = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            answer,
            &mut fields,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => anyhow::bail!("the upstream's answer head is malformed: {e}"),
        };
        match parsed.code {
            Some(101) => anyhow::bail!("the upstream switched protocols unasked"),
            Some(100..=199) => answer.advance(len),
            _ => {
                let framing = write_answer_head(out, &parsed, exchange)?;
                answer.advance(len);
                return Ok(Some(framing));
            }
        }
    }
}

/// How an answer's body is passed on, and what follows it.
struct Framing {
    body: Body,
    /// The upstream may be asked again on this connection.
    reusable: bool,
    /// The client's connection closes after this answer.
    close_client: bool,
}

/// Where an answer's body ends.
enum Body {
    Length(u64),
    Chunked(ChunkedEnd),
    /// At the upstream's close (no length said).
    UntilClose,
}

impl Body {
    /// How many of `bytes` are the body's.
    fn advance(&mut self, bytes: &[u8]) -> Result<usize, super::chunked::Malformed> {
        Ok(match self {
            Self::Length(left) => {
                let n = usize::try_from(*left).map_or(bytes.len(), |left| left.min(bytes.len()));
                *left -= n as u64;
                n
            }
            Self::Chunked(end) => end.advance(bytes)?,
            Self::UntilClose => bytes.len(),
        })
    }

    fn done(&self) -> bool {
        match self {
            Self::Length(left) => *left == 0,
            Self::Chunked(end) => end.done(),
            Self::UntilClose => false,
        }
    }
}

/// Writes the client's head of the upstream's answer `parsed`: its status
/// and fields less the hop-by-hop ones and those the rate-limit fields
/// replace, with those; and says how its body is framed (RFC 9112 6.3).
fn write_answer_head(
    out: &mut Vec<u8>,
    parsed: &httparse::Response<'_, '_>,
    exchange: &Exchange<'_>,
) -> anyhow::Result<Framing> {
    let code = parsed.code.unwrap_or(502);
    let mut length: Option<u64> = None;
    let (mut chunked, mut encoded, mut dated) = (false, false, false);
    let mut upstream_close = parsed.version != Some(1);
    for field in parsed.headers.iter() {
        let name = field.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            // Digits only, and all the same (as hyper's client reads it).
            for value in field.value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                let n = (!value.is_empty() && value.iter().all(u8::is_ascii_digit))
                    .then(|| std::str::from_utf8(value).ok()?.parse::<u64>().ok())
                    .flatten()
                    .filter(|n| length.is_none_or(|l| l == *n))
                    .ok_or_else(|| anyhow::anyhow!("the upstream's Content-Length is malformed"))?;
                length = Some(n);
            }
        } else if name.eq_ignore_ascii_case(b"date") {
            dated = true;
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            encoded = true;
            chunked = field
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case(b"connection") {
            upstream_close |= tokens(field.value).any(|t| t.eq_ignore_ascii_case(b"close"));
        }
    }
    if encoded && parsed.version != Some(1) {
        anyhow::bail!("the upstream's HTTP/1.0 answer has Transfer-Encoding");
    }
    // Framed two ways: this answer is read as chunked, but what follows it
    // on the connection cannot be trusted.
    upstream_close |= encoded && length.is_some();
    let no_body = exchange.head || matches!(code, 100..=199 | 204 | 304);
    let body = if no_body {
        Body::Length(0)
    } else if encoded {
        // Transfer-Encoding overrides Content-Length (which is dropped).
        if chunked {
            Body::Chunked(ChunkedEnd::default())
        } else {
            Body::UntilClose
        }
    } else {
        length.map_or(Body::UntilClose, Body::Length)
    };
    let close_client = exchange.close || matches!(body, Body::UntilClose);
    out.extend_from_slice(b"HTTP/1.1 ");
    let mut status = itoa::Buffer::new();
    out.extend_from_slice(status.format(code).as_bytes());
    out.push(b' ');
    out.extend_from_slice(parsed.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for field in parsed.headers.iter() {
        let name = field.name.as_bytes();
        let passed = if name.eq_ignore_ascii_case(b"transfer-encoding") {
            chunked && !no_body
        } else if name.eq_ignore_ascii_case(b"content-length") {
            false
        } else {
            !HOP_BY_HOP
                .iter()
                .any(|h| h.as_str().as_bytes().eq_ignore_ascii_case(name))
                && !named_in_connection(parsed.headers, name)
                && !exchange.fields.sets(name)
        };
        if passed {
            write_field(out, name, field.value);
        }
    }
    // One length, as read (where it still says how the body is framed).
    if let Some(length) = length.filter(|_| !encoded || no_body) {
        let mut digits = itoa::Buffer::new();
        write_field(out, b"content-length", digits.format(length).as_bytes());
    }
    if !dated {
        write_date(out);
    }
    exchange.fields.write_to(out);
    if close_client {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(Framing {
        body,
        reusable: !upstream_close,
        close_client,
    })
}

/// The comma-separated tokens of a field value.
fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a `Connection` field of `fields` names `name`.
fn named_in_connection(fields: &[httparse::Header<'_>], name: &[u8]) -> bool {
    fields
        .iter()
        .filter(|f| f.name.eq_ignore_ascii_case("connection"))
        .any(|f| tokens(f.value).any(|t| t.eq_ignore_ascii_case(name)))
}
