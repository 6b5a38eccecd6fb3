//! Benchmark helpers, not part of the limiter: `flood` turns one crafted
//! IPv4 frame into a flood from many sources (rewriting the low 24 bits of
//! the source address per frame, checksum kept valid) and sends it back out
//! (XDP_TX) when run through BPF_PROG_TEST_RUN in live-frames mode; `pass`
//! lets every frame through, so a receiving veth accepts XDP_TX frames when
//! the limiter under test is netfilter rather than XDP; `drop_all` is the
//! end-to-end baseline and `floor` the per-packet one: the least any
//! per-source limiter must do (parse to the source, one hash lookup).
//! More floors bound what any limiter could reach here, whatever its
//! design: `floor_clock` adds the clock read every exact meter needs;
//! `floor_state` is one read and write of a 64-byte state per source in a
//! table as large as the limiter's, the least memory traffic a limiter
//! that keeps a state per source does (the scale series); `floor_bucket`
//! reads a bucket's tags first, as the key table does; `floor_gcra` is a
//! minimal exact limiter (the floor, the clock, one GCRA check and at most
//! one compare-and-swap), the peer the limiter's known-source cost is held
//! to.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features, reason = "BPF atomics: see cell.rs")]

#[allow(dead_code, reason = "floor_gcra needs only the compare-and-swap")]
mod cell;
#[allow(dead_code, reason = "the floor program needs only the source")]
mod parse;
mod runtime;

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::{map, xdp},
    maps::{Array, LruHashMap, PerCpuArray},
    programs::XdpContext,
};
use cell::MapCell;
use limiter_common::{
    abi::FlowKey,
    gcra::{Check, Gcra},
    keytable,
    meter::AtomicCell,
};
use parse::Source;

/// Index 0: how many sources to cycle through (at most 2^24); index 1:
/// 1 to draw every frame's source at random from the whole /8 instead.
#[map]
static FLOOD_SOURCES: Array<u32> = Array::with_max_entries(2, 0);

#[map]
static FLOOD_NEXT: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Offsets of the IPv4 header checksum and of the source address's last
/// three bytes (one in the first 16-bit word, two in the second).
const CHECKSUM: usize = 14 + 10;
const SOURCE_WORDS: usize = 14 + 12;

#[xdp]
pub fn flood(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + SOURCE_WORDS + 4 > end {
        return xdp_action::XDP_ABORTED;
    }
    let sources = FLOOD_SOURCES.get(0).copied().unwrap_or(1).max(1);
    let random = FLOOD_SOURCES.get(1).copied().unwrap_or(0) != 0;
    let n = if random {
        // SAFETY: bpf_get_prandom_u32 takes no arguments and touches no memory.
        unsafe { bpf_get_prandom_u32() }
    } else {
        let Some(next) = FLOOD_NEXT.get_ptr_mut(0) else {
            return xdp_action::XDP_ABORTED;
        };
        // SAFETY: this CPU's `FLOOD_NEXT` value, which only this CPU's running
        // program touches (XDP runs to the end on its CPU).
        unsafe {
            let n = *next;
            *next = if n + 1 >= sources { 0 } else { n + 1 };
            n
        }
    } & 0x00ff_ffff;
    let words = (start + SOURCE_WORDS) as *mut [u8; 4];
    let checksum = (start + CHECKSUM) as *mut [u8; 2];
    // SAFETY: the check against `data_end` at the top covers both (the source
    // words end at byte 30, the checksum at 26), byte arrays of alignment 1;
    // an XDP program may write its frame.
    unsafe {
        let old = *words;
        let new = [old[0], (n >> 16) as u8, (n >> 8) as u8, n as u8];
        // RFC 1624, one term per changed 16-bit word: HC' = ~(~HC + ~m + m').
        let word = |b: [u8; 4], i: usize| u32::from(u16::from_be_bytes([b[i], b[i + 1]]));
        let hc = u32::from(u16::from_be_bytes(*checksum));
        let mut sum = (!hc & 0xffff)
            + (!word(old, 0) & 0xffff)
            + word(new, 0)
            + (!word(old, 2) & 0xffff)
            + word(new, 2);
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        *words = new;
        *checksum = (!(sum as u16)).to_be_bytes();
    }
    xdp_action::XDP_TX
}

