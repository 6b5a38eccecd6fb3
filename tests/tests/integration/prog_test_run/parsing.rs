//! Which rule a frame reaches, however its headers are laid out: IPv4
//! prefixes, protocols and ports, options, VLAN tags, authentication and
//! IPv6 extension headers, mapped addresses; non-IP, malformed frames and
//! transport headers that cannot be read.

use std::net::{Ipv4Addr, Ipv6Addr};

use limiter_tests::{
    XDP_DROP, XDP_PASS,
    frames::{self, Ext},
    loaded,
};

use super::{RULES, SRC4, SRC6, counters, rule_of, run};

#[test]
fn ipv4_rules_by_protocol_port_and_prefix() {
    let dp = loaded(RULES);
    assert_eq!(
        rule_of(&dp, &frames::udp4(SRC4, 53, 20)).as_deref(),
        Some("dns")
    );
    assert_eq!(
        rule_of(&dp, &frames::udp4(SRC4, 54, 20)).as_deref(),
        Some("v4-any")
    );
    assert_eq!(
        rule_of(&dp, &frames::tcp4(SRC4, 53)).as_deref(),
        Some("v4-tcp")
    );
    // The longer prefix wins even over a rule naming the port.
    assert_eq!(
        rule_of(&dp, &frames::udp4(Ipv4Addr::new(198, 18, 7, 9), 53, 20)).as_deref(),
        Some("office")
    );
    assert_eq!(
        rule_of(&dp, &frames::udp4(Ipv4Addr::new(203, 0, 113, 1), 53, 20)).as_deref(),
        Some("default")
    );
}

/// Every level of the IPv4 table (`abi::v4_table`): prefixes that end in
/// the first stride (/8, /16), the second (/20, /24) and the third (/25,
/// /32), nested, and the generation flip between two rule sets.
#[test]
fn ipv4_prefixes_at_every_level_of_the_table() {
    let rule = |name: &str, source: &str| {
        format!("  - {{ name: {name}, match: {{ source: {source} }}, limit: unlimited }}\n")
    };
    let text = String::from("rules:\n")
        + &rule("n8", "10.0.0.0/8")
        + &rule("n16", "10.1.0.0/16")
        + &rule("n20", "10.1.16.0/20")
        + &rule("n24", "10.1.2.0/24")
        + &rule("n25", "10.1.2.128/25")
        + &rule("n32", "10.1.2.200/32");
    let mut dp = loaded(&text);
    let cases = [
        ([10, 9, 9, 9], "n8"),
        ([10, 1, 9, 9], "n16"),
        ([10, 1, 17, 1], "n20"),
        ([10, 1, 32, 1], "n16"),
        ([10, 1, 2, 1], "n24"),
        ([10, 1, 2, 129], "n25"),
        ([10, 1, 2, 200], "n32"),
        ([10, 1, 2, 201], "n25"),
        ([11, 1, 2, 200], "default"),
    ];
    for (addr, want) in cases {
        let frame = frames::udp4(Ipv4Addr::from(addr), 9, 0);
        assert_eq!(rule_of(&dp, &frame).as_deref(), Some(want), "{addr:?}");
    }
    // The next rule set goes into the other generation, then flips.
    dp.engine
        .apply(limiter_tests::rules(
            &(String::from("rules:\n") + &rule("moved", "10.1.2.192/26")),
        ))
        .expect("applying");
    for (addr, want) in [([10, 1, 2, 200], "moved"), ([10, 1, 2, 1], "default")] {
        let frame = frames::udp4(Ipv4Addr::from(addr), 9, 0);
        assert_eq!(rule_of(&dp, &frame).as_deref(), Some(want), "{addr:?}");
    }
}

#[test]
fn ipv4_options_are_skipped() {
    let dp = loaded(RULES);
    for words in [1, 10] {
        let frame = frames::with_ipv4_options(&frames::udp4(SRC4, 53, 20), words);
        assert_eq!(
            rule_of(&dp, &frame).as_deref(),
            Some("dns"),
            "{words} option words"
        );
    }
}

#[test]
fn vlan_and_qinq() {
    let dp = loaded(RULES);
    let frame = frames::udp4(SRC4, 53, 20);
    let single = frames::tagged(&frame, 0x8100, 10);
    assert_eq!(rule_of(&dp, &single).as_deref(), Some("dns"));
    let qinq = frames::tagged(&single, 0x88a8, 20);
    assert_eq!(rule_of(&dp, &qinq).as_deref(), Some("dns"));
    let v6 = frames::tagged(
        &frames::tagged(&frames::udp6(SRC6, 53, 0), 0x8100, 5),
        0x8100,
        6,
    );
    assert_eq!(rule_of(&dp, &v6).as_deref(), Some("v6-dns"));
    // A third tag is deeper than the parser looks: malformed, passed by policy.
    let (verdict, rule, global) = run(&dp, &frames::tagged(&qinq, 0x8100, 30));
    assert_eq!((verdict, rule, global.malformed), (XDP_PASS, None, 1));
}

