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

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::programs::{TestRun, TestRunOptions};
use ipnet::IpNet;
use limiter::{
    kernel::Datapath,
    rules::{RuleSet, matching::match_order},
};
use limiter_common::abi::{GlobalCounters, RuleCounters, counter_slot};
use limiter_tests::{
    Rng, XDP_DROP, XDP_PASS,
    frames::{self, Ext},
    loaded, rules, snapshot,
};

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

const MAX_OFFSET: usize = 16 * 1024;
const MAX_IPV6_EXT_HEADERS: usize = 6;
const UNKNOWN_PROTOCOL: u8 = 255;

/// What the reference makes of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Parsed {
    NonIp,
    Malformed,
    Ip(Packet),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Port {
    /// TCP, UDP and SCTP.
    Known(u16),
    /// Other protocols have none.
    None,
    /// A later fragment, or a transport header that cannot be read.
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Packet {
    source: IpAddr,
    protocol: u8,
    port: Port,
    fragment: bool,
    later_fragment: bool,
    first_fragment: bool,
    unreadable: bool,
    tiny: bool,
    /// What identifies the datagram of a fragment, besides its source.
    datagram: u64,
}

/// `n` bytes at `at`, if the frame has them and they lie within the bytes
/// the program looks at.
fn bytes(frame: &[u8], at: usize, n: usize) -> Option<&[u8]> {
    (at <= MAX_OFFSET).then_some(())?;
    frame.get(at..at.checked_add(n)?)
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// The destination port of the transport header at `at`: it must be whole
/// within the frame and within the datagram (which ends at `end`). `Err`:
/// it should be there and is not.
fn transport(frame: &[u8], at: usize, end: usize, protocol: u8) -> Result<Port, ()> {
    let len = match protocol {
        6 => 20,
        17 => 8,
        132 => 12,
        // ICMP's type, code and checksum: present, or the packet is cut.
        1 | 58 => {
            return if at + 4 <= end && bytes(frame, at, 4).is_some() {
                Ok(Port::None)
            } else {
                Err(())
            };
        }
        _ => return Ok(Port::None),
    };
    if at + len > end {
        return Err(());
    }
    let header = bytes(frame, at, len).ok_or(())?;
    Ok(Port::Known(be16(&header[2..4])))
}

fn reference_parse(frame: &[u8]) -> Parsed {
    let Some(eth) = bytes(frame, 0, 14) else {
        return Parsed::Malformed;
    };
    let mut ether_type = be16(&eth[12..14]);
    let mut at = 14;
    let is_tag = |t: u16| t == 0x8100 || t == 0x88a8;
    for _ in 0..2 {
        if !is_tag(ether_type) {
            break;
        }
        let Some(tag) = bytes(frame, at, 4) else {
            return Parsed::Malformed;
        };
        ether_type = be16(&tag[2..4]);
        at += 4;
    }
    match ether_type {
        0x0800 => ipv4(frame, at),
        0x86dd => ipv6(frame, at),
        t if is_tag(t) => Parsed::Malformed,
        _ => Parsed::NonIp,
    }
}

fn ipv4(frame: &[u8], at: usize) -> Parsed {
    let Some(h) = bytes(frame, at, 20) else {
        return Parsed::Malformed;
    };
    let (version, ihl) = (h[0] >> 4, usize::from(h[0] & 0x0f));
    if version != 4 || ihl < 5 {
        return Parsed::Malformed;
    }
    let end = at + usize::from(be16(&h[2..4]));
    let flags_offset = be16(&h[6..8]);
    let (offset, more) = (flags_offset & 0x1fff, flags_offset & 0x2000 != 0);
    let protocol = h[9];
    let source = IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15]));
    let destination = u32::from_ne_bytes([h[16], h[17], h[18], h[19]]);
    let id = u16::from_ne_bytes([h[4], h[5]]);
    let mut packet = Packet {
        source,
        protocol,
        port: Port::Unknown,
        fragment: offset != 0 || more,
        later_fragment: offset != 0,
        first_fragment: offset == 0 && more,
        unreadable: false,
        tiny: false,
        datagram: u64::from(destination) << 32 | u64::from(id) << 8 | u64::from(protocol),
    };
    if offset == 0 {
        // One authentication header (RFC 4302) may come first; a second
        // one, or one cut short, leaves the transport unknown.
        let mut start = at + ihl * 4;
        let mut readable = true;
        if protocol == 51 {
            match bytes(frame, start, 2).filter(|_| start + 2 <= end) {
                Some(ah) => {
                    packet.protocol = ah[0];
                    start += (usize::from(ah[1]) + 2) * 4;
                    readable = ah[0] != 51;
                }
                None => readable = false,
            }
            if !readable {
                packet.protocol = UNKNOWN_PROTOCOL;
            }
        }
        match transport(frame, start, end, packet.protocol) {
            Ok(port) if readable => packet.port = port,
            _ => {
                packet.unreadable = true;
                packet.tiny = more;
            }
        }
    }
    Parsed::Ip(packet)
}

