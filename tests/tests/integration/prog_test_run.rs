//! The loaded XDP program run on crafted frames through BPF_PROG_TEST_RUN:
//! which verdict, which rule, which counters, for every header layout the
//! parser must handle, and for broken ones.

use std::net::{Ipv4Addr, Ipv6Addr};

use aya::programs::{TestRun, TestRunOptions};
use limiter::kernel::Datapath;
use limiter_common::abi::{FlowKey, GlobalCounters, KeyState, RuleCounters};
use limiter_tests::{
    XDP_DROP, XDP_PASS,
    frames::{self, Ext},
    loaded, loaded_object, run_at, snapshot, test_clock_object,
};

const RULES: &str = r#"
default: pass
malformed: pass
rules:
  - { name: dns, match: { source: 198.18.0.0/16, protocol: udp, dest_port: 53 }, limit: { rate: 1000, unit: second } }
  - { name: v4-any, match: { source: 198.18.0.0/16 }, limit: { rate: 1000, unit: second } }
  - { name: v4-tcp, match: { source: 198.18.0.0/16, protocol: tcp }, limit: { rate: 1000, unit: second } }
  - { name: v6-dns, match: { source: "2001:db8::/32", protocol: udp, dest_port: 53 }, limit: { rate: 1000, unit: second } }
  - { name: v6-any, match: { source: "2001:db8::/32" }, limit: { rate: 1000, unit: second } }
  - { name: office, match: { source: 198.18.7.0/24 }, limit: unlimited }
"#;

const SRC4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const SRC6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);

/// Runs one frame; returns the verdict, the rule whose counters moved, and
/// how the global counters moved.
fn run(datapath: &Datapath, frame: &[u8]) -> (u32, Option<String>, GlobalCounters) {
    let before = snapshot(datapath);
    let result = datapath
        .program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    let after = snapshot(datapath);
    let moved: Vec<String> = after
        .rules
        .iter()
        .zip(&before.rules)
        .filter(|(a, b)| a.counters != b.counters)
        .map(|(a, _)| a.name.clone())
        .collect();
    assert!(
        moved.len() <= 1,
        "one packet moved several rules' counters: {moved:?}"
    );
    let mut global = after.global;
    global.packets -= before.global.packets;
    global.ipv4 -= before.global.ipv4;
    global.ipv6 -= before.global.ipv6;
    global.non_ip -= before.global.non_ip;
    global.malformed -= before.global.malformed;
    global.fragments -= before.global.fragments;
    global.blocked -= before.global.blocked;
    global.unreadable_transport -= before.global.unreadable_transport;
    global.tiny_fragments -= before.global.tiny_fragments;
    (result.return_value, moved.into_iter().next(), global)
}

fn rule_of(datapath: &Datapath, frame: &[u8]) -> Option<String> {
    let (verdict, rule, global) = run(datapath, frame);
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(global.malformed, 0, "parsed as malformed");
    rule
}

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
fn fragments() {
    let dp = loaded(RULES);
    // First fragments carry the transport header: ports still match.
    let first4 = frames::ipv4_fragment(&frames::udp4(SRC4, 53, 20), true, 0);
    let (verdict, rule, global) = run(&dp, &first4);
    assert_eq!(
        (verdict, rule.as_deref(), global.fragments),
        (XDP_PASS, Some("dns"), 1)
    );
    // Later fragments show no port: charged to the first rule of their
    // source and protocol, whatever its port (never uncharged).
    let later4 = frames::ipv4_fragment(&frames::udp4(SRC4, 53, 20), false, 185);
    let (verdict, rule, global) = run(&dp, &later4);
    assert_eq!(
        (verdict, rule.as_deref(), global.fragments),
        (XDP_PASS, Some("dns"), 1)
    );
    let later_tcp = frames::ipv4_fragment(&frames::tcp4(SRC4, 80), false, 185);
    assert_eq!(rule_of(&dp, &later_tcp).as_deref(), Some("v4-tcp"));
    let first6 = frames::ipv6_chain(
        SRC6,
        &[Ext::Fragment {
            offset: 0,
            more: true,
        }],
        53,
    );
    let (_, rule, global) = run(&dp, &first6);
    assert_eq!((rule.as_deref(), global.fragments), (Some("v6-dns"), 1));
    // RFC 1858: a first fragment too short for its transport header is
    // dropped, whatever the rules say.
    let tiny4 = frames::ipv4_fragment(&frames::udp4(SRC4, 53, 20), true, 0);
    let cut4 = tiny4[..frames::L3 + 20 + 4].to_vec();
    // The same, its length saying so but its frame padded to full size:
    // the bytes past the datagram are not its transport header.
    let mut padded4 = tiny4.clone();
    padded4[frames::L3 + 2..frames::L3 + 4].copy_from_slice(&24u16.to_be_bytes());
    let tiny6 = first6[..first6.len() - 6].to_vec();
    for tiny in [cut4, padded4, tiny6] {
        let (verdict, rule, global) = run(&dp, &tiny);
        assert_eq!(
            (verdict, rule, global.tiny_fragments, global.malformed),
            (XDP_DROP, None, 1, 0)
        );
    }
    let later6 = frames::ipv6_chain(
        SRC6,
        &[
            Ext::HopByHop,
            Ext::Fragment {
                offset: 100,
                more: false,
            },
        ],
        53,
    );
    let (_, rule, global) = run(&dp, &later6);
    assert_eq!(
        (rule.as_deref(), global.fragments, global.malformed),
        (Some("v6-dns"), 1, 0)
    );
}