/// Guards IPv4's authentication header: the port behind it is read and
/// its rule applies (before, an AH packet was protocol 51 without a port,
/// out of reach of every rule that names tcp or udp); AH within AH, or an
/// AH cut short, is charged as a packet whose port is unknown.
#[test]
fn ipv4_authentication_headers() {
    let dp = loaded(RULES);
    assert_eq!(
        rule_of(&dp, &frames::ipv4_ah(&frames::udp4(SRC4, 53, 10))).as_deref(),
        Some("dns")
    );
    assert_eq!(
        rule_of(&dp, &frames::ipv4_ah(&frames::tcp4(SRC4, 443))).as_deref(),
        Some("v4-tcp")
    );
    let twice = frames::ipv4_ah(&frames::ipv4_ah(&frames::tcp4(SRC4, 443)));
    let cut = frames::ipv4_ah(&frames::tcp4(SRC4, 443))[..frames::L3 + 21].to_vec();
    for frame in [twice, cut] {
        let (verdict, rule, global) = run(&dp, &frame);
        assert_eq!(
            (
                verdict,
                rule.as_deref(),
                global.malformed,
                global.unreadable_transport
            ),
            (XDP_PASS, Some("dns"), 0, 1)
        );
    }
}

#[test]
fn ipv6_extension_headers() {
    let dp = loaded(RULES);
    assert_eq!(
        rule_of(&dp, &frames::udp6(SRC6, 53, 10)).as_deref(),
        Some("v6-dns")
    );
    let chain = [Ext::HopByHop, Ext::Routing, Ext::Auth, Ext::DestOpts];
    assert_eq!(
        rule_of(&dp, &frames::ipv6_chain(SRC6, &chain, 53)).as_deref(),
        Some("v6-dns")
    );
    assert_eq!(
        rule_of(&dp, &frames::ipv6_chain(SRC6, &chain, 80)).as_deref(),
        Some("v6-any")
    );
    // Six extension headers are walked; a seventh is too deep.
    let six = [
        Ext::HopByHop,
        Ext::DestOpts,
        Ext::Routing,
        Ext::Routing,
        Ext::Routing,
        Ext::DestOpts,
    ];
    assert_eq!(
        rule_of(&dp, &frames::ipv6_chain(SRC6, &six, 53)).as_deref(),
        Some("v6-dns")
    );
    // Deeper, neither protocol nor port is known: the packet is charged to
    // the first rule it may belong to, never let through unlimited.
    let seven = [six.as_slice(), &[Ext::DestOpts]].concat();
    for port in [53, 80] {
        let (verdict, rule, global) = run(&dp, &frames::ipv6_chain(SRC6, &seven, port));
        assert_eq!(
            (
                verdict,
                rule.as_deref(),
                global.malformed,
                global.unreadable_transport
            ),
            (XDP_PASS, Some("v6-dns"), 0, 1)
        );
    }
}

#[test]
fn non_ip_passes_untouched() {
    let dp = loaded(RULES);
    let (verdict, rule, global) = run(&dp, &frames::arp());
    assert_eq!(
        (verdict, rule, global.non_ip, global.ipv4),
        (XDP_PASS, None, 1, 0)
    );
}

#[test]
fn malformed_frames_are_counted_and_follow_the_policy() {
    let good = frames::udp4(SRC4, 53, 20);
    let mut bad_version = good.clone();
    bad_version[frames::L3] = 0x65;
    let mut short_ihl = good.clone();
    short_ihl[frames::L3] = 0x44;
    let cases: [(&str, Vec<u8>); 4] = [
        ("truncated IPv4 header", good[..frames::L3 + 10].to_vec()),
        ("IPv4 version field 6", bad_version),
        ("IHL below 5", short_ihl),
        (
            "truncated IPv6 header",
            frames::udp6(SRC6, 53, 0)[..frames::L3 + 30].to_vec(),
        ),
    ];
    let passing = loaded(RULES);
    let dropping = loaded(&RULES.replace("malformed: pass", "malformed: drop"));
    for (what, frame) in &cases {
        let (verdict, rule, global) = run(&passing, frame);
        assert_eq!(
            (verdict, rule, global.malformed),
            (XDP_PASS, None, 1),
            "{what}"
        );
        let (verdict, _, global) = run(&dropping, frame);
        assert_eq!((verdict, global.malformed), (XDP_DROP, 1), "{what}");
    }
}

