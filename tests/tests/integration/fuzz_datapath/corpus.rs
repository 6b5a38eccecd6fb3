//! The frames fuzzed: every kind the tests craft, and their mutations.

use std::net::{Ipv4Addr, Ipv6Addr};

use limiter_tests::{
    Rng,
    frames::{self, Ext},
};

/// The corpus: every frame kind the tests craft, from sources under the
/// rules, under the blocks, and under neither.
pub(super) fn corpus() -> Vec<Vec<u8>> {
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

pub(super) fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
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
