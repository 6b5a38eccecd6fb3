//! The XDP program fuzzed through BPF_PROG_TEST_RUN: frames of every kind
//! the tests craft, mutated at random (bytes flipped or set to values that
//! steer a parser, cut short, lengthened, bytes inserted and removed), each
//! judged by the loaded program and by a reference written here from the
//! header layouts and the policy the README states. Compared on every
//! frame: the family and source (through which rule's or block's counters
//! moved), the protocol and port (through which rule matched), fragment and
//! unreadable-transport flags (global counters), and the verdict class
//! (non-IP, malformed, tiny fragment, blocked, a rule); every frame must be
//! counted exactly once. `LIMITER_FUZZ_FRAMES` sets the count: 20,000 in
//! `cargo xtask test`, 1,000,000 in `cargo xtask fuzz`. A mismatch prints
//! the frame in hex, the seed and the index to replay it.
//!
//! The test is here; the reference parser, the reference's judgement,
//! what the program did and the corpus are files of their own.

mod corpus;
mod observed;
mod parse;
mod reference;

use std::collections::HashMap;

use limiter_tests::{Rng, loaded};

use corpus::{corpus, mutate};
use observed::{program, rule_ids};
use reference::{Class, Reference};

/// Every rule metered with a budget no frame spends: which rule matched is
/// what the counters show, never a limit. The catch-alls' budgets are the
/// smaller, so a packet whose port is unknown goes to them, not to the
/// first rule it may belong to (the strictest rule it may belong to).
const RULES: &str = r#"
malformed: pass
default: pass
rules:
  - { name: v4-dns, match: { source: 198.18.0.0/15, protocol: udp, dest_port: 53 }, limit: { rate: 1000000000, unit: second } }
  - { name: v4-https, match: { source: 198.18.0.0/15, protocol: tcp, dest_port: 443 }, limit: { rate: 1000000000, unit: second } }
  - { name: v4-tcp, match: { source: 198.18.0.0/15, protocol: tcp }, limit: { rate: 1000000000, unit: second } }
  - { name: v4-icmp, match: { source: 198.18.0.0/15, protocol: icmp }, limit: { rate: 1000000000, unit: second } }
  - { name: v4-any, match: { source: 198.18.0.0/15 }, limit: { rate: 100000000, unit: second } }
  - { name: v4-host, match: { source: 198.18.0.1/32 }, limit: { rate: 1000000000, unit: second } }
  - { name: any-udp, match: { protocol: udp }, limit: { rate: 1000000000, unit: second } }
  - { name: any-sctp-9, match: { protocol: sctp, dest_port: 9 }, limit: { rate: 1000000000, unit: second } }
  - { name: v6-dns, match: { source: "2001:db8::/32", protocol: udp, dest_port: 53 }, limit: { rate: 1000000000, unit: second } }
  - { name: v6-tcp, match: { source: "2001:db8::/32", protocol: tcp }, limit: { rate: 1000000000, unit: second } }
  - { name: v6-icmp, match: { source: "2001:db8:1::/48", protocol: icmpv6 }, limit: { rate: 1000000000, unit: second } }
  - { name: v6-any, match: { source: "2001:db8::/32" }, limit: { rate: 100000000, unit: second } }
"#;

/// Blocked prefixes (manual blocks, checked before any rule applies).
const BLOCKS: [&str; 2] = ["198.19.128.0/17", "2001:db8:dead::/48"];

fn load() -> limiter_tests::Loaded {
    let mut dp = loaded(RULES);
    for block in BLOCKS {
        dp.engine
            .block(block.parse().unwrap(), None)
            .expect("block");
    }
    dp
}

#[test]
fn the_program_agrees_with_the_reference_on_mutated_frames() {
    let frames: usize = std::env::var("LIMITER_FUZZ_FRAMES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("LIMITER_FUZZ_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001);
    let corpus = corpus();
    let mut rng = Rng(seed);
    // A fresh program (and fragment memory) every 4,096 frames keeps the
    // program's LRU of first fragments (8,192) from evicting anything the
    // reference still remembers.
    const ROUND: usize = 4096;
    let mut kinds: HashMap<String, u64> = HashMap::new();
    for round in 0..frames.div_ceil(ROUND) {
        if round % 16 == 15 {
            // Progress, for the long run (`--nocapture`).
            println!("{} of {frames} frames, all agreed", round * ROUND);
        }
        let dp = load();
        let ids = rule_ids(&dp);
        let mut reference = Reference::new();
        for i in round * ROUND..((round + 1) * ROUND).min(frames) {
            let base = &corpus[rng.below(corpus.len())];
            // One frame in eight unmutated, so the corpus itself is checked.
            let frame = if rng.below(8) == 0 {
                base.clone()
            } else {
                mutate(&mut rng, base)
            };
            let expected = reference.judge(&frame);
            let got = program(&dp, &ids, &frame);
            let hex: String = frame.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(
                got.as_ref(),
                Ok(&expected),
                "frame {i} (LIMITER_FUZZ_SEED={seed}): {hex}"
            );
            let kind = match &expected.class {
                Class::Rule(name) => format!("rule {name}"),
                other => format!("{other:?}"),
            };
            *kinds.entry(kind).or_default() += 1;
        }
    }
    // The mutations reach every class, and most rules, or the fuzzer is
    // not exploring what it claims to.
    let mut seen: Vec<_> = kinds.into_iter().collect();
    seen.sort();
    println!("{frames} frames: {seen:?}");
    for class in [
        "NonIp",
        "Malformed",
        "Tiny",
        "Blocked",
        "rule default",
        "rule v4-dns",
        "rule v6-any",
    ] {
        assert!(
            seen.iter().any(|(k, _)| k == class),
            "no frame judged {class}: {seen:?}"
        );
    }
}