/// An IPv4 fragment of datagram `id`: the first (offset 0, more to come)
/// or a later one.
fn fragment_of(id: u16, dest_port: u16, first: bool) -> Vec<u8> {
    let whole = frames::udp4(SRC4, dest_port, 20);
    let mut frame = if first {
        frames::ipv4_fragment(&whole, true, 0)
    } else {
        frames::ipv4_fragment(&whole, false, 185)
    };
    frame[frames::L3 + 4..frames::L3 + 6].copy_from_slice(&id.to_be_bytes());
    frame
}

/// Later fragments follow their datagram's first fragment: its rule (not
/// the first rule their source and protocol may match), and its fate.
#[test]
fn later_fragments_follow_their_first() {
    let text = "rules:
  - { name: dns, match: { source: 198.18.0.0/16, protocol: udp, dest_port: 53 }, limit: { rate: 1, unit: second, burst: 1 } }
  - { name: rest, match: { source: 198.18.0.0/16 }, limit: unlimited }
";
    let mut dp = loaded_object(&test_clock_object(), text);
    let second = 1_000_000_000;
    // A datagram to port 80: its first fragment is `rest`'s, and so are
    // its later ones (alone, they would be charged to `dns`: one passes).
    assert_eq!(run_at(&mut dp, &fragment_of(1, 80, true), second), XDP_PASS);
    for _ in 0..3 {
        assert_eq!(
            run_at(&mut dp, &fragment_of(1, 80, false), second),
            XDP_PASS
        );
    }
    let c = *snapshot(&dp).rule("rest").expect("rest");
    assert_eq!(c.passed_packets, 4);
    // Datagram 2 spends `dns`'s burst; datagram 3's first fragment is
    // dropped, and its later fragment too, even once `dns` has budget again.
    assert_eq!(run_at(&mut dp, &fragment_of(2, 53, true), second), XDP_PASS);
    assert_eq!(
        run_at(&mut dp, &fragment_of(3, 53, true), second + 1),
        XDP_DROP
    );
    assert_eq!(
        run_at(&mut dp, &fragment_of(3, 53, false), 3 * second),
        XDP_DROP
    );
    // A later fragment whose first was never seen is charged to `dns`.
    assert_eq!(
        run_at(&mut dp, &fragment_of(4, 53, false), 3 * second),
        XDP_PASS
    );
    assert_eq!(
        run_at(&mut dp, &fragment_of(5, 80, false), 3 * second),
        XDP_DROP
    );
}

