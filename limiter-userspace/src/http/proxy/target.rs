//! The request target as the rules judge it and as the upstream gets it:
//! one and the same. A rule on `path: /login` must not be escaped by
//! `//login`, `/./login` or `/%6cogin`, which an upstream normalizing
//! paths (nginx does) serves as `/login`; nor a rule on `host:` by an
//! absolute target naming another host while `Host` names the real one.
//! So the proxy normalizes the path (RFC 3986: percent-encoded unreserved
//! characters decoded, dot segments removed; and runs of slashes merged,
//! as nginx's `merge_slashes`) and writes the target's authority into
//! `Host` before the limiter sees the request, and forwards that.

use std::borrow::Cow;

use http::{HeaderValue, Request, Uri, header};

use crate::rules::request::escape_at;

/// Makes `request`'s target canonical (see the module), and its fields
/// what the upstream will get: those the `Connection` field names go now,
/// not after the rules judged them.
pub fn canonicalize<B>(request: &mut Request<B>) {
    super::hop_by_hop::strip_connection_named(request.headers_mut());
    // An absolute target (or HTTP/2's `:authority`) says the host: the
    // limiter judges it, so the upstream must get it too.
    if let Some(authority) = request.uri().authority() {
        let host = authority
            .as_str()
            .rsplit_once('@')
            .map_or(authority.as_str(), |(_, host)| host);
        if let Ok(host) = HeaderValue::from_str(host) {
            request.headers_mut().insert(header::HOST, host);
        }
    }
    // The host as the rules judge it (`HttpRequest::host`), forwarded so.
    let canonical = request
        .headers()
        .get(header::HOST)
        .and_then(|host| canonical_host(host.to_str().ok()?))
        .and_then(|host| HeaderValue::from_str(&host).ok());
    if let Some(host) = canonical {
        request.headers_mut().insert(header::HOST, host);
    }
    if let Cow::Owned(path) = normalize_path(request.uri().path()) {
        let mut parts = request.uri().clone().into_parts();
        let path_and_query = match request.uri().query() {
            Some(query) => format!("{path}?{query}"),
            None => path,
        };
        // Made of the bytes of a path that parsed, less some: it parses.
        if let Ok(path_and_query) = path_and_query.parse() {
            parts.path_and_query = Some(path_and_query);
            if let Ok(uri) = Uri::from_parts(parts) {
                *request.uri_mut() = uri;
            }
        }
    }
}

/// A `Host` value in its canonical form (lowercase, one trailing dot of
/// the name dropped, the port kept), if that is not the value already.
fn canonical_host(value: &str) -> Option<String> {
    let (name, port) = match value.rsplit_once(':') {
        Some((name, port))
            if !name.contains(':')
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            (name, Some(port))
        }
        _ => (value, None),
    };
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let canonical = match port {
        Some(port) => format!("{name}:{port}"),
        None => name,
    };
    (canonical != value).then_some(canonical)
}

