//! The proxy's own answers: requests refused before the limiter sees them,
//! bodies cut short, and the 502 for an upstream that did not answer.

use axum::body::Body;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::upload::Cut;

/// Requests refused before the limiter sees them (and charged nothing):
/// CONNECT, which would make this a tunnel to anywhere, and bodies that
/// say they are over the cap.
pub fn screen(request: &Request<Incoming>, max_body_bytes: u64) -> Option<Response<Body>> {
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

pub fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::from(text));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

pub fn too_large(max: u64) -> Response<Body> {
    let mut response = Response::new(Body::from(format!(
        "413 Content Too Large: request bodies are limited to {max} bytes\n"
    )));
    *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The answer to a request whose body the proxy stopped reading.
pub fn cut_short(cut: Cut, max_body_bytes: u64) -> Response<Body> {
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
pub const BAD_GATEWAY: &str = "502 Bad Gateway\n";

/// A 502 that tells the client nothing about the upstream (the log does).
pub fn bad_gateway(error: anyhow::Error) -> Response<Body> {
    log_unanswered(&error);
    plain(StatusCode::BAD_GATEWAY, BAD_GATEWAY)
}

/// Says in the log why the upstream did not answer.
pub fn log_unanswered(error: &anyhow::Error) {
    tracing::warn!("upstream: {error:#}");
}