fn ipv6(frame: &[u8], at: usize) -> Parsed {
    let Some(h) = bytes(frame, at, 40) else {
        return Parsed::Malformed;
    };
    if h[0] >> 4 != 6 {
        return Parsed::Malformed;
    }
    let mut source = [0; 16];
    source.copy_from_slice(&h[8..24]);
    let source = IpAddr::V6(Ipv6Addr::from(source));
    let folded = (0..4).fold(0u32, |f, i| {
        f.rotate_left(7) ^ u32::from_ne_bytes(h[24 + 4 * i..28 + 4 * i].try_into().unwrap())
    });
    let end = match be16(&h[4..6]) {
        0 => usize::MAX,
        len => at + 40 + usize::from(len),
    };
    let mut next = h[6];
    let mut at = at + 40;
    let mut packet = Packet {
        source,
        protocol: UNKNOWN_PROTOCOL,
        port: Port::Unknown,
        fragment: false,
        later_fragment: false,
        first_fragment: false,
        unreadable: true,
        tiny: false,
        datagram: 0,
    };
    // Past what the parser walks, or cut short: the source is still known.
    let unreadable = |mut p: Packet, protocol: u8| {
        p.protocol = protocol;
        p.tiny = p.first_fragment;
        Parsed::Ip(p)
    };
    for _ in 0..=MAX_IPV6_EXT_HEADERS {
        match next {
            0 | 43 | 60 | 51 => {
                let Some(ext) = bytes(frame, at, 2) else {
                    return unreadable(packet, UNKNOWN_PROTOCOL);
                };
                // AH counts 4-byte units beyond 8 bytes; the others 8-byte units.
                at += if next == 51 {
                    (usize::from(ext[1]) + 2) * 4
                } else {
                    (usize::from(ext[1]) + 1) * 8
                };
                next = ext[0];
            }
            44 => {
                let Some(ext) = bytes(frame, at, 8) else {
                    return unreadable(packet, UNKNOWN_PROTOCOL);
                };
                packet.fragment = true;
                packet.datagram = u64::from(folded) << 32
                    | u64::from(u32::from_ne_bytes(ext[4..8].try_into().unwrap()));
                next = ext[0];
                at += 8;
                if be16(&ext[2..4]) >> 3 != 0 {
                    packet.later_fragment = true;
                    packet.unreadable = false;
                    return Parsed::Ip(packet);
                }
                packet.first_fragment = ext[3] & 1 != 0;
            }
            _ => {
                return match transport(frame, at, end, next) {
                    Ok(port) => Parsed::Ip(Packet {
                        protocol: next,
                        port,
                        unreadable: false,
                        ..packet
                    }),
                    Err(()) => unreadable(packet, next),
                };
            }
        }
    }
    unreadable(packet, UNKNOWN_PROTOCOL)
}

