//! The client behind trusted proxies: the address a request came from is
//! its peer's, unless that peer is a proxy the operator trusts; then the
//! hops the proxies recorded in the one field the operator names
//! (`X-Forwarded-For`, or `Forwarded: for=` of RFC 7239) are read from the
//! right, each trusted hop handing over to the one before it, and the
//! first hop not trusted is the client. A client can write whatever it
//! likes into those fields, but only to the left of what the trusted
//! proxies appended: it can never choose its own address. Only the named
//! field is read: a proxy that appends to one passes the other through as
//! the client wrote it. A hop that cannot be read (not an address, not
//! text) ends the walk at the last address known; a client's unreadable
//! bytes spoil only their own hop, not the line the proxy appended to.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

/// The field the trusted proxies record the hops in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardedField {
    /// `X-Forwarded-For: client, proxy1, ...` (nginx, HAProxy, most cloud
    /// load balancers).
    #[default]
    #[value(name = "x-forwarded-for")]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1, ...` (RFC 7239; envoy can).
    #[value(name = "forwarded")]
    Forwarded,
}

/// The client of a request from `peer` with `headers`, trusting `proxies`
/// and reading the hops they record in `field`.
pub fn client(
    peer: IpAddr,
    headers: &HeaderMap,
    proxies: &[IpNet],
    field: ForwardedField,
) -> IpAddr {
    let trusted = |ip: &IpAddr| proxies.iter().any(|net| net.contains(&ip.to_canonical()));
    let peer = peer.to_canonical();
    if !trusted(&peer) {
        return peer;
    }
    let mut client = peer;
    for hop in hops(headers, field).iter().rev() {
        if !trusted(&client) {
            break;
        }
        match hop.as_deref().and_then(parse_hop) {
            Some(ip) => client = ip.to_canonical(),
            None => break,
        }
    }
    client
}

/// The recorded hops, leftmost first, over every instance of the field in
/// order (`None`: a hop that is not text, or a `Forwarded` element without
/// `for=`).
fn hops(headers: &HeaderMap, field: ForwardedField) -> Vec<Option<String>> {
    let name = match field {
        ForwardedField::XForwardedFor => "x-forwarded-for",
        ForwardedField::Forwarded => "forwarded",
    };
    // Split as bytes: one hop that is not text must not hide the hops the
    // proxies appended after it on the same line.
    let elements = headers
        .get_all(name)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|element| std::str::from_utf8(element).ok().map(str::trim));
    match field {
        ForwardedField::XForwardedFor => elements.map(|e| e.map(str::to_owned)).collect(),
        ForwardedField::Forwarded => elements
            .map(|element| {
                element?.split(';').find_map(|pair| {
                    let (name, value) = pair.split_once('=')?;
                    name.trim()
                        .eq_ignore_ascii_case("for")
                        .then(|| value.trim().trim_matches('"').to_owned())
                })
            })
            .collect(),
    }
}

/// An address from a hop: `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`,
/// `[2001:db8::1]:4711`. `unknown` and obfuscated names are `None`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = hop.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    let (host, port) = hop.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::test_headers as headers;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const LB: &str = "10.0.0.5";

    fn trusted() -> Vec<IpNet> {
        vec![
            "10.0.0.0/8".parse().unwrap(),
            "2001:db8:ffff::/48".parse().unwrap(),
        ]
    }

    const XFF: ForwardedField = ForwardedField::XForwardedFor;
    const FWD: ForwardedField = ForwardedField::Forwarded;

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_writes() {
        let h = headers(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("forwarded", "for=198.51.100.8"),
        ]);
        for field in [XFF, FWD] {
            assert_eq!(
                client(ip("192.0.2.1"), &h, &trusted(), field),
                ip("192.0.2.1")
            );
            assert_eq!(client(ip("192.0.2.1"), &h, &[], field), ip("192.0.2.1"));
        }
    }

    #[test]
    fn a_trusted_proxy_hands_over_to_the_hop_it_recorded() {
        let h = headers(&[("x-forwarded-for", "203.0.113.9")]);
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip("203.0.113.9"));
        // The client prepends a lie; the proxy appended the truth.
        let h = headers(&[("x-forwarded-for", "1.2.3.4, 203.0.113.9")]);
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip("203.0.113.9"));
        // Two trusted proxies in a row, the field split over two lines.
        let h = headers(&[
            ("x-forwarded-for", "1.2.3.4, 203.0.113.9"),
            ("x-forwarded-for", "10.1.1.1"),
        ]);
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip("203.0.113.9"));
        // Nothing recorded: the proxy itself.
        assert_eq!(client(ip(LB), &HeaderMap::new(), &trusted(), XFF), ip(LB));
    }

    /// A proxy that appends to `X-Forwarded-For` passes a client's own
    /// `Forwarded` through: read, it would let the client name any
    /// address (a fresh bucket a request, or a victim's).
    #[test]
    fn only_the_field_the_proxies_write_is_read() {
        let h = headers(&[
            ("forwarded", "for=198.51.100.77"),
            ("x-forwarded-for", "203.0.113.9"),
        ]);
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip("203.0.113.9"));
        let h = headers(&[
            ("x-forwarded-for", "198.51.100.77"),
            ("forwarded", "for=203.0.113.9"),
        ]);
        assert_eq!(client(ip(LB), &h, &trusted(), FWD), ip("203.0.113.9"));
    }

    /// Bytes that are not text spoil only the hop the client wrote, not
    /// the line the proxy appended the client's address to.
    #[test]
    fn a_clients_unreadable_bytes_do_not_hide_the_hop_appended_after_them() {
        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.9").unwrap(),
        );
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip("203.0.113.9"));
        // Behind two trusted proxies, the hop after the unreadable one.
        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"\xff, 203.0.113.9, 10.1.1.1").unwrap(),
        );
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip("203.0.113.9"));
    }

    #[test]
    fn forwarded_forms_are_read() {
        let h = headers(&[(
            "forwarded",
            "for=192.0.2.60;proto=http;by=203.0.113.43, for=\"[2001:db8:cafe::17]:4711\"",
        )]);
        assert_eq!(client(ip(LB), &h, &trusted(), FWD), ip("2001:db8:cafe::17"));
        let h = headers(&[("forwarded", "For=\"192.0.2.61:8080\"")]);
        assert_eq!(
            client(ip("::ffff:10.0.0.5"), &h, &trusted(), FWD),
            ip("192.0.2.61")
        );
        // An obfuscated hop ends the walk at the last address known.
        let h = headers(&[("forwarded", "for=192.0.2.1, for=_hidden, for=10.2.2.2")]);
        assert_eq!(client(ip(LB), &h, &trusted(), FWD), ip("10.2.2.2"));
        // So does an element without `for=`.
        let h = headers(&[("forwarded", "for=192.0.2.1, proto=http")]);
        assert_eq!(client(ip(LB), &h, &trusted(), FWD), ip(LB));
        let h = headers(&[("x-forwarded-for", "garbage")]);
        assert_eq!(client(ip(LB), &h, &trusted(), XFF), ip(LB));
    }
}