#[xdp]
pub fn pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// The cheapest possible receiver: the baseline the others are measured
/// against (what the generator itself costs).
#[xdp]
pub fn drop_all(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

#[map]
static FLOOR_KEYS: LruHashMap<FlowKey, u64> = LruHashMap::with_max_entries(1 << 20, 0);

/// The frame's source as the limiter keys it (rule 0, whole address).
#[inline(always)]
fn source_key(ctx: &XdpContext) -> Option<FlowKey> {
    match parse::parse(ctx) {
        Ok(Some(packet)) => Some(match packet.source {
            Source::V4(addr) => FlowKey::v4(0, addr, [0xff; 4]),
            Source::V6(addr) => FlowKey::v6(0, addr, [0xff; 16]),
        }),
        _ => None,
    }
}

/// Parses to the source with the limiter's own parser, looks the source up
/// in an LRU hash (inserting it when missing) and drops.
#[xdp]
pub fn floor(ctx: XdpContext) -> u32 {
    let Some(key) = source_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    if FLOOR_KEYS.get_ptr_mut(key).is_none() {
        let _ = FLOOR_KEYS.insert(key, 0, 0);
    }
    xdp_action::XDP_DROP
}

/// The floor and a read of the clock every exact meter needs
/// (`bpf_ktime_get_ns`, as the limiter reads it), stored in the source's
/// entry so that it is not optimised away.
#[xdp]
pub fn floor_clock(ctx: XdpContext) -> u32 {
    let Some(key) = source_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: bpf_ktime_get_ns takes no arguments and touches no memory.
    let now = unsafe { bpf_ktime_get_ns() };
    match FLOOR_KEYS.get_ptr_mut(key) {
        // SAFETY: an aligned u64, the value of an LRU entry (preallocated: never
        // freed); another CPU's insert reusing it meanwhile at worst gets this
        // time, in a map nothing reads.
        Some(entry) => unsafe { *entry = now },
        None => {
            let _ = FLOOR_KEYS.insert(key, now, 0);
        }
    }
    xdp_action::XDP_DROP
}

/// The bench's limit (1000 a second, a burst of 100: `receivers::RATE`
/// and `BURST`).
const FLOOR_LIMIT: Gcra = match Gcra::new(1000, 1_000_000_000, 100) {
    Ok(gcra) => gcra,
    Err(_) => panic!("the bench's limit is valid"),
};

/// The least an exact per-source limiter does: parse to the source, one
/// LRU hash lookup (inserting a new source), the clock, the GCRA check
/// and, when the frame conforms, one compare-and-swap of the source's TAT
/// (a lost race drops the frame: no retry).
#[xdp]
pub fn floor_gcra(ctx: XdpContext) -> u32 {
    let Some(key) = source_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: bpf_ktime_get_ns takes no arguments and touches no memory.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(tat) = FLOOR_KEYS.get_ptr_mut(key) else {
        let _ = FLOOR_KEYS.insert(key, now + FLOOR_LIMIT.emission_ns, 0);
        return xdp_action::XDP_PASS;
    };
    // SAFETY: a `FLOOR_KEYS` value, a map lookup's pointer to a u64.
    let cell = unsafe { MapCell::at(tat) };
    let seen = cell.load();
    match FLOOR_LIMIT.check(seen, now, 1) {
        Check::Allow { new_tat } if cell.compare_exchange(seen, new_tat).is_ok() => {
            xdp_action::XDP_PASS
        }
        _ => xdp_action::XDP_DROP,
    }
}

/// One 64-byte state per source, by hash (no key kept, no collision
/// handled: less than any real table does). The bench sizes it (a power
/// of two) and writes its size less one at `FLOOR_STATE_MASK[0]`.
#[map]
static FLOOR_STATES: Array<[u64; 8]> = Array::with_max_entries(1, 0);

#[map]
static FLOOR_STATE_MASK: Array<u32> = Array::with_max_entries(2, 0);

/// Parses to the source, hashes it as the limiter's key table does, and
/// counts the frame in the source's state: one cache line read and
/// written per frame, in a table of the limiter's size.
#[xdp]
pub fn floor_state(ctx: XdpContext) -> u32 {
    let Some(key) = source_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    let mask = FLOOR_STATE_MASK.get(0).copied().unwrap_or(0);
    let slot = keytable::hash(&key, 0x9e37_79b9_7f4a_7c15) as u32 & mask;
    if let Some(state) = FLOOR_STATES.get_ptr_mut(slot) {
        // SAFETY: a `FLOOR_STATES` value, allocated while the program runs; other
        // CPUs may race this plain increment (a lost count, which nothing reads).
        unsafe { (*state)[0] += 1 };
    }
    xdp_action::XDP_DROP
}

/// Tags of `floor_bucket`'s split layout, one line per bucket of 8 states.
#[map]
static FLOOR_TAGS: Array<[u32; 8]> = Array::with_max_entries(1, 0);

/// What the key table's shape costs at scale: a bucket's tags read, a
/// branch on them, then the source's 64-byte state read and written, with
/// the tags in an array of their own (`FLOOR_STATE_MASK[1]` = 0, as the
/// key table keeps them) or in the first line of the bucket's own states
/// (1: the tags and the state on one page).
#[xdp]
pub fn floor_bucket(ctx: XdpContext) -> u32 {
    let Some(key) = source_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    let mask = FLOOR_STATE_MASK.get(0).copied().unwrap_or(0);
    let together = FLOOR_STATE_MASK.get(1).copied().unwrap_or(0) != 0;
    let slot = keytable::hash(&key, 0x9e37_79b9_7f4a_7c15) as u32 & mask;
    let (bucket, way) = (slot / 8, (slot % 8).max(1));
    let tag = if together {
        FLOOR_STATES.get(bucket * 8).map(|line| line[0] as u32)
    } else {
        FLOOR_TAGS.get(bucket).map(|tags| tags[way as usize & 7])
    };
    // Never taken (every tag is 0): the branch a lookup makes on the tag.
    if tag == Some(u32::MAX) {
        return xdp_action::XDP_PASS;
    }
    if let Some(state) = FLOOR_STATES.get_ptr_mut(bucket * 8 + way) {
        // SAFETY: as in `floor_state`: a `FLOOR_STATES` value; a racy count that
        // nothing reads.
        unsafe { (*state)[0] += 1 };
    }
    xdp_action::XDP_DROP
}
