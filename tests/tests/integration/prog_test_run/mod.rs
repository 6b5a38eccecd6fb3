//! The loaded XDP program run on crafted frames through BPF_PROG_TEST_RUN:
//! which verdict, which rule, which counters, for every header layout the
//! parser must handle, and for broken ones.
//!
//! A file per topic; this one holds the rules and helpers they share.

mod fragmentation;
mod metering;
mod parsing;
mod refusals;

use std::net::{Ipv4Addr, Ipv6Addr};

use aya::programs::{TestRun, TestRunOptions};
use limiter::kernel::Datapath;
use limiter_common::abi::{GlobalCounters, RuleCounters};
use limiter_tests::{XDP_PASS, snapshot};

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

fn counters(dp: &Datapath, rule: &str) -> RuleCounters {
    *snapshot(dp).rule(rule).expect("rule exists")
}
