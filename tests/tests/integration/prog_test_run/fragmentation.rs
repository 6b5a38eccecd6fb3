//! Fragments: later ones follow their first fragment's rule, orphans go
//! to the strictest rule they may belong to or are dropped.

use limiter_common::abi::RuleCounters;
use limiter_tests::{
    XDP_DROP, XDP_PASS,
    frames::{self, Ext},
    loaded, loaded_object, run_at, snapshot, test_clock_object,
};

use super::{RULES, SRC4, SRC6, rule_of, run};

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
