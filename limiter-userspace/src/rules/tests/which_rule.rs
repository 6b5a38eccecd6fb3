//! Which rule applies: TCP flags in a match, the rules that may cover one
//! prefix in the kernel's tries, the index against a search in order.

use super::common::{error, parse};
use crate::rules::*;

#[test]
fn too_many_rules_cover_one_prefix() {
    let mut text = String::from("rules:\n");
    for port in 1..=9 {
        text += &format!(
            "  - {{ name: p{port}, match: {{ source: 10.0.0.0/8, protocol: tcp, dest_port: {port} }}, limit: unlimited }}\n"
        );
    }
    let e = error(&text);
    assert!(e.contains("9 rules cover 10.0.0.0/8; at most 8"), "{e}");
    // Eight fit.
    let eight: String = text.lines().take(9).map(|l| format!("{l}\n")).collect();
    assert_eq!(parse(&eight).expect("eight rules").rules.len(), 8);
}

#[test]
fn tcp_flags_name_flags_set_and_clear_on_tcp_rules() {
    let rule = |flags: &str| {
        format!(
            "rules:\n  - {{ name: t, match: {{ protocol: tcp, tcp_flags: \"{flags}\" }}, limit: {{ rate: 10, unit: second }} }}\n"
        )
    };
    let set = parse(&rule("syn,!ack")).unwrap();
    let flags = set.rules[0].matches.tcp_flags.expect("flags");
    assert_eq!((flags.mask, flags.value), (0x12, 0x02));
    assert_eq!(flags.text(), "syn,!ack");
    assert_eq!(
        describe::describe(&set.rules[0]).matches,
        "any source tcp flags syn,!ack"
    );
    for (flags, expected) in [
        (
            "syn,!akc",
            "rules[0].match.tcp_flags: \"syn,!akc\": \"akc\" is not a TCP flag",
        ),
        ("syn,!syn", "syn named twice"),
    ] {
        let e = error(&rule(flags));
        assert!(e.contains(expected), "{flags}: {e}");
    }
    let e = error(
        "rules:\n  - { name: t, match: { protocol: udp, tcp_flags: syn }, limit: { rate: 1, unit: second } }\n",
    );
    assert!(
        e.contains("rules[0].match.tcp_flags: needs protocol tcp"),
        "{e}"
    );
    // More specific than the same rule without flags, whatever the order.
    let set = parse(
        "rules:\n  - { name: all-tcp, match: { protocol: tcp }, limit: { rate: 100, unit: second } }\n  - { name: syns, match: { protocol: tcp, tcp_flags: syn }, limit: { rate: 1, unit: second } }\n",
    )
    .unwrap();
    let order = matching::match_order(&set);
    let source = "198.51.100.1".parse().unwrap();
    let rule_of = |flags| matching::first_match(&set, &order, source, 6, Some(22), flags);
    assert_eq!(rule_of(Some(0x02)), Some(1));
    assert_eq!(rule_of(Some(0x10)), Some(0));
    assert_eq!(
        rule_of(None),
        Some(0),
        "unknown flags never match a flags rule"
    );
}

