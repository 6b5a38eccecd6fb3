//! Manual blocks (`limiter block`): by source prefix, before any rule.

use aya_ebpf::maps::lpm_trie::Key;
use limiter_common::abi::{Block, RuleConfig};

use crate::{
    cell::add_shared,
    clock,
    maps::{BLOCKED_V4, BLOCKS_V4, BLOCKS_V6},
    parse::Source,
};

#[inline(always)]
pub fn whole_address_key(rule: &RuleConfig, source: &Source) -> bool {
    match *source {
        Source::V4(_) => u32::from_ne_bytes(rule.v4_key_mask) == u32::MAX,
        Source::V6(_) => rule.v6_key_mask == [0xff; 16],
    }
}

/// The block of an IPv6 source: a subprogram, so its look-up is not
/// merged with the IPv4 one (see `matching::candidates_v6`).
#[inline(never)]
fn block_v6(addr: &[u8; 16]) -> Option<&'static Block> {
    BLOCKS_V6.get(Key::new(128, *addr))
}

/// Whether an unexpired manual block covers the packet's source.
#[inline(always)]
pub fn blocked(source: &Source) -> bool {
    let block: Option<&Block> = match *source {
        Source::V4(addr) => {
            // Most sources have no block anywhere near: one bit says so.
            let slash16 = u32::from(u16::from_be_bytes([addr[0], addr[1]]));
            let near = BLOCKED_V4
                .get(slash16 / 64)
                .is_some_and(|bits| bits & (1 << (slash16 % 64)) != 0);
            if !near {
                return false;
            }
            BLOCKS_V4.get(Key::new(32, addr))
        }
        Source::V6(addr) => block_v6(&addr),
    };
    let Some(block) = block else {
        return false;
    };
    if block.expires_ns != 0 && clock::now() >= block.expires_ns {
        return false;
    }
    add_shared(&block.dropped_packets as *const u64 as *mut u64, 1);
    true
}
