//! Fragments follow their datagram: the rule and the verdict of a
//! datagram's first fragment (the one with the ports) are remembered by
//! source and datagram, and its later fragments take the same rule, and
//! are dropped if it was. A later fragment whose first was not seen (lost,
//! reordered, forgotten by the LRU) is charged to the strictest rule of its
//! source that may apply (`match_rule`), or dropped (`fragments: drop`),
//! and counted either way.

use limiter_common::abi::{FirstFragment, FlowKey, FragmentKey, orphan_fragments};

use crate::{
    maps::{FRAGMENTS, ORPHAN_FRAGMENTS},
    parse::Source,
};

#[inline(always)]
fn key(source: &Source, datagram: u64) -> FragmentKey {
    let source = match *source {
        Source::V4(a) => FlowKey::v4(0, a, [0xff; 4]),
        Source::V6(a) => FlowKey::v6(0, a, [0xff; 16]),
    };
    FragmentKey {
        source,
        _pad: 0,
        datagram,
    }
}

/// For a later fragment: what became of its datagram's first fragment
/// under the rules of `generation`, if it was seen. (This and `remember`
/// are BPF subprograms, called for fragments only: their frames keep the
/// program's stack within 512 bytes.)
#[inline(never)]
pub fn first_of(generation: u32, source: &Source, datagram: u64) -> Option<FirstFragment> {
    // SAFETY: copied out at once; an LRU entry may be reused meanwhile,
    // which at worst charges a fragment as if its first was not seen.
    let first = unsafe { FRAGMENTS.get(key(source, datagram)) }.copied()?;
    (first.generation == generation).then_some(first)
}

/// For a first fragment: remembers its rule and whether it was dropped.
#[inline(never)]
pub fn remember(generation: u32, source: &Source, datagram: u64, rule: u32, dropped: bool) {
    let first = FirstFragment {
        rule,
        generation,
        dropped: u32::from(dropped),
        _pad: 0,
    };
    // A full map evicts the least recent datagram; failing to insert only
    // means its later fragments are charged without it.
    let _ = FRAGMENTS.insert(key(source, datagram), first, 0);
}

/// Counts a later fragment whose first was not seen: charged, or dropped.
/// A subprogram too: inlined, the branch of its look-up doubled what the
/// verifier walks after it.
#[inline(never)]
pub fn count_orphan(dropped: bool) {
    let index = if dropped {
        orphan_fragments::DROPPED
    } else {
        orphan_fragments::CHARGED
    };
    if let Some(count) = ORPHAN_FRAGMENTS.get_ptr_mut(index) {
        // SAFETY: this CPU's counter, which only this CPU's running program
        // touches (XDP runs to the end on its CPU).
        unsafe { *count += 1 };
    }
}