/// A later fragment whose first was not seen (lost, or sent last) is
/// charged to the strictest rule it may belong to, not the first: sent
/// first fragment last, a datagram to a byte-limited port put its bulk
/// on a looser rule of its protocol (issue 35). With `fragments: drop`
/// it is dropped. Counted either way.
#[test]
fn orphan_fragments_go_to_the_strictest_rule_or_are_dropped() {
    let rules = |policy: &str| {
        format!(
            "fragments: {policy}
rules:
  - {{ name: loose, match: {{ source: 198.18.0.0/16, protocol: udp, dest_port: 80 }}, limit: {{ rate: 1000, unit: second }} }}
  - {{ name: strict, match: {{ source: 198.18.0.0/16, protocol: udp, dest_port: 9 }}, limit: {{ bytes: 20000, unit: second }} }}
  - {{ name: rest, match: {{ source: 198.18.0.0/16 }}, limit: unlimited }}
"
        )
    };
    let mut dp = loaded_object(&test_clock_object(), &rules("strictest"));
    assert_eq!(
        run_at(&mut dp, &fragment_of(7, 9, false), 1_000_000_000),
        XDP_PASS
    );
    let after = snapshot(&dp);
    let passed = |name| after.rule(name).expect(name).passed_packets;
    assert_eq!(
        (passed("loose"), passed("strict"), passed("rest")),
        (0, 1, 0)
    );
    assert_eq!(
        (
            after.orphan_fragments.charged,
            after.orphan_fragments.dropped
        ),
        (1, 0)
    );
    // Its first fragment, seen, still takes the later ones to its rule.
    assert_eq!(
        run_at(&mut dp, &fragment_of(8, 80, true), 1_000_000_000),
        XDP_PASS
    );
    assert_eq!(
        run_at(&mut dp, &fragment_of(8, 80, false), 1_000_000_000),
        XDP_PASS
    );
    let after = snapshot(&dp);
    assert_eq!(after.rule("loose").expect("loose").passed_packets, 2);
    assert_eq!(after.orphan_fragments.charged, 1);

    let mut dp = loaded_object(&test_clock_object(), &rules("drop"));
    // A whole datagram of the same id first: no first fragment for it.
    let mut whole = frames::udp4(SRC4, 9, 20);
    whole[frames::L3 + 4..frames::L3 + 6].copy_from_slice(&7u16.to_be_bytes());
    assert_eq!(run_at(&mut dp, &whole, 1_000_000_000), XDP_PASS);
    assert_eq!(
        run_at(&mut dp, &fragment_of(7, 9, false), 1_000_000_000),
        XDP_DROP
    );
    let after = snapshot(&dp);
    assert!(
        after
            .rules
            .iter()
            .all(|r| r.name == "strict" || r.counters == RuleCounters::default())
    );
    let strict = after.rule("strict").expect("strict");
    assert_eq!((strict.passed_packets, strict.dropped_packets), (1, 0));
    assert_eq!(
        (
            after.orphan_fragments.charged,
            after.orphan_fragments.dropped
        ),
        (0, 1)
    );
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

#[test]
fn default_drop() {
    let dp = loaded(&RULES.replace("default: pass", "default: drop"));
    let (verdict, rule, _) = run(&dp, &frames::udp4(Ipv4Addr::new(203, 0, 113, 1), 53, 20));
    assert_eq!((verdict, rule.as_deref()), (XDP_DROP, Some("default")));
    assert_eq!(
        rule_of(&dp, &frames::udp4(SRC4, 53, 20)).as_deref(),
        Some("dns")
    );
}

/// Every key the table holds, with its state.
fn keys(dp: &limiter_tests::Loaded) -> Vec<(FlowKey, KeyState)> {
    dp.engine.datapath().maps().keys.dump()
}

fn counters(dp: &Datapath, rule: &str) -> RuleCounters {
    *snapshot(dp).rule(rule).expect("rule exists")
}

#[test]
fn burst_then_drop_and_shadow() {
    let dp = loaded(
        "rules:
  - { name: tiny, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: day, burst: 3 } }
  - { name: dry, match: { source: 198.19.0.0/16 }, limit: { rate: 1, unit: day, burst: 3 }, action: shadow }
",
    );
    let verdicts: Vec<u32> = (0..5)
        .map(|_| run(&dp, &frames::udp4(SRC4, 9, 0)).0)
        .collect();
    assert_eq!(verdicts, [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]);
    // Another source has its own bucket.
    assert_eq!(
        run(&dp, &frames::udp4(Ipv4Addr::new(198, 18, 0, 2), 9, 0)).0,
        XDP_PASS
    );
    let c = counters(&dp, "tiny");
    assert_eq!((c.passed_packets, c.dropped_packets, c.new_keys), (4, 2, 2));
    let shadowed = frames::udp4(Ipv4Addr::new(198, 19, 1, 1), 9, 0);
    let verdicts: Vec<u32> = (0..5).map(|_| run(&dp, &shadowed).0).collect();
    assert_eq!(verdicts, [XDP_PASS; 5]);
    let c = counters(&dp, "dry");
    assert_eq!(
        (c.passed_packets, c.shadow_packets, c.dropped_packets),
        (5, 2, 0)
    );
    assert_eq!(c.shadow_bytes, 2 * shadowed.len() as u64);
}