/// What the program does with a frame, as the counters show it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Class {
    NonIp,
    Malformed,
    Tiny,
    Blocked,
    Rule(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Outcome {
    action: u32,
    class: Class,
    ipv4: u64,
    ipv6: u64,
    fragments: u64,
    unreadable: u64,
}

/// The reference's judgement, with the memory of first fragments (source,
/// datagram) -> rule that later ones follow.
struct Reference {
    set: RuleSet,
    order: Vec<usize>,
    blocks: Vec<IpNet>,
    firsts: HashMap<(IpAddr, u64), String>,
}

impl Reference {
    fn new() -> Self {
        let set = rules(RULES);
        Self {
            order: match_order(&set),
            blocks: BLOCKS.iter().map(|b| b.parse().unwrap()).collect(),
            set,
            firsts: HashMap::new(),
        }
    }

    /// The first rule, most specific first, whose source covers the packet
    /// and that matches its protocol and port. When the port is unknown
    /// and the protocol has ports (TCP, UDP, SCTP) or is unknown: of the
    /// rules that could apply whatever the port, up to the first that
    /// surely does (the default too if none does), the one of least
    /// `bytes_per_second_bound`, the first of equals; for other protocols
    /// the first that could apply. (Every rule here is metered, so none is
    /// an exemption not to apply on a guess.)
    fn rule(&self, p: &Packet) -> String {
        let covers = |i: usize| {
            let m = &self.set.rules[i].matches;
            m.source.is_none_or(|s| s.contains(&p.source))
        };
        let may = |i: usize| {
            let m = &self.set.rules[i].matches;
            let protocol_ok = m.protocol.is_none_or(|x| x == p.protocol);
            let port_ok = m.dest_port.is_none_or(|x| p.port == Port::Known(x));
            let unknown_ok = p.port == Port::Unknown
                && (m.protocol.is_none()
                    || p.protocol == UNKNOWN_PROTOCOL
                    || m.protocol == Some(p.protocol));
            (protocol_ok && port_ok) || unknown_ok
        };
        let name = |i: Option<usize>| {
            i.map_or_else(|| "default".to_owned(), |i| self.set.rules[i].name.clone())
        };
        let candidates = self.order.iter().copied().filter(|&i| covers(i));
        if p.port != Port::Unknown || ![6, 17, 132, UNKNOWN_PROTOCOL].contains(&p.protocol) {
            return name(candidates.clone().find(|&i| may(i)));
        }
        let mut best: Option<(Option<usize>, f64)> = None;
        let mut surely = false;
        for i in candidates.filter(|&i| may(i)) {
            let bound = self.set.rules[i].bytes_per_second_bound();
            if best.is_none_or(|(_, least)| bound < least) {
                best = Some((Some(i), bound));
            }
            let m = &self.set.rules[i].matches;
            let protocol_sure = m.protocol.is_none()
                || (p.protocol != UNKNOWN_PROTOCOL && m.protocol == Some(p.protocol));
            if protocol_sure && m.dest_port.is_none() {
                surely = true;
                break;
            }
        }
        if !surely && best.is_none_or(|(_, least)| f64::INFINITY < least) {
            // The default passes: no bound, so only when nothing else may apply.
            best = Some((None, f64::INFINITY));
        }
        name(best.and_then(|(i, _)| i))
    }

    fn judge(&mut self, frame: &[u8]) -> Outcome {
        let mut out = Outcome {
            action: XDP_PASS,
            class: Class::NonIp,
            ipv4: 0,
            ipv6: 0,
            fragments: 0,
            unreadable: 0,
        };
        let p = match reference_parse(frame) {
            Parsed::NonIp => return out,
            Parsed::Malformed => {
                out.class = Class::Malformed;
                return out;
            }
            Parsed::Ip(p) => p,
        };
        match p.source {
            IpAddr::V4(_) => out.ipv4 = 1,
            IpAddr::V6(_) => out.ipv6 = 1,
        }
        out.fragments = u64::from(p.fragment);
        out.unreadable = u64::from(p.unreadable);
        if p.tiny {
            out.class = Class::Tiny;
            out.action = XDP_DROP;
            return out;
        }
        let key = (p.source, p.datagram);
        let first = (p.later_fragment && !p.unreadable)
            .then(|| self.firsts.get(&key).cloned())
            .flatten();
        let rule = first.unwrap_or_else(|| self.rule(&p));
        if self.blocks.iter().any(|b| b.contains(&p.source)) {
            out.class = Class::Blocked;
            out.action = XDP_DROP;
            return out;
        }
        if p.first_fragment {
            self.firsts.insert(key, rule.clone());
        }
        out.class = Class::Rule(rule);
        out
    }
}

/// The counters one frame can move: the global ones, and each rule's in
/// the slot of frames that arrive on no registered interface (as
/// BPF_PROG_TEST_RUN's do). Read directly: a whole snapshot costs a map
/// lookup per possible rule.
struct Counters {
    global: GlobalCounters,
    rules: Vec<RuleCounters>,
}

/// The rules' ids and names, from one snapshot.
fn rule_ids(datapath: &Datapath) -> Vec<(u32, String)> {
    snapshot(datapath)
        .rules
        .into_iter()
        .map(|r| (r.id, r.name))
        .collect()
}

fn counters(datapath: &Datapath, ids: &[(u32, String)]) -> Counters {
    let maps = datapath.maps();
    let mut global = GlobalCounters::default();
    for cpu in maps.global_stats.get(&0, 0).expect("GLOBAL_STATS").iter() {
        global.add(cpu);
    }
    let rules = ids
        .iter()
        .map(|(id, _)| {
            let mut sum = RuleCounters::default();
            for cpu in maps
                .rule_stats
                .get(&counter_slot(0, *id), 0)
                .expect("RULE_STATS")
                .iter()
            {
                sum.add(cpu);
            }
            sum
        })
        .collect();
    Counters { global, rules }
}

/// What the loaded program did with a frame, from its verdict and the
/// counters that moved; `Err` when a frame was counted other than once.
fn program(datapath: &Datapath, ids: &[(u32, String)], frame: &[u8]) -> Result<Outcome, String> {
    let before = counters(datapath, ids);
    let action = datapath
        .program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value;
    let after = counters(datapath, ids);
    let (a, b) = (&after.global, &before.global);
    if a.packets - b.packets != 1 {
        return Err(format!("counted {} times", a.packets - b.packets));
    }
    let moved: Vec<&str> = after
        .rules
        .iter()
        .zip(&before.rules)
        .zip(ids)
        .filter(|((x, y), _)| x != y)
        .map(|(_, (_, name))| name.as_str())
        .collect();
    let mut classes = Vec::new();
    if a.non_ip > b.non_ip {
        classes.push(Class::NonIp);
    }
    if a.malformed > b.malformed {
        classes.push(Class::Malformed);
    }
    if a.tiny_fragments > b.tiny_fragments {
        classes.push(Class::Tiny);
    }
    if a.blocked > b.blocked {
        classes.push(Class::Blocked);
    }
    classes.extend(moved.iter().map(|m| Class::Rule((*m).to_owned())));
    let [class] = <[Class; 1]>::try_from(classes.clone())
        .map_err(|_| format!("counted as {classes:?}: not exactly once"))?;
    Ok(Outcome {
        action,
        class,
        ipv4: a.ipv4 - b.ipv4,
        ipv6: a.ipv6 - b.ipv6,
        fragments: a.fragments - b.fragments,
        unreadable: a.unreadable_transport - b.unreadable_transport,
    })
}

/// The corpus: every frame kind the tests craft, from sources under the
/// rules, under the blocks, and under neither.
fn corpus() -> Vec<Vec<u8>> {
    let v4 = [
        Ipv4Addr::new(198, 18, 0, 1),
        Ipv4Addr::new(198, 19, 0, 9),
        Ipv4Addr::new(198, 19, 200, 1),
        Ipv4Addr::new(10, 1, 2, 3),
    ];
    let v6: [Ipv6Addr; 4] = [
        "2001:db8::1".parse().unwrap(),
        "2001:db8:1::5".parse().unwrap(),
        "2001:db8:dead::1".parse().unwrap(),
        "::ffff:198.18.0.1".parse().unwrap(),
    ];
    let mut corpus = vec![frames::arp()];
    for src in v4 {
        for port in [53, 443, 9, 80] {
            let udp = frames::udp4(src, port, 16);
            let tcp = frames::tcp4(src, port);
            corpus.push(frames::with_ipv4_options(&udp, 2));
            corpus.push(frames::ipv4_fragment(&udp, true, 0));
            corpus.push(frames::ipv4_fragment(&udp, false, 3));
            corpus.push(frames::tagged(&tcp, 0x8100, 7));
            corpus.push(frames::tagged(&frames::tagged(&udp, 0x8100, 7), 0x88a8, 9));
            corpus.push(frames::ipv4_ah(&tcp));
            corpus.extend([udp, tcp, frames::icmp4(src)]);
        }
    }
    for src in v6 {
        corpus.push(frames::udp6(src, 53, 16));
        corpus.push(frames::tcp6(src, 443));
        corpus.push(frames::icmp6(src));
        corpus.push(frames::ipv6_chain(
            src,
            &[Ext::HopByHop, Ext::Routing, Ext::DestOpts],
            53,
        ));
        corpus.push(frames::ipv6_chain(src, &[Ext::Auth], 443));
        corpus.push(frames::ipv6_chain(
            src,
            &[Ext::Fragment {
                offset: 0,
                more: true,
            }],
            53,
        ));
        corpus.push(frames::ipv6_chain(
            src,
            &[Ext::Fragment {
                offset: 5,
                more: false,
            }],
            53,
        ));
        corpus.push(frames::ipv6_chain(src, &[Ext::DestOpts; 8], 53));
    }
    corpus
}

/// Bytes that steer a parser: EtherTypes and tag protocol ids, IP
/// versions, protocols and extension header numbers, flags.
const STEERING: [u8; 16] = [
    0, 0xff, 0x08, 0x00, 0x81, 0x88, 0xa8, 0x86, 0xdd, 0x45, 0x60, 6, 17, 44, 51, 0x20,
];

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut frame = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        // Mostly within the headers, where the parser looks.
        let span = if rng.below(4) == 0 {
            frame.len()
        } else {
            frame.len().min(90)
        };
        let at = rng.below(span);
        match rng.below(7) {
            0 | 1 if !frame.is_empty() => {
                let i = at.min(frame.len() - 1);
                frame[i] ^= 1 << rng.below(8);
            }
            2 if !frame.is_empty() => {
                let i = at.min(frame.len() - 1);
                frame[i] = STEERING[rng.below(STEERING.len())];
            }
            3 => frame.truncate(rng.below(frame.len() + 1)),
            4 => frame.extend((0..rng.below(64)).map(|_| rng.word() as u8)),
            5 => {
                let n = 1 + rng.below(8);
                let at = at.min(frame.len());
                frame.splice(at..at, (0..n).map(|_| rng.word() as u8));
            }
            _ => {
                let at = at.min(frame.len());
                let end = (at + 1 + rng.below(8)).min(frame.len());
                frame.drain(at..end);
            }
        }
    }
    // BPF_PROG_TEST_RUN refuses frames shorter than an Ethernet header (no
    // driver delivers one) or longer than a page.
    while frame.len() < 14 {
        frame.push(rng.word() as u8);
    }
    frame.truncate(1600);
    frame
}

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