/// The index finds the rule a search of every rule in order finds, on
/// random rule files (sources of every length of both families, any
/// source, ports, methods, hosts, exact paths and path prefixes, header
/// keys)
/// and requests in and out of them.
#[test]
fn the_rule_index_finds_the_rule_the_search_in_order_finds() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut requests: Vec<(http::Method, http::Uri, http::HeaderMap)> = Vec::new();
    for method in [http::Method::GET, http::Method::POST] {
        for path in ["/", "/x", "/xy", "/a", "/a/", "/a/b", "/a/bc", "/é/b"] {
            for (user, host) in [
                (None, None),
                (Some("u1"), None),
                (None, Some("h.example")),
                (Some("u1"), Some("H.Example:8080")),
                (None, Some("other.example")),
            ] {
                let mut headers = http::HeaderMap::new();
                if let Some(user) = user {
                    headers.insert("x-user", user.parse().unwrap());
                }
                if let Some(host) = host {
                    headers.insert(http::header::HOST, host.parse().unwrap());
                }
                requests.push((method.clone(), path.parse().unwrap(), headers));
            }
        }
    }
    let (mut found, mut files) = ([0usize; 2], 0);
    for _ in 0..600 {
        let mut text = String::from("rules:\n");
        for r in 0..1 + next(12) {
            let net = match next(6) {
                0 => None,
                1 => Some(format!("10.{}.{}.0/{}", next(3), next(4), 8 + next(25))),
                2 => Some(format!("2001:db8:{:x}::/{}", next(3), 32 + next(97))),
                3 => Some(
                    ["0.0.0.0/0", "::/0", "8.0.0.0/5", "2000::/3"][next(4) as usize].to_owned(),
                ),
                4 => Some(format!("10.{}.{}.{}/32", next(3), next(4), next(4))),
                _ => Some(format!("10.{}.0.0/16", next(3))),
            };
            // Without host bits, as validation wants.
            let source = net.map_or(String::new(), |net| {
                let net: ipnet::IpNet = net.parse().expect("a prefix");
                format!("source: {}, ", net.trunc())
            });
            let (protocol, port) = match next(4) {
                0 => ("", ""),
                1 => ("protocol: udp, ", ""),
                _ => (
                    "protocol: tcp, ",
                    ["", "dest_port: 80, ", "dest_port: 443, "][next(3) as usize],
                ),
            };
            let method = ["", "", "method: POST, "][next(3) as usize];
            let host = ["", "", "host: h.example, ", "host: other.example, "][next(4) as usize];
            let path = [
                "",
                "",
                "path_prefix: /x, ",
                "path_prefix: /, ",
                "path_prefix: /a/, ",
                "path_prefix: /a/b, ",
                "path_prefix: /é, ",
                "path: /x, ",
                "path: /a/b, ",
            ][next(9) as usize];
            let key = ["", "", "key: [source, path], ", "key: header:x-user, "][next(4) as usize];
            text.push_str(&format!(
                "  - {{ name: r{r}, match: {{ {source}{protocol}{port}{method}{host}{path} }}, {key}limit: {{ rate: 1, unit: second }} }}\n"
            ));
        }
        // A catch-all in a third of the files (the index asks only the
        // rules before it), TCP's alone in some.
        let catch_all = ["", "", "", "protocol: tcp"][next(4) as usize];
        if next(3) == 0 {
            text.push_str(&format!(
                "  - {{ name: all, match: {{ {catch_all} }}, limit: {{ rate: 1, unit: second }} }}\n"
            ));
        }
        // (Files where a rule could never apply are refused.)
        let Ok(set) = parse(&text) else { continue };
        files += 1;
        let index = matching::RequestRules::new(&set);
        let order = matching::match_order(&set);
        for _ in 0..200 {
            let source: std::net::IpAddr = match next(3) {
                0 => std::net::Ipv4Addr::new(10, next(4) as u8, next(5) as u8, next(256) as u8)
                    .into(),
                1 => std::net::Ipv4Addr::from(next(1 << 32) as u32).into(),
                _ => {
                    let mut bits = 0x2001_0db8u128 << 96 | u128::from(next(4)) << 80;
                    bits |= u128::from(next(u64::MAX)) * u128::from(next(2));
                    std::net::Ipv6Addr::from(bits).into()
                }
            };
            let port = [None, Some(80), Some(443)][next(3) as usize];
            let request = match next(4) {
                0 => None,
                _ => {
                    let (method, uri, headers) = &requests[next(requests.len() as u64) as usize];
                    Some(HttpRequest {
                        method,
                        uri,
                        headers,
                    })
                }
            };
            let expected =
                matching::first_request_match(&set, &order, source, port, request.as_ref());
            assert_eq!(
                index.first(&set, &source, &port, request.as_ref()),
                expected,
                "{source} port {port:?} {request:?} under\n{text}"
            );
            found[usize::from(expected.is_some())] += 1;
        }
    }
    // Many files, both outcomes often.
    assert!(files > 100, "{files} files");
    assert!(found.iter().all(|&n| n > 5_000), "{found:?}");
}