#[test]
fn bytes_and_packets_together_charge_only_what_passes() {
    let dp = loaded(
        "rules:
  - { name: both, limit: { rate: 2, bytes: 1000, unit: day } }
",
    );
    let big = frames::udp4(SRC4, 9, 900 - 42);
    let small = frames::udp4(SRC4, 9, 18);
    assert_eq!((big.len(), small.len()), (900, 60));
    assert_eq!(run(&dp, &big).0, XDP_PASS); // 1 of 2 packets, 900 of 1000 bytes
    assert_eq!(run(&dp, &big).0, XDP_DROP); // bytes deny it; the packet meter is refunded
    assert_eq!(run(&dp, &small).0, XDP_PASS); // so the second packet still fits
    assert_eq!(run(&dp, &small).0, XDP_DROP); // packets exhausted
    let c = counters(&dp, "both");
    assert_eq!(
        (c.passed_packets, c.passed_bytes, c.dropped_packets),
        (2, 960, 2)
    );
}

#[test]
fn ipv6_keys_default_to_the_64() {
    let dp = loaded(
        "rules:\n  - { name: v6, match: { source: \"2001:db8::/32\" }, limit: { rate: 1, unit: day, burst: 2 } }\n",
    );
    let a = frames::udp6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1), 9, 0);
    let b = frames::udp6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0xffff, 0, 0, 2), 9, 0);
    let other = frames::udp6(Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1), 9, 0);
    assert_eq!(
        [run(&dp, &a).0, run(&dp, &b).0, run(&dp, &a).0],
        [XDP_PASS, XDP_PASS, XDP_DROP]
    );
    assert_eq!(run(&dp, &other).0, XDP_PASS);
    assert_eq!(counters(&dp, "v6").new_keys, 2);
}

/// Sleeps until `offset` past the next whole second of the Unix epoch.
fn after_next_epoch_second(offset: std::time::Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let next = std::time::Duration::from_secs(now.as_secs() + 1) + offset;
    std::thread::sleep(next - now);
}

#[test]
fn fixed_windows_turn_over_at_epoch_seconds() {
    let dp = loaded(
        "rules:\n  - { name: win, match: { source: 198.18.0.0/16 }, algorithm: fixed_window, limit: { rate: 3, unit: second } }\n",
    );
    let frame = frames::udp4(SRC4, 9, 0);
    for _ in 0..2 {
        // 20 ms into a second: a fresh window of 3, whatever came before.
        after_next_epoch_second(std::time::Duration::from_millis(20));
        let verdicts: Vec<u32> = (0..5).map(|_| run(&dp, &frame).0).collect();
        assert_eq!(verdicts, [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]);
        // Later in the same second: still the same window.
        std::thread::sleep(std::time::Duration::from_millis(500));
        assert_eq!(run(&dp, &frame).0, XDP_DROP);
    }
}

