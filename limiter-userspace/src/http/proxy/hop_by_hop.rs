//! Hop-by-hop fields (RFC 9110 7.6.1), which a proxy must not forward:
//! the fixed ones, and those a `Connection` field names.

use http::{HeaderMap, HeaderName, header};

/// Hop-by-hop fields, which a proxy must not forward (RFC 9110 7.6.1),
/// besides those the `Connection` field names.
pub const HOP_BY_HOP: [HeaderName; 9] = [
    HeaderName::from_static("proxy-connection"),
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes the hop-by-hop fields, and those the `Connection` field names.
/// A message carries few or none (an upstream's answer often has
/// `Connection: keep-alive`, which names one): one pass over the names
/// says which are there, and only those are removed.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let present = headers.keys().fold(0u16, |present, name| {
        HOP_BY_HOP
            .iter()
            .position(|h| h == name)
            .map_or(present, |i| present | 1 << i)
    });
    if present == 0 {
        return;
    }
    strip_connection_named(headers);
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & 1 << i != 0 {
            headers.remove(name);
        }
    }
}

/// Removes the fields the `Connection` field names (besides the hop-by-hop
/// ones, which say how the message is framed and go when it is
/// forwarded): a client may name any field so, and the upstream never
/// sees it, so the rules must not judge it either (`X-Api-Key: k1` with
/// `Connection: x-api-key` was keyed by the key and served as anonymous).
pub fn strip_connection_named(headers: &mut HeaderMap) {
    if !headers.contains_key(header::CONNECTION) {
        return;
    }
    let is_hop_by_hop = |name: &str| {
        HOP_BY_HOP
            .iter()
            .any(|h| h.as_str().eq_ignore_ascii_case(name))
    };
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|name| !is_hop_by_hop(name))
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect();
    for name in &named {
        headers.remove(name);
    }
}
