//! The answers relayed: the upstream's head read and written again for
//! the client (its framing decided, the rate-limit fields added), its
//! body's end found as it passes, and the relay's own answers.

use std::mem::MaybeUninit;

use bytes::{Buf, BytesMut};

use crate::http::{
    headers::{Fields, write_field},
    proxy::{
        chunked::{ChunkedEnd, Malformed},
        hop_by_hop::HOP_BY_HOP,
    },
};

/// Header lines an answer may have (as hyper's client).
const MAX_ANSWER_FIELDS: usize = 100;

/// What answering a request needs to know of it.
pub struct Exchange<'a> {
    /// The rate-limit fields its answer gets.
    pub fields: &'a Fields,
    /// The client asked to close after this answer.
    pub close: bool,
    /// A HEAD: its answer has no body.
    pub head: bool,
    /// Safe to send twice (GET, HEAD).
    pub safe: bool,
}

impl Exchange<'_> {
    /// An answer of the proxy's own: `status` (code and reason), the
    /// rate-limit fields, and `text` (none to a HEAD).
    pub fn write_own(&self, out: &mut Vec<u8>, status: &str, text: &str) {
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

/// Once the answer head at the start of `answer` is all there: writes it
/// for the client in `out`, takes it from `answer`, and says how its body
/// follows (`None` until then). 1xx answers before it are dropped (none
/// was asked for: no request relayed here has `Expect`).
pub fn answer_head(
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
pub struct Framing {
    pub body: Body,
    /// The upstream may be asked again on this connection.
    pub reusable: bool,
    /// The client's connection closes after this answer.
    pub close_client: bool,
}

/// Where an answer's body ends.
pub enum Body {
    Length(u64),
    Chunked(ChunkedEnd),
    /// At the upstream's close (no length said).
    UntilClose,
}

impl Body {
    /// How many of `bytes` are the body's.
    pub fn advance(&mut self, bytes: &[u8]) -> Result<usize, Malformed> {
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

    pub fn done(&self) -> bool {
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
