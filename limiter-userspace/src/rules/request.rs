//! Layer-7 rules: what a rule may ask of an HTTP request besides its
//! addresses (method, host, path, headers) and what else its key may be
//! made of (a header's value, the path, the method, the host). The kernel
//! sees packets, not requests: it refuses rules that use any of this
//! ([`super::RuleSet::kernel_compatible`]).

use std::borrow::Cow;

use http::{HeaderMap, HeaderName, Method, Uri};

use super::{
    invalid::{InvalidField, invalid},
    raw,
};
use crate::yaml::quoted;

/// A request as layer 7 sees it, besides its addresses.
#[derive(Clone, Copy, Debug)]
pub struct HttpRequest<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
}

impl<'a> HttpRequest<'a> {
    /// The host the request is for, without its port: the URI's authority
    /// (HTTP/2's `:authority`, an absolute-form target) or else `Host`;
    /// one trailing dot dropped (`admin.example.com.` is the same name,
    /// and nginx routes it so). Its case is the client's: compare it
    /// without case, and key it as [`KeyPart::Host`] does, lowercased.
    pub fn host(&self) -> Option<&'a str> {
        let authority = match self.uri.authority() {
            Some(authority) => authority.as_str(),
            None => self.headers.get(http::header::HOST)?.to_str().ok()?,
        };
        let host = strip_port(authority);
        Some(host.strip_suffix('.').unwrap_or(host))
    }

    /// [`HttpRequest::host`] lowercased: the form rules name hosts in, and
    /// keys and traces carry (borrowed when already lowercase).
    pub fn canonical_host(&self) -> Option<Cow<'a, str>> {
        self.host().map(|host| {
            if host.bytes().any(|b| b.is_ascii_uppercase()) {
                Cow::Owned(host.to_ascii_lowercase())
            } else {
                Cow::Borrowed(host)
            }
        })
    }

    /// The path as nginx routes it (its `$uri`): every `%XX` decoded. The
    /// proxy normalizes what it forwards first (`target::canonicalize`),
    /// so this is the path the upstream serves.
    pub fn path(&self) -> Cow<'a, str> {
        percent_decoded(self.uri.path())
    }
}

/// `path` with every `%XX` decoded (a malformed escape kept as it is;
/// bytes that are not UTF-8 replaced): borrowed when it has none.
pub fn percent_decoded(path: &str) -> Cow<'_, str> {
    if !path.contains('%') {
        return Cow::Borrowed(path);
    }
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match escape_at(path, i) {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// The byte a `%XX` escape at `i` of `s` stands for; `None` when there
/// is none there (another character, or `%` not followed by two hex digits).
pub(crate) fn escape_at(s: &str, i: usize) -> Option<u8> {
    (s.as_bytes().get(i) == Some(&b'%'))
        .then(|| s.get(i + 1..i + 3))
        .flatten()
        .and_then(|hex| u8::from_str_radix(hex, 16).ok())
}

/// `host:port` or `[v6]:port` without the port.
fn strip_port(authority: &str) -> &str {
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if authority.starts_with('[') {
        return authority.split_inclusive(']').next().unwrap_or(authority);
    }
    authority.split(':').next().unwrap_or(authority)
}

/// What a rule asks of a request at layer 7; empty: nothing (every rule
/// the kernel can enforce).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RequestMatch {
    /// Any of these; empty: any method.
    pub methods: Vec<Method>,
    /// Lowercase, without a port.
    pub host: Option<String>,
    pub path: Option<PathMatch>,
    /// Every one must hold.
    pub headers: Vec<HeaderMatch>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HeaderMatch {
    pub name: HeaderName,
    pub condition: HeaderCondition,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HeaderCondition {
    /// One of the field's values is exactly this.
    Equals(String),
    Present,
    Absent,
}

impl RequestMatch {
    pub fn is_empty(&self) -> bool {
        self.conditions() == 0
    }

    /// How many conditions: more is more specific, and tried first.
    pub fn conditions(&self) -> usize {
        usize::from(!self.methods.is_empty())
            + usize::from(self.host.is_some())
            + usize::from(self.path.is_some())
            + self.headers.len()
    }

    /// The first field that only layer 7 can check, for error messages.
    pub fn first_field(&self) -> Option<&'static str> {
        [
            (!self.methods.is_empty(), "match.method"),
            (self.host.is_some(), "match.host"),
            (matches!(self.path, Some(PathMatch::Exact(_))), "match.path"),
            (
                matches!(self.path, Some(PathMatch::Prefix(_))),
                "match.path_prefix",
            ),
            (!self.headers.is_empty(), "match.headers"),
        ]
        .into_iter()
        .find_map(|(set, field)| set.then_some(field))
    }

    /// Whether `request` meets every condition; a request layer 7 knows
    /// nothing of (`None`) meets none.
    pub fn matches(&self, request: Option<&HttpRequest<'_>>) -> bool {
        if self.is_empty() {
            return true;
        }
        let Some(request) = request else {
            return false;
        };
        (self.methods.is_empty() || self.methods.contains(request.method))
            && self
                .host
                .as_deref()
                .is_none_or(|host| request.host().is_some_and(|h| h.eq_ignore_ascii_case(host)))
            && self.path.as_ref().is_none_or(|path| match path {
                PathMatch::Exact(p) => request.path() == p.as_str(),
                PathMatch::Prefix(p) => request.path().starts_with(p.as_str()),
            })
            && self.headers.iter().all(|h| {
                let mut values = request.headers.get_all(&h.name).iter();
                match &h.condition {
                    HeaderCondition::Equals(v) => values.any(|x| x.as_bytes() == v.as_bytes()),
                    HeaderCondition::Present => values.next().is_some(),
                    HeaderCondition::Absent => values.next().is_none(),
                }
            })
    }
}

/// One part of a rule's key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// The source address, masked to the rule's key prefix.
    Source,
    /// A header's value (its first); a request without it is not one
    /// the rule applies to.
    Header(HeaderName),
    Path,
    Method,
    Host,
}