/// Guards the check of pinned state against the object's own map
/// definitions: a `CONFIG` pinned with another value size (as an
/// incompatible build would leave it) is refused with a message naming the
/// map and both sizes, instead of being misread.
#[test]
fn pins_of_an_incompatible_build_are_refused() {
    use aya::maps::MapData;
    use aya_obj::{
        EbpfSectionKind,
        maps::{LegacyMap, bpf_map_def},
    };
    limiter::kernel::pins::ensure_bpffs().expect("bpffs");
    let dir = std::path::PathBuf::from(format!(
        "/sys/fs/bpf/limiter-test-incompatible-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    // As a limiter makes its pin directory: root's, 0700.
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&dir)
        .expect("pin dir");
    let foreign = aya_obj::Map::Legacy(LegacyMap {
        def: bpf_map_def {
            map_type: 2, // BPF_MAP_TYPE_ARRAY, as CONFIG is
            key_size: 4,
            value_size: 8,
            max_entries: 1,
            ..bpf_map_def::default()
        },
        inner_def: None,
        section_index: 0,
        section_kind: EbpfSectionKind::Maps,
        symbol_index: None,
        data: Vec::new(),
    });
    let map = MapData::create(foreign, "CONFIG", None).expect("creating a map");
    map.pin(dir.join("CONFIG")).expect("pinning it");
    let opened = limiter::kernel::Datapath::open(&dir, 1024).map(drop);
    let _ = std::fs::remove_dir_all(&dir);
    let error = opened
        .expect_err("an incompatible pin must be refused")
        .to_string();
    assert!(
        error.contains("incompatible build")
            && error.contains(&format!(
                "CONFIG: value size is 8, this build uses {}",
                size_of::<limiter_common::abi::GlobalConfig>()
            )),
        "{error}"
    );
}

/// Guards the block check cached in a tracked key: a block added after the
/// source was tracked (and found unblocked) still drops it, a block of
/// another address leaves it alone, and removing the block lets it through
/// again.
#[test]
fn blocks_apply_to_sources_already_tracked() {
    let mut dp = loaded(RULES);
    let frame = frames::udp4(SRC4, 80, 20);
    let verdict = |dp: &Datapath| run(dp, &frame).0;
    assert_eq!(verdict(&dp), XDP_PASS, "tracked, no blocks");
    dp.engine
        .block("198.18.9.9/32".parse().unwrap(), None)
        .expect("block");
    assert_eq!(verdict(&dp), XDP_PASS, "another address blocked");
    assert_eq!(verdict(&dp), XDP_PASS, "still, from the cached check");
    dp.engine
        .block("198.18.0.1/32".parse().unwrap(), None)
        .expect("block");
    let (result, rule, _) = run(&dp, &frame);
    assert_eq!((result, rule), (XDP_DROP, None), "blocked after tracking");
    assert_eq!(verdict(&dp), XDP_DROP, "and again");
    assert!(dp.engine.unblock("198.18.0.1/32".parse().unwrap()).unwrap());
    assert_eq!(verdict(&dp), XDP_PASS, "unblocked");
}

/// `key: all` at layer 3/4: one bucket for every IPv4 source the rule
/// matches (and one for IPv6), as `source/0` was before `limiter check`
/// asked for the word.
#[test]
fn key_all_is_one_bucket_for_every_source() {
    let dp = loaded(
        "rules:
  - { name: world, match: { source: 198.18.0.0/15 }, key: all, limit: { rate: 1, unit: day, burst: 3 } }
",
    );
    for i in 1..=3 {
        let source = Ipv4Addr::new(198, 18, 0, i);
        assert_eq!(
            run(&dp, &frames::udp4(source, 9, 0)).0,
            XDP_PASS,
            "{source}"
        );
    }
    let other = Ipv4Addr::new(198, 19, 7, 7);
    assert_eq!(
        run(&dp, &frames::udp4(other, 9, 0)).0,
        XDP_DROP,
        "the bucket is shared"
    );
    assert_eq!(counters(&dp, "world").new_keys, 1);
}

/// Guards the refusal counters by cause and by key: an aggregate's
/// refusals are counted as `aggregate_excess`, a spent key-creation
/// budget's as `unadmitted` (each only as itself), and each key's
/// refusals on that key, also when two keys are refused in turns (so the
/// CPU's pending entry changes hands), as `limiter top` and escalation
/// read them.
#[test]
fn refusals_are_counted_by_cause_and_by_key() {
    let dp = loaded(
        "new_keys: { rate: 1, unit: day, burst: 3 }
rules:
  - { name: agg, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 100, unit: day }, aggregate: { rate: 4, unit: day } }
  - { name: fresh, match: { source: 198.20.0.0/16 }, key: source, limit: { rate: 100, unit: day } }
  - { name: keyed, match: { source: 198.19.0.0/16 }, key: source, limit: { rate: 2, unit: day } }
  - { name: window, match: { source: 198.21.0.0/16 }, key: source, algorithm: fixed_window, limit: { rate: 100, unit: day }, aggregate: { rate: 2, unit: day } }
",
    );
    let send =
        |a: u8, b: u8, c: u8, d: u8| run(&dp, &frames::udp4(Ipv4Addr::new(a, b, c, d), 9, 0)).0;
    let sent: Vec<u32> = [1, 1, 2, 2, 3, 3]
        .iter()
        .map(|&d| send(198, 18, 0, d))
        .collect();
    assert_eq!(
        sent,
        [XDP_PASS, XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP]
    );
    let agg = counters(&dp, "agg");
    assert_eq!(
        (agg.dropped_packets, agg.aggregate_excess, agg.unadmitted),
        (2, 2, 0),
        "{agg:?}"
    );
    let fresh: Vec<u32> = (1..=4).map(|d| send(198, 20, 0, d)).collect();
    assert_eq!(fresh, [XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP]);
    let c = counters(&dp, "fresh");
    assert_eq!(
        (
            c.dropped_packets,
            c.unadmitted,
            c.aggregate_excess,
            c.new_keys
        ),
        (1, 1, 0, 3),
        "{c:?}"
    );
    // Two keys of two packets a day, each spent, then refused in turns.
    for d in [1, 1, 2, 2] {
        assert_eq!(send(198, 19, 0, d), XDP_PASS);
    }
    for d in [1, 2, 1, 2, 1, 1, 2, 1] {
        assert_eq!(send(198, 19, 0, d), XDP_DROP);
    }
    let mut refused: Vec<(u8, u32)> = keys(&dp)
        .into_iter()
        .filter(|(key, _)| key.addr[12..15] == [198, 19, 0])
        .map(|(key, state)| (key.addr[15], state.dropped_packets))
        .collect();
    refused.sort_unstable();
    assert_eq!(refused, [(1, 5), (2, 3)], "refusals by key");
    let keyed = counters(&dp, "keyed");
    assert_eq!(
        (keyed.dropped_packets, keyed.aggregate_excess),
        (8, 0),
        "refused by the key's own meter: {keyed:?}"
    );
    // A window's aggregate: its refusals are the aggregate's too (the
    // windows' subprogram returns which meter refused).
    let window: Vec<u32> = (1..=3).map(|d| send(198, 21, 0, d)).collect();
    assert_eq!(window, [XDP_PASS, XDP_PASS, XDP_DROP]);
    let c = counters(&dp, "window");
    assert_eq!((c.dropped_packets, c.aggregate_excess), (1, 1), "{c:?}");
}

