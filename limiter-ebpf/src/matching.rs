//! Which rule applies: the candidates of the packet's source prefix (an
//! IPv4 table of direct-indexed arrays, an IPv6 LPM trie), the first that
//! matches its protocol and port.

use aya_ebpf::maps::lpm_trie::Key;
use limiter_common::abi::{Candidates, DEFAULT_RULE, Handoff, PrefixKey, handoff_flag, v4_table};

use crate::{
    maps::{LPM_V6, V4_L16, V4_L24, V4_L32, V4_LISTS},
    parse::Source,
};

/// The first candidate of the longest source prefix that matches the
/// packet's protocol and port, in the active generation; or the default.
/// A packet whose port is unknown (a later fragment whose first was not
/// seen, an unreadable transport header) takes the strictest it may
/// belong to (`Candidates::unknown_port`), or with tables of an older
/// build the first.
#[inline(always)]
pub fn match_rule(generation: u32, source: &Source, packet: &Handoff) -> u32 {
    let port_unknown = packet.flags & handoff_flag::PORT_UNKNOWN != 0;
    let candidates = match *source {
        Source::V4(addr) => candidates_v4(generation, addr),
        Source::V6(addr) => candidates_v6(generation, &addr),
    };
    let Some(candidates) = candidates else {
        return DEFAULT_RULE;
    };
    // Cost to the strictest rule it may belong to: the first, as below,
    // let a datagram sent first fragment last put its bulk on a looser
    // rule than its port's.
    if port_unknown && let Some(rule) = candidates.unknown_port_rule(packet.protocol) {
        return rule;
    }
    for (i, candidate) in candidates.entries.iter().enumerate() {
        if i as u32 >= candidates.len {
            break;
        }
        if candidate.matches(packet.protocol, packet.dest_port, packet.tcp_flags)
            || (port_unknown && candidate.may_match_unknown_port(packet.protocol))
        {
            return u32::from(candidate.rule);
        }
    }
    DEFAULT_RULE
}

/// The candidates of an IPv6 source. A subprogram of its own: inlined,
/// the compiler merges its look-up and the IPv4 one into one call whose
/// map the verifier cannot tell, and then every packet, IPv4 too, takes
/// the kernel's generic look-up (an indirect call) instead of the array's
/// inlined one. `verifier_budget` checks that no look-up is left generic.
#[inline(never)]
fn candidates_v6(generation: u32, addr: &[u8; 16]) -> Option<&'static Candidates> {
    LPM_V6.get(Key::new(
        8 + 128,
        PrefixKey {
            generation: (generation & 1) as u8,
            addr: *addr,
        },
    ))
}

/// The candidates of an IPv4 source: one to three array loads
/// (`abi::v4_table`).
#[inline(always)]
fn candidates_v4(generation: u32, addr: [u8; 4]) -> Option<&'static Candidates> {
    let first = (generation & 1) * v4_table::L16_BLOCKS + u32::from(addr[0]);
    let mut entry = V4_L16.get(first)?[usize::from(addr[1])];
    if entry & v4_table::NEXT != 0 {
        entry = V4_L24.get(entry & !v4_table::NEXT)?[usize::from(addr[2])];
    }
    if entry & v4_table::NEXT != 0 {
        entry = V4_L32.get(entry & !v4_table::NEXT)?[usize::from(addr[3])];
    }
    V4_LISTS.get(entry)
}