impl KeyPart {
    /// The part's name in the rule file.
    pub fn name(&self) -> String {
        match self {
            Self::Source => "source".into(),
            Self::Header(name) => format!("header:{name}"),
            Self::Path => "path".into(),
            Self::Method => "method".into(),
            Self::Host => "host".into(),
        }
    }

    /// The bytes this part contributes to `request`'s key; `None` when the
    /// request has no such part (no such header, or not a request at all).
    /// [`KeyPart::Source`] is the caller's. The host in its canonical form
    /// (lowercase, no trailing dot): each spelling of a spent host was a
    /// fresh key.
    pub fn of<'a>(&self, request: Option<&HttpRequest<'a>>) -> Option<Cow<'a, [u8]>> {
        let request = request?;
        match self {
            Self::Source => None,
            Self::Header(name) => request
                .headers
                .get(name)
                .map(|v| Cow::Borrowed(v.as_bytes())),
            Self::Path => Some(match request.path() {
                Cow::Borrowed(path) => Cow::Borrowed(path.as_bytes()),
                Cow::Owned(path) => Cow::Owned(path.into_bytes()),
            }),
            Self::Method => Some(Cow::Borrowed(request.method.as_str().as_bytes())),
            Self::Host => request.canonical_host().map(|host| match host {
                Cow::Borrowed(host) => Cow::Borrowed(host.as_bytes()),
                Cow::Owned(host) => Cow::Owned(host.into_bytes()),
            }),
        }
    }
}

/// Whether a rule keyed by `parts` can key `request`: every header it is
/// keyed by is there (envoy's descriptors skip a request without one).
pub fn keyable(parts: &[KeyPart], request: Option<&HttpRequest<'_>>) -> bool {
    parts
        .iter()
        .all(|p| *p == KeyPart::Source || p.of(request).is_some())
}

/// The layer-7 fields of a rule's `match`.
pub(super) fn request_match(fields: &raw::MatchFields) -> Result<RequestMatch, InvalidField> {
    let methods = match &fields.method {
        None => Vec::new(),
        Some(raw::Strings(list)) if list.is_empty() => {
            return Err(invalid("match.method", "an empty list matches nothing"));
        }
        Some(raw::Strings(list)) => list
            .iter()
            .map(|m| {
                let upper = m.to_ascii_uppercase();
                Method::from_bytes(upper.as_bytes())
                    .map_err(|_| invalid("match.method", format!("{}: not a method", quoted(m))))
            })
            .collect::<Result<_, _>>()?,
    };
    let host = fields
        .host
        .as_deref()
        .map(|h| {
            let valid = !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b))
                && strip_port(h) == h;
            if valid {
                // The canonical form requests are judged in (`HttpRequest::host`).
                Ok(h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase())
            } else {
                Err(invalid(
                    "match.host",
                    format!("{}: expected a host name without a port", quoted(h)),
                ))
            }
        })
        .transpose()?;
    let path = match (&fields.path, &fields.path_prefix) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "match.path_prefix",
                "give `path` (exact) or `path_prefix`, not both",
            ));
        }
        (Some(p), None) => Some(PathMatch::Exact(path_field(p, "match.path")?)),
        (None, Some(p)) => Some(PathMatch::Prefix(path_field(p, "match.path_prefix")?)),
        (None, None) => None,
    };
    let headers = fields
        .headers
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, h)| header_match(h).map_err(|e| e.within(|f| format!("match.headers[{i}].{f}"))))
        .collect::<Result<_, _>>()?;
    Ok(RequestMatch {
        methods,
        host,
        path,
        headers,
    })
}