/// Once the network header is read, the source is known, and its block
/// and its rule apply whatever follows: a transport header cut short is
/// charged as if it could have any port (to the first rule it may belong
/// to), not let through as malformed.
#[test]
fn unreadable_transport_is_charged_not_passed() {
    let good = frames::udp4(SRC4, 53, 20);
    let tcp = frames::tcp4(SRC4, 80);
    let cases = [
        (
            "truncated UDP header",
            good[..frames::L3 + 20 + 4].to_vec(),
            "dns",
        ),
        (
            "truncated TCP header",
            tcp[..frames::L3 + 20 + 12].to_vec(),
            "v4-tcp",
        ),
    ];
    let dp = loaded(RULES);
    for (what, frame, want) in &cases {
        let (verdict, rule, global) = run(&dp, frame);
        assert_eq!(
            (
                verdict,
                rule.as_deref(),
                global.malformed,
                global.unreadable_transport
            ),
            (XDP_PASS, Some(*want), 0, 1),
            "{what}"
        );
    }
    // A limited source gets no more through with its headers cut short or
    // buried in extension headers than with whole ones.
    let dp = loaded(
        "rules:
  - { name: tight4, match: { source: 198.18.0.0/16, protocol: udp, dest_port: 53 }, limit: { rate: 1, unit: day, burst: 2 } }
  - { name: tight6, match: { source: \"2001:db8::/32\", protocol: udp, dest_port: 53 }, limit: { rate: 1, unit: day, burst: 2 } }
",
    );
    let cut = good[..frames::L3 + 20 + 4].to_vec();
    let deep = frames::ipv6_chain(SRC6, &[Ext::DestOpts; 9], 53);
    for frame in [cut, deep] {
        let verdicts: Vec<u32> = (0..4).map(|_| run(&dp, &frame).0).collect();
        assert_eq!(verdicts, [XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]);
    }
    // A later IPv6 fragment's Next Header is the sender's word (the
    // receiver reassembles by the first fragment's): one naming nothing a
    // rule names is still charged (from another /64: SRC6 spent its burst).
    let mut later6 = frames::ipv6_chain(
        Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1),
        &[Ext::Fragment {
            offset: 100,
            more: false,
        }],
        53,
    );
    later6[frames::L3 + 40] = 59;
    let verdicts: Vec<u32> = (0..4).map(|_| run(&dp, &later6).0).collect();
    assert_eq!(verdicts, [XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]);
    // An exemption never applies on a guess: a source exempt on tcp/443
    // and limited otherwise is charged for what hides its port.
    let dp = loaded(
        "rules:
  - { name: https, match: { source: \"2001:db8::/32\", protocol: tcp, dest_port: 443 }, limit: unlimited }
  - { name: rest, match: { source: \"2001:db8::/32\" }, limit: { rate: 1, unit: day, burst: 2 } }
",
    );
    let deep = frames::ipv6_chain(SRC6, &[Ext::DestOpts; 9], 443);
    let verdicts: Vec<(u32, Option<String>)> = (0..3)
        .map(|_| {
            let (verdict, rule, _) = run(&dp, &deep);
            (verdict, rule)
        })
        .collect();
    let rest = Some("rest".to_owned());
    assert_eq!(
        verdicts,
        [
            (XDP_PASS, rest.clone()),
            (XDP_PASS, rest.clone()),
            (XDP_DROP, rest)
        ]
    );
    // A blocked source stays blocked behind extension headers.
    let mut dp = loaded(RULES);
    dp.engine
        .block("2001:db8::/32".parse().expect("prefix"), None)
        .expect("blocking");
    let (verdict, _, global) = run(&dp, &frames::ipv6_chain(SRC6, &[Ext::DestOpts; 9], 53));
    assert_eq!((verdict, global.blocked), (XDP_DROP, 1));
}

/// An IPv6 packet from `::ffff:a.b.c.d` has a budget of its own: it never
/// spends (or shares) the IPv4 source a.b.c.d's. (Whole-address keys: the
/// default /64 of IPv6 keys would hide a shared key.)
#[test]
fn ipv4_mapped_ipv6_sources_have_their_own_budget() {
    let dp = loaded(
        "rules:
  - { name: all, key: source, limit: { rate: 1, unit: day, burst: 2 } }
",
    );
    let mapped: Ipv6Addr = SRC4.to_ipv6_mapped();
    for _ in 0..2 {
        assert_eq!(run(&dp, &frames::udp6(mapped, 9, 0)).0, XDP_PASS);
    }
    assert_eq!(run(&dp, &frames::udp6(mapped, 9, 0)).0, XDP_DROP);
    // The IPv4 source still has its whole burst.
    for _ in 0..2 {
        assert_eq!(run(&dp, &frames::udp4(SRC4, 9, 0)).0, XDP_PASS);
    }
    assert_eq!(run(&dp, &frames::udp4(SRC4, 9, 0)).0, XDP_DROP);
    assert_eq!(counters(&dp, "all").new_keys, 2);
}
