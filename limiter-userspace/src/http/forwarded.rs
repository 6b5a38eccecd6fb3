//! The client behind trusted proxies: the address a request came from is
//! its peer's, unless that peer is a proxy the operator trusts; then the
//! hops the proxies recorded (`Forwarded: for=`, RFC 7239, else
//! `X-Forwarded-For`) are read from the right, each trusted hop handing
//! over to the one before it, and the first hop not trusted is the client.
//! A client can write whatever it likes into those fields, but only to the
//! left of what the trusted proxies appended: it can never choose its own
//! address. A hop that cannot be read ends the walk at the last address
//! known.

use std::net::IpAddr;

use http::HeaderMap;
use ipnet::IpNet;

/// The client of a request from `peer` with `headers`, trusting `proxies`.
pub fn client(peer: IpAddr, headers: &HeaderMap, proxies: &[IpNet]) -> IpAddr {
    let trusted = |ip: &IpAddr| proxies.iter().any(|net| net.contains(&ip.to_canonical()));
    let peer = peer.to_canonical();
    if !trusted(&peer) {
        return peer;
    }
    let hops = hops(headers);
    let mut client = peer;
    for hop in hops.iter().rev() {
        if !trusted(&client) {
            break;
        }
        match parse_hop(hop) {
            Some(ip) => client = ip.to_canonical(),
            None => break,
        }
    }
    client
}

/// The recorded hops, leftmost first: `Forwarded`'s `for=` if any field
/// says one, else `X-Forwarded-For`'s; every instance of the field, in order.
fn hops(headers: &HeaderMap) -> Vec<String> {
    let values = |name: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let forwarded: Vec<String> = values("forwarded")
        .iter()
        .filter_map(|element| {
            element.split(';').find_map(|pair| {
                let (name, value) = pair.split_once('=')?;
                name.trim()
                    .eq_ignore_ascii_case("for")
                    .then(|| value.trim().trim_matches('"').to_owned())
            })
        })
        .collect();
    if forwarded.is_empty() {
        values("x-forwarded-for")
    } else {
        forwarded
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
    use crate::http::test_headers as headers;

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

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_writes() {
        let h = headers(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("forwarded", "for=198.51.100.8"),
        ]);
        assert_eq!(client(ip("192.0.2.1"), &h, &trusted()), ip("192.0.2.1"));
        assert_eq!(client(ip("192.0.2.1"), &h, &[]), ip("192.0.2.1"));
    }

    #[test]
    fn a_trusted_proxy_hands_over_to_the_hop_it_recorded() {
        let h = headers(&[("x-forwarded-for", "203.0.113.9")]);
        assert_eq!(client(ip(LB), &h, &trusted()), ip("203.0.113.9"));
        // The client prepends a lie; the proxy appended the truth.
        let h = headers(&[("x-forwarded-for", "1.2.3.4, 203.0.113.9")]);
        assert_eq!(client(ip(LB), &h, &trusted()), ip("203.0.113.9"));
        // Two trusted proxies in a row, the field split over two lines.
        let h = headers(&[
            ("x-forwarded-for", "1.2.3.4, 203.0.113.9"),
            ("x-forwarded-for", "10.1.1.1"),
        ]);
        assert_eq!(client(ip(LB), &h, &trusted()), ip("203.0.113.9"));
        // Nothing recorded: the proxy itself.
        assert_eq!(client(ip(LB), &HeaderMap::new(), &trusted()), ip(LB));
    }

    #[test]
    fn forwarded_wins_and_its_forms_are_read() {
        let h = headers(&[
            ("x-forwarded-for", "198.51.100.1"),
            (
                "forwarded",
                "for=192.0.2.60;proto=http;by=203.0.113.43, for=\"[2001:db8:cafe::17]:4711\"",
            ),
        ]);
        assert_eq!(client(ip(LB), &h, &trusted()), ip("2001:db8:cafe::17"));
        let h = headers(&[("forwarded", "For=\"192.0.2.61:8080\"")]);
        assert_eq!(
            client(ip("::ffff:10.0.0.5"), &h, &trusted()),
            ip("192.0.2.61")
        );
        // An obfuscated hop ends the walk at the last address known.
        let h = headers(&[("forwarded", "for=192.0.2.1, for=_hidden, for=10.2.2.2")]);
        assert_eq!(client(ip(LB), &h, &trusted()), ip("10.2.2.2"));
        let h = headers(&[("x-forwarded-for", "garbage")]);
        assert_eq!(client(ip(LB), &h, &trusted()), ip(LB));
    }
}
