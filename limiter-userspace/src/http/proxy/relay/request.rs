//! The requests relayed here: their heads read with httparse (only those
//! the relay can take whole), made into `http` requests sharing the bytes
//! read, and written for the upstream.

use std::{mem::MaybeUninit, ops::Range};

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Request, Uri};

use crate::http::headers::write_field;

/// Header lines a request relayed here may have (more: hyper's).
const MAX_REQUEST_FIELDS: usize = 64;

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
pub struct Head {
    pub len: usize,
    method: Span,
    target: Span,
    fields: [(Span, Span); MAX_REQUEST_FIELDS],
    count: usize,
    /// `Connection: close`.
    close: bool,
}

// On the stack, once per request: boxed, it would be an allocation each.
#[allow(clippy::large_enum_variant)]
pub enum Parsed {
    Complete(Head),
    Partial,
    /// Not a request relayed here: hyper's.
    Elsewhere,
}

/// The request head at the start of `buf`, if it is one relayed here: an
/// HTTP/1.1 request in origin form with one `Host` and no body, that asks
/// for no upgrade or `Expect`, and whose `Connection` names no field.
pub fn parse_request(buf: &[u8]) -> Parsed {
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
    pub fn take(self, read: &mut BytesMut) -> Result<(Request<()>, bool), BytesMut> {
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
pub fn write_request(out: &mut Vec<u8>, request: &Request<()>, base: &str) {
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