/// An HTTP/2 request's `cookie` fields (one per crumb, RFC 9113 8.2.3)
/// joined into one with "; ", as an HTTP/1.1 upstream reads them (many
/// read only the first line).
pub fn join_cookies(headers: &mut http::HeaderMap) {
    let mut crumbs = headers.get_all(header::COOKIE).iter();
    if crumbs.next().is_none() || crumbs.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    for crumb in headers.get_all(header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(crumb.as_bytes());
    }
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// `path` normalized (borrowed when already normal): `%XX` of an
/// unreserved character or of `/` decoded (other reserved ones kept,
/// their hex digits upper-cased), then runs of `/` merged, `.` and `..`
/// segments removed (never above the root): the path nginx routes.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let normal = !path.contains("//")
        && !path.contains('%')
        && !path
            .split('/')
            .any(|segment| segment == "." || segment == "..");
    if normal {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/').skip(1) {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    // A path that ended in a directory keeps its slash.
    let last = decoded.rsplit('/').next().unwrap_or("");
    if out.is_empty() || matches!(last, "" | "." | "..") {
        out.push('/');
    }
    if out == path {
        Cow::Borrowed(path)
    } else {
        Cow::Owned(out)
    }
}

/// `%XX` decoded where XX is an unreserved character (RFC 3986 2.3), or a
/// `/`: nginx decodes `%2F` before it merges slashes and removes dot
/// segments, so it serves `/%2Flogin` and `/x/..%2Flogin` as `/login`,
/// which a rule on `/login` must see too. Other escapes kept, upper-cased.
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        match escape_at(path, i) {
            Some(b) if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) => {
                out.push(char::from(b));
                i += 3;
            }
            Some(_) => {
                out.push('%');
                out.push_str(&path[i + 1..i + 3].to_ascii_uppercase());
                i += 3;
            }
            None => {
                let c = path[i..].chars().next().expect("in bounds");
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_forwarded_in_its_canonical_form() {
        assert_eq!(canonical_host("admin.example.com"), None);
        assert_eq!(
            canonical_host("Admin.Example.com.").as_deref(),
            Some("admin.example.com")
        );
        assert_eq!(
            canonical_host("ADMIN.example.com.:8443").as_deref(),
            Some("admin.example.com:8443")
        );
        assert_eq!(
            canonical_host("[2001:DB8::1]:80").as_deref(),
            Some("[2001:db8::1]:80")
        );
        let mut request = Request::builder()
            .uri("/")
            .header(header::HOST, "API.example.com.")
            .header("x-api-key", "k1")
            .header(header::CONNECTION, "x-api-key, keep-alive")
            .body(())
            .unwrap();
        canonicalize(&mut request);
        assert_eq!(request.headers()[header::HOST], "api.example.com");
        assert!(!request.headers().contains_key("x-api-key"));
    }

    #[test]
    fn paths_an_upstream_serves_alike_are_one_path() {
        for (path, normal) in [
            ("/login", "/login"),
            ("//login", "/login"),
            ("/./login", "/login"),
            ("/%6cogin", "/login"),
            ("/%6Cogin", "/login"),
            ("/a/../login", "/login"),
            ("/../../login", "/login"),
            ("/api//v1/", "/api/v1/"),
            ("/api/v1/.", "/api/v1/"),
            ("/api/v1/..", "/api/"),
            ("/", "/"),
            ("//", "/"),
            // Issue 35: nginx decodes `%2F` before it normalizes.
            ("/a%2Fb", "/a/b"),
            ("/a%2fb", "/a/b"),
            ("/%2Flogin", "/login"),
            ("/x/..%2Flogin", "/login"),
            ("/api%2Fusers", "/api/users"),
            ("/a%3Fb", "/a%3Fb"),
            ("/a%zz", "/a%zz"),
            ("/caf%C3%A9", "/caf%C3%A9"),
            ("/%7Euser", "/~user"),
        ] {
            assert_eq!(normalize_path(path), normal, "{path}");
        }
        assert!(matches!(normalize_path("/api/v1"), Cow::Borrowed(_)));
    }

    #[test]
    fn http2_cookie_crumbs_become_one_field() {
        let mut headers = http::HeaderMap::new();
        for crumb in ["a=1", "b=2", "c=3"] {
            headers.append(header::COOKIE, HeaderValue::from_static(crumb));
        }
        join_cookies(&mut headers);
        let all: Vec<_> = headers.get_all(header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; b=2; c=3"]);
        // One (or none): as it was.
        let mut one = http::HeaderMap::new();
        one.insert(header::COOKIE, HeaderValue::from_static("a=1"));
        join_cookies(&mut one);
        assert_eq!(one[header::COOKIE], "a=1");
    }

    #[test]
    fn the_targets_host_and_normal_path_are_forwarded() {
        let mut request = Request::get("http://api.example.com:8080/./login?x=1")
            .header(header::HOST, "other.example")
            .body(())
            .unwrap();
        canonicalize(&mut request);
        assert_eq!(request.headers()[header::HOST], "api.example.com:8080");
        assert_eq!(request.uri().path_and_query().unwrap(), "/login?x=1");
        // Origin form: Host stays.
        let mut request = Request::get("//login")
            .header(header::HOST, "api.example.com")
            .body(())
            .unwrap();
        canonicalize(&mut request);
        assert_eq!(request.headers()[header::HOST], "api.example.com");
        assert_eq!(request.uri().path(), "/login");
    }
}