fn path_field(path: &str, field: &str) -> Result<String, InvalidField> {
    if !path.starts_with('/') || path.contains(['?', '#']) {
        return Err(invalid(
            field,
            format!(
                "{}: expected a path starting with / (without a query)",
                quoted(path)
            ),
        ));
    }
    Ok(path.to_owned())
}

fn header_match(fields: &raw::HeaderFields) -> Result<HeaderMatch, InvalidField> {
    let name = header_name(&fields.name).map_err(|m| invalid("name", m))?;
    let condition = match (&fields.equals, fields.present) {
        (Some(_), Some(_)) => {
            return Err(invalid("present", "give `equals` or `present`, not both"));
        }
        (Some(value), None) => {
            http::HeaderValue::from_str(value).map_err(|_| {
                invalid(
                    "equals",
                    format!("{}: not a valid header value", quoted(value)),
                )
            })?;
            HeaderCondition::Equals(value.clone())
        }
        (None, Some(false)) => HeaderCondition::Absent,
        (None, Some(true) | None) => HeaderCondition::Present,
    };
    Ok(HeaderMatch { name, condition })
}

fn header_name(name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{}: not a header name", quoted(name)))
}

/// The most parts a key may have.
pub const MAX_KEY_PARTS: usize = 6;

/// A rule's key: `source`, `source/N` (the prefix is the caller's to
/// parse), `header:NAME`, `path`, `method`, `host`, each at most once; or
/// `all` alone (no parts: one bucket for every request the rule matches,
/// as envoy counts a descriptor whose every value is given).
/// Returns the parts and the source part's text, if any.
pub(super) fn key_parts(key: &[String]) -> Result<(Vec<KeyPart>, Option<&str>), String> {
    if key.is_empty() {
        return Err("an empty key: give `source` or a list of parts".into());
    }
    if key.len() > MAX_KEY_PARTS {
        return Err(format!(
            "{} parts; a key has at most {MAX_KEY_PARTS}",
            key.len()
        ));
    }
    if key.iter().any(|k| k == "all") {
        if key.len() > 1 {
            return Err(
                "`all` (one bucket for every request the rule matches) stands alone".into(),
            );
        }
        return Ok((Vec::new(), None));
    }
    let mut parts = Vec::with_capacity(key.len());
    let mut source = None;
    for text in key {
        let part = match text.as_str() {
            "path" => KeyPart::Path,
            "method" => KeyPart::Method,
            "host" => KeyPart::Host,
            s if s == "source" || s.starts_with("source/") => {
                source = Some(s);
                KeyPart::Source
            }
            s => match s.strip_prefix("header:") {
                Some(name) => KeyPart::Header(header_name(name)?),
                None => {
                    return Err(format!(
                        "{}: expected source, source/N, header:NAME, path, method, host or all",
                        quoted(s)
                    ));
                }
            },
        };
        if parts.contains(&part) {
            return Err(format!("{}: named twice", part.name()));
        }
        parts.push(part);
    }
    Ok((parts, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35: a spent host spelled with a trailing dot, or in another
    /// case, was a fresh key and escaped a host match. Both match, and key
    /// as, the canonical form (lowercase, no trailing dot).
    #[test]
    fn a_host_is_judged_and_keyed_in_its_canonical_form() {
        let fields = raw::MatchFields {
            host: Some("Admin.Example.com.".into()),
            ..raw::MatchFields::default()
        };
        let rule = request_match(&fields).unwrap();
        assert_eq!(rule.host.as_deref(), Some("admin.example.com"));
        let headers = |host: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::HOST, host.parse().unwrap());
            h
        };
        let (get, root) = (Method::GET, Uri::from_static("/"));
        let mut keys = Vec::new();
        for spelling in [
            "admin.example.com",
            "admin.example.com.",
            "ADMIN.example.COM",
            "Admin.Example.Com.:443",
        ] {
            let h = headers(spelling);
            let request = HttpRequest {
                method: &get,
                uri: &root,
                headers: &h,
            };
            assert!(rule.matches(Some(&request)), "{spelling}");
            keys.push(KeyPart::Host.of(Some(&request)).unwrap().into_owned());
        }
        assert!(keys.iter().all(|k| k == b"admin.example.com"), "{keys:?}");
        // Absolute-form (and HTTP/2's `:authority`) too.
        let absolute = Uri::from_static("http://ADMIN.example.com./x");
        let none = HeaderMap::new();
        let request = HttpRequest {
            method: &get,
            uri: &absolute,
            headers: &none,
        };
        assert!(rule.matches(Some(&request)));
        // One dot only: `example.com..` is not `example.com`.
        let h = headers("admin.example.com..");
        let request = HttpRequest {
            method: &get,
            uri: &root,
            headers: &h,
        };
        assert!(!rule.matches(Some(&request)));
    }

    fn request(method: &str, uri: &str, headers: &[(&str, &str)]) -> (Method, Uri, HeaderMap) {
        (
            method.parse().unwrap(),
            uri.parse().unwrap(),
            crate::http::test_headers(headers),
        )
    }

    #[test]
    fn a_request_match_checks_every_field_it_names() {
        let rule = RequestMatch {
            methods: vec![Method::POST, Method::PUT],
            host: Some("api.example.com".into()),
            path: Some(PathMatch::Prefix("/v1/".into())),
            headers: vec![
                HeaderMatch {
                    name: HeaderName::from_static("x-tier"),
                    condition: HeaderCondition::Equals("free".into()),
                },
                HeaderMatch {
                    name: HeaderName::from_static("x-debug"),
                    condition: HeaderCondition::Absent,
                },
            ],
        };
        let check = |(m, u, h): &(Method, Uri, HeaderMap)| {
            rule.matches(Some(&HttpRequest {
                method: m,
                uri: u,
                headers: h,
            }))
        };
        let host = ("host", "API.example.com:8443");
        let tier = ("x-tier", "free");
        assert!(check(&request("POST", "/v1/login?x=1", &[host, tier])));
        assert!(check(&request(
            "PUT",
            "http://api.example.com/v1/",
            &[tier, ("x-tier", "paid")]
        )));
        assert!(!check(&request("GET", "/v1/login", &[host, tier])));
        assert!(!check(&request("POST", "/v2/login", &[host, tier])));
        assert!(!check(&request(
            "POST",
            "/v1/login",
            &[("host", "example.com"), tier]
        )));
        assert!(!check(&request(
            "POST",
            "/v1/login",
            &[host, ("x-tier", "paid")]
        )));
        assert!(!check(&request(
            "POST",
            "/v1/login",
            &[host, tier, ("x-debug", "1")]
        )));
        assert!(!rule.matches(None), "a packet is not a request");
        assert!(RequestMatch::default().matches(None));
    }

    #[test]
    fn key_parts_are_read_once_each() {
        let owned = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let parts = |k: &[&str]| key_parts(&owned(k)).map(|(p, _)| p);
        let given = owned(&["source/24", "path", "header:X-Api-Key"]);
        let (p, source) = key_parts(&given).unwrap();
        assert_eq!(
            p,
            [
                KeyPart::Source,
                KeyPart::Path,
                KeyPart::Header(HeaderName::from_static("x-api-key"))
            ]
        );
        assert_eq!(source, Some("source/24"));
        assert!(
            parts(&["path", "path"])
                .unwrap_err()
                .contains("path: named twice")
        );
        assert!(
            parts(&["header:bad name"])
                .unwrap_err()
                .contains("not a header name")
        );
        assert!(parts(&["cookie"]).unwrap_err().contains("expected source"));
        assert!(parts(&[]).unwrap_err().contains("empty key"));
        assert_eq!(parts(&["all"]), Ok(vec![]));
        assert!(
            parts(&["all", "path"])
                .unwrap_err()
                .contains("stands alone")
        );
        let many = [
            "source", "path", "method", "host", "header:a", "header:b", "header:c",
        ];
        assert!(parts(&many).unwrap_err().contains("at most 6"));
    }

    #[test]
    fn the_host_loses_its_port() {
        assert_eq!(strip_port("example.com:80"), "example.com");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("example.com"), "example.com");
    }
}