/// Another CPU holding an aggregate's lock through every attempt (its lock
/// word set here, as that CPU would leave it mid-update): the packet is
/// refused by contention and counted so, and nothing stays locked after.
#[test]
fn a_lock_held_elsewhere_refuses_by_contention() {
    let mut dp = loaded(
        "rules:
  - { name: window, match: { source: 198.21.0.0/16 }, key: source, algorithm: fixed_window, limit: { rate: 100, unit: day }, aggregate: { rate: 100, unit: day } }
",
    );
    let source = Ipv4Addr::new(198, 21, 0, 1);
    let send = |dp: &limiter_tests::Loaded| run(dp, &frames::udp4(source, 9, 0)).0;
    assert_eq!(send(&dp), XDP_PASS);
    let rule = keys(&dp)
        .into_iter()
        .find(|(key, _)| key.addr[12..] == source.octets())
        .expect("the source's key")
        .0
        .rule_id();
    let set_lock = |dp: &mut limiter_tests::Loaded, held: u32| {
        let aggregates = &mut dp.engine.datapath_mut().maps_mut().aggregates;
        let mut state = aggregates.get(&rule, 0).expect("the rule's aggregate");
        state.lock = held;
        aggregates.set(rule, state, 0).expect("aggregate written");
    };
    set_lock(&mut dp, 1);
    assert_eq!(send(&dp), XDP_DROP, "the aggregate's lock held elsewhere");
    let c = counters(&dp, "window");
    let len = frames::udp4(source, 9, 0).len() as u64;
    assert_eq!(
        (
            c.contended,
            c.dropped_packets,
            c.dropped_bytes,
            c.passed_packets,
            c.passed_bytes
        ),
        (1, 1, len, 1, len),
        "{c:?}"
    );
    set_lock(&mut dp, 0);
    // The key's own lock, taken before the aggregate's, was released.
    assert_eq!(send(&dp), XDP_PASS, "the lock free again");
    let c = counters(&dp, "window");
    assert_eq!((c.contended, c.passed_packets), (1, 2), "{c:?}");
}
