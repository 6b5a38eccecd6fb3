//! The per-key state table: a set-associative hash table in two array maps
//! (`KEY_TAGS`, one [`Tags`] per bucket, and `KEYS`, one [`Slot`] per way
//! of each bucket), shared by the kernel (lookups and claims) and userspace
//! (reads through a memory mapping, forgetting a rule's keys). Two maps
//! rather than one array of buckets: the kernel reaches a slot by its own
//! map lookup, so the verifier sees one kind of pointer whichever way
//! matched, instead of one program path per way.
//!
//! Why not the kernel's LRU hash: a lookup there hashes into a bucket list
//! and follows it to a separately allocated element (two cache misses when
//! the map is large), each element carries list and hash overhead, and the
//! LRU evicts whatever was seen least recently, including a source still in
//! debt to its limit, which then comes back with a fresh burst. Here a key
//! hashes to one bucket of [`WAYS`] slots whose tags share a cache line;
//! a new key takes a free slot or one whose state is *at rest* (what a new
//! key would start with anyway), never one still in debt. When a bucket has
//! neither, the new key is refused and counted (`key_alloc_failed`): the
//! table never forgets a limited source to make room.
//!
//! Each key has a preferred way in its bucket ([`preferred_way`]), taken
//! when free and looked at first.
//!
//! A third map, `KEY_FILTER`, is a presence filter in front of the tags
//! ([`filter_words`]): a source the table does not hold, as a forged one,
//! is mostly turned away by one load from it, without reading the tags.
//!
//! A key costs 60.5 bytes: its 4-byte tag, its half byte of filter, and a
//! 56-byte [`Slot`] (the key,
//! 20; the block epoch it was last checked at, 4; and a [`KeyState`] of
//! three words that holds any algorithm's state: two TATs for GCRA, or a
//! window start and two pairs of 31-bit counts for the windows).

use crate::{
    abi::{FlowKey, KeyState, RuleConfig, algorithm, rule_flag},
    window::WindowState,
};

/// Slots per bucket: their tags fill half a cache line.
pub const WAYS: usize = 8;

/// `Bucket::tags` values besides a key's tag.
pub mod tag {
    /// The slot holds nothing.
    pub const FREE: u32 = 0;
    /// A CPU is writing a new key into the slot.
    pub const CLAIMED: u32 = 1;
    /// Set in every key's tag, so a tag is never `FREE` or `CLAIMED`.
    pub const KEY: u32 = 1 << 31;
}

/// A bucket's tags: which key (by hash) each of its slots holds.
pub type Tags = [u32; WAYS];

/// One key and its state: 56 bytes, and with its tag 60 bytes a key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    pub key: FlowKey,
    /// `GlobalConfig::block_epoch` when this key's source was last found
    /// unblocked, plus one (0: never checked). Full-address keys only.
    pub block_epoch: u32,
    pub state: KeyState,
}

const _: () = assert!(core::mem::size_of::<Slot>() == 56);

/// Bit 31 of a window key's packets word (`KeyState::meters[1]`): held
/// while a CPU changes the key's windows.
pub const WINDOW_LOCK: u64 = 1 << 31;

/// The most a key's window may count (packets or bytes per window): its
/// counts are 31-bit halves of a word whose bit 31 is the lock.
pub const MAX_WINDOW_LIMIT: u64 = (1 << 31) - 1;

/// A window key's meter (`1` packets, `2` bytes) as the window code
/// sees it. (Without the lock bit.)
#[inline(always)]
pub fn window_state(state: &KeyState, meter: usize) -> WindowState {
    window_of(state.meters[0], state.meters[meter])
}

/// A window key's meter from its words: the key's window start
/// (`meters[0]`) and the meter's packed counts (the lock bit ignored).
#[inline(always)]
pub fn window_of(start: u64, counts: u64) -> WindowState {
    let counts = counts & !WINDOW_LOCK;
    WindowState {
        start,
        previous: counts >> 32,
        current: counts & 0xffff_ffff,
    }
}

/// A meter's counts packed as [`KeyState`] keeps them (the lock bit
/// clear); both are at most [`MAX_WINDOW_LIMIT`].
#[inline(always)]
pub fn pack_counts(window: &WindowState) -> u64 {
    (window.previous << 32) | (window.current & MAX_WINDOW_LIMIT)
}

/// The index in `KEYS` of way `way` of bucket `bucket`.
#[inline(always)]
pub fn slot_index(bucket: u32, way: usize) -> u32 {
    bucket * WAYS as u32 + way as u32
}

/// Buckets for a table of at least `max_keys` slots: a power of two, so a
/// bucket is a mask of the hash.
pub const fn buckets_for(max_keys: u32) -> u32 {
    let buckets = max_keys.div_ceil(WAYS as u32);
    if buckets <= 1 {
        1
    } else {
        buckets.next_power_of_two()
    }
}

/// A 64-bit hash of `key`, keyed by `seed` (random per table, so an
/// attacker cannot aim forged sources at a victim's bucket). Multiply and
/// xor-shift per 32-bit word, then MurmurHash3's 64-bit finaliser, so the
/// bucket bits depend on every bit of the key (a multiplication alone only
/// carries low bits upwards, and sources differ in their last bytes): no
/// division, no table, a few dozen instructions.
#[inline(always)]
pub fn hash(key: &FlowKey, seed: u64) -> u64 {
    #[inline(always)]
    fn mix(h: u64, word: u32) -> u64 {
        let h = (h ^ u64::from(word)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 29)
    }
    #[inline(always)]
    fn word(a: &[u8; 16], i: usize) -> u32 {
        u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]])
    }
    let a = &key.addr;
    let h = mix(seed ^ 0x9e37_79b9_7f4a_7c15, key.rule);
    let h = mix(h, word(a, 0));
    let h = mix(h, word(a, 4));
    let h = mix(h, word(a, 8));
    let h = mix(h, word(a, 12));
    let h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    let h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The bucket of a hash in a table of `buckets` (a power of two).
#[inline(always)]
pub fn bucket_of(hash: u64, buckets: u32) -> u32 {
    (hash as u32) & buckets.wrapping_sub(1)
}

/// Bits of each half of the presence filter per slot of the table: at a
/// full table, a bit in 1 - e^-0.5 = 39% of the filter is set; with the
/// few keys a fresh flood leaves, almost none.
pub const FILTER_BITS_PER_SLOT: u32 = 2;

/// 64-bit words in each half of the presence filter (`KEY_FILTER`) of a
/// table of `buckets` (a power of two, so is this).
///
/// The filter answers "is this key surely absent?" before the tags are
/// read: a bit per hash, set in both halves whenever a key is stored, so
/// a bit clear in the active half means no slot holds the key. It is a
/// sixteenth of the size of the tags, so a forged source, which the table
/// never holds, costs a load from a small array instead of a cache and TLB
/// miss in the large one. Bits of keys gone since are cleared by
/// rebuilding the inactive half from the table, then switching to it
/// (`GlobalConfig::key_filter`).
pub const fn filter_words(buckets: u32) -> u32 {
    let words = buckets.saturating_mul(WAYS as u32 * FILTER_BITS_PER_SLOT) / 64;
    if words == 0 { 1 } else { words }
}

/// A hash's bit in a filter half of `words` words: (word, mask). Bits of
/// the hash above the bucket's, so keys of one bucket spread.
#[inline(always)]
pub fn filter_bit(hash: u64, words: u32) -> (u32, u64) {
    let bit = ((hash >> 24) as u32) & (words.wrapping_mul(64).wrapping_sub(1));
    (bit / 64, 1 << (bit % 64))
}

/// The way of its bucket a key is looked for first, and stored in when
/// that slot is free (the kernel's claims and lookups go round the bucket
/// from it). Found there, the key's slot is loaded as its tag is (its
/// address needs no tag, and the branch on the tag is predicted to
/// match), as it was when claims took the first free way and lookups
/// started at way 0; but a way the verifier cannot know walks each loop
/// once, where ways known to it were walked one path per way (about
/// 76,000 fewer instructions verified). From the tag's top bits, which
/// neither the bucket nor the filter uses.
#[inline(always)]
pub fn preferred_way(tag: u32) -> usize {
    ((tag >> 28) & (WAYS as u32 - 1)) as usize
}

/// The tag of a hash: its high half, marked as a key.
#[inline(always)]
pub fn tag_of(hash: u64) -> u32 {
    ((hash >> 32) as u32) | tag::KEY
}

/// Since when `state`, kept under `rule`, has been *at rest* at `now`:
/// what a new key would start with, so its slot may go to another key
/// without giving anyone budget. `None` while it is not: a GCRA TAT after
/// `now` (a key in debt), a count in a window still open (for a sliding
/// window, the one after too), or a window key's lock held (a caller that
/// holds it passes a copy with the lock bit clear). Times are ns of
/// `CLOCK_MONOTONIC`; windows, kept in epoch ns, take
/// `realtime_offset_ns`. The slot at rest the longest is the one to
/// reuse, as an LRU would.
///
/// One branch on the algorithm, which the kernel's verifier follows once
/// per way of a bucket.
#[inline(always)]
pub fn at_rest_since(
    state: &KeyState,
    rule: &RuleConfig,
    now: u64,
    realtime_offset_ns: u64,
) -> Option<u64> {
    let [first, packets, bytes] = state.meters;
    if rule.algorithm == algorithm::GCRA {
        // Every word a TAT: the third a third limit's (a daily quota,
        // say) or a soft limit's; with neither, a time already past.
        let tat = first.max(packets).max(bytes);
        return (tat <= now).then_some(tat);
    }
    if packets & WINDOW_LOCK != 0 {
        return None;
    }
    let spans = if rule.algorithm == algorithm::SLIDING_WINDOW {
        2
    } else {
        1
    };
    // Both meters share the rule's unit, so their window length.
    let length_ns = if rule.flags & rule_flag::LIMIT_PACKETS != 0 {
        rule.packets.window.length_ns
    } else {
        rule.bytes.window.length_ns
    };
    // When the windows stopped counting (0: they counted nothing).
    let expired = if (packets & !WINDOW_LOCK) | bytes != 0 {
        first.saturating_add(spans * length_ns)
    } else {
        0
    };
    let expired = expired.saturating_sub(realtime_offset_ns);
    (expired <= now).then_some(expired)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec;

    use super::*;
    use crate::window::Window;

    #[test]
    fn slots_are_one_per_bucket_and_way() {
        let mut seen = std::collections::BTreeSet::new();
        for bucket in 0..64 {
            for way in 0..WAYS {
                let i = slot_index(bucket, way);
                assert!(i < 64 * WAYS as u32);
                assert!(seen.insert(i), "slot {i} twice");
            }
        }
    }

    /// Sequential sources (a /18 under one rule, which differ in their
    /// last bytes only) spread over the buckets as random keys would, and
    /// over the ways they are first looked for in: a hash that left the
    /// bucket bits to the high bytes of the key would put them in a few
    /// buckets, which is a flood's way to evict a victim's key.
    #[test]
    fn sequential_sources_spread_over_buckets_and_ways() {
        let buckets = 4096;
        let seed = 0x0123_4567_89ab_cdef;
        let mut load = vec![0u32; buckets as usize];
        let mut ways = [0u32; WAYS];
        for n in 0u32..16_384 {
            let [_, _, c, d] = n.to_be_bytes();
            let key = FlowKey::v4(3, [198, 18, c, d], [255; 4]);
            let h = hash(&key, seed);
            load[bucket_of(h, buckets) as usize] += 1;
            ways[preferred_way(tag_of(h))] += 1;
        }
        // 4 a bucket on average: a Poisson maximum over 4096 buckets is
        // about 12.
        let max = load.iter().max().copied().unwrap_or(0);
        assert!(max <= 16, "a bucket of {max} keys");
        // 2048 a way on average.
        assert!(
            ways.iter().all(|&n| (1_700..2_400).contains(&n)),
            "{ways:?}"
        );
    }

    /// Every bit of the seed moves every key (each step of the hash is a
    /// bijection of its state): a table's placement cannot be learnt from
    /// part of its seed.
    #[test]
    fn every_bit_of_the_seed_matters() {
        let key = FlowKey::v4(3, [198, 18, 0, 1], [255; 4]);
        let seed = 0x0123_4567_89ab_cdef_u64;
        for bit in 0..64 {
            assert_ne!(hash(&key, seed), hash(&key, seed ^ (1 << bit)), "bit {bit}");
        }
    }

    /// Distinct keys get distinct hashes (64 bits: a collision among
    /// 2^16 keys has odds of 2^-33): each step of the hash keeps all of
    /// its input, so no bit of a key is lost to the seed's.
    #[test]
    fn sequential_sources_never_collide() {
        for seed in [0, 0x0123_4567_89ab_cdef, u64::MAX] {
            let mut hashes: std::vec::Vec<u64> = (0u32..1 << 16)
                .map(|n| {
                    let [_, _, c, d] = n.to_be_bytes();
                    hash(&FlowKey::v4(3, [198, 18, c, d], [255; 4]), seed)
                })
                .collect();
            hashes.sort_unstable();
            hashes.dedup();
            assert_eq!(hashes.len(), 1 << 16, "seed {seed:#x}");
        }
    }

    #[test]
    fn buckets_are_powers_of_two_covering_max_keys() {
        assert_eq!(buckets_for(0), 1);
        assert_eq!(buckets_for(1), 1);
        assert_eq!(buckets_for(8), 1);
        assert_eq!(buckets_for(9), 2);
        assert_eq!(buckets_for(4096), 512);
        assert_eq!(buckets_for(5000), 1024);
        assert_eq!(buckets_for(1 << 20), 1 << 17);
        for n in [3, 100, 12_500_000] {
            let b = buckets_for(n);
            assert!(b.is_power_of_two() && b * WAYS as u32 >= n);
        }
    }

    /// Guards the hash: every word of the key and the seed change it, the
    /// tag is never FREE or CLAIMED, and keys spread over buckets.
    #[test]
    fn hash_depends_on_every_word_and_spreads() {
        let key = FlowKey::v4(3, [198, 18, 0, 1], [255; 4]);
        let h = hash(&key, 7);
        assert_ne!(h, hash(&key, 8));
        assert_ne!(h, hash(&FlowKey { rule: 4, ..key }, 7));
        for i in 0..16 {
            let mut other = key;
            other.addr[i] ^= 1;
            assert_ne!(h, hash(&other, 7), "byte {i}");
        }
        assert!(tag_of(0) & tag::KEY != 0 && tag_of(0) != tag::FREE && tag_of(0) != tag::CLAIMED);
        // 2^20 consecutive addresses (a /12, as a flood or a scan sends
        // them), under three /12s, over 2^18 buckets (half full, as the
        // bench's table is): 4 keys a bucket on average. A random hash
        // leaves 0.9% of keys past full buckets (Poisson(4) beyond 8) and
        // 1.8% of buckets empty; the multiplicative hash alone, without
        // the finaliser, left 12% of such keys out in the bench.
        let buckets = 1u32 << 18;
        for prefix in [[198u8, 0], [10, 16], [203, 0]] {
            let mut load = vec![0u32; buckets as usize];
            for n in 0..1u32 << 20 {
                let addr = (u32::from_be_bytes([prefix[0], prefix[1], 0, 0]) | n).to_be_bytes();
                let key = FlowKey::v4(1, addr, [255; 4]);
                load[bucket_of(hash(&key, 99), buckets) as usize] += 1;
            }
            let over: u32 = load.iter().map(|&n| n.saturating_sub(WAYS as u32)).sum();
            let empty = load.iter().filter(|&&n| n == 0).count();
            assert!(
                over < (1 << 20) / 50,
                "{prefix:?}: {over} keys past full buckets"
            );
            assert!(
                empty < (buckets as usize) / 25,
                "{prefix:?}: {empty} empty buckets"
            );
        }
    }

    /// Guards the filter's size and bit choice: 2 bits a slot per half,
    /// every bit in range, and distinct keys of one bucket (the keys that
    /// share a bucket's tags) spread over the filter.
    #[test]
    fn filter_bits_are_in_range_and_spread() {
        assert_eq!(filter_words(1), 1);
        assert_eq!(filter_words(4), 1);
        assert_eq!(filter_words(1 << 17), 1 << 15);
        assert_eq!(
            u64::from(filter_words(1 << 17)) * 64,
            u64::from(FILTER_BITS_PER_SLOT) * (1 << 17) * WAYS as u64
        );
        let (buckets, words) = (1u32 << 10, filter_words(1 << 10));
        let mut seen = vec![0u64; words as usize];
        let mut in_bucket_zero = 0;
        for n in 0..1u32 << 16 {
            let key = FlowKey::v4(1, n.to_be_bytes(), [255; 4]);
            let h = hash(&key, 5);
            let (word, bit) = filter_bit(h, words);
            assert!(word < words && bit.count_ones() == 1);
            if bucket_of(h, buckets) == 0 {
                in_bucket_zero += 1;
                seen[word as usize] |= bit;
            }
        }
        // ~64 keys of one bucket: nearly as many distinct bits (a bit per
        // key would collide ~0.5 times among 64 in 16,384 bits).
        let distinct: u32 = seen.iter().map(|w| w.count_ones()).sum();
        assert!(in_bucket_zero > 30);
        assert!(
            distinct + 3 >= in_bucket_zero,
            "{distinct} of {in_bucket_zero}"
        );
    }

    fn gcra_rule() -> RuleConfig {
        RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            algorithm: algorithm::GCRA,
            ..RuleConfig::default()
        }
    }

    #[test]
    fn gcra_state_rests_once_its_tats_are_past() {
        let rule = gcra_rule();
        let mut state = KeyState::default();
        assert_eq!(at_rest_since(&state, &rule, 1_000, 0), Some(0));
        state.meters[0] = 1_001;
        assert_eq!(at_rest_since(&state, &rule, 1_000, 0), None);
        assert_eq!(at_rest_since(&state, &rule, 1_001, 0), Some(1_001));
        state.meters[1] = 2_000;
        assert_eq!(at_rest_since(&state, &rule, 1_500, 0), None);
        assert_eq!(at_rest_since(&state, &rule, 2_500, 0), Some(2_000));
        // A TAT with bit 31 set is a time, not a lock.
        state.meters[1] = WINDOW_LOCK | 1_000;
        assert_eq!(at_rest_since(&state, &rule, WINDOW_LOCK, 0), None);
        assert_eq!(
            at_rest_since(&state, &rule, WINDOW_LOCK | 1_000, 0),
            Some(WINDOW_LOCK | 1_000)
        );
        // A third limit's TAT keeps the key too.
        state.meters[2] = 3_000;
        assert_eq!(at_rest_since(&state, &rule, 2_500, 0), None);
        state.meters[2] = 0;
        state.meters[1] = 0;
        assert_eq!(at_rest_since(&state, &rule, 5_000, 0), Some(1_001));
    }

    #[test]
    fn window_state_rests_once_its_windows_are_over() {
        let window = Window::new(10, 1_000).unwrap_or_default();
        let mut rule = RuleConfig {
            flags: rule_flag::LIMIT_PACKETS,
            algorithm: algorithm::FIXED_WINDOW,
            ..RuleConfig::default()
        };
        rule.packets.window = window;
        let mut state = KeyState {
            meters: [5_000, 3, 0],
            ..KeyState::default()
        };
        // Realtime = monotonic + 4_000: the window ends at 6_000, monotonic 2_000.
        assert_eq!(at_rest_since(&state, &rule, 1_999, 4_000), None);
        assert_eq!(at_rest_since(&state, &rule, 2_000, 4_000), Some(2_000));
        rule.algorithm = algorithm::SLIDING_WINDOW;
        assert_eq!(at_rest_since(&state, &rule, 2_000, 4_000), None);
        assert_eq!(at_rest_since(&state, &rule, 3_000, 4_000), Some(3_000));
        // Counted in the window before only (sliding), or bytes only.
        state.meters = [5_000, 3 << 32, 0];
        assert_eq!(at_rest_since(&state, &rule, 2_999, 4_000), None);
        state.meters = [5_000, 0, 1];
        assert_eq!(at_rest_since(&state, &rule, 2_999, 4_000), None);
        // Nothing counted: at rest whatever the window; but not while a
        // CPU holds its lock, unless the caller is that CPU.
        state.meters = [5_000, 0, 0];
        assert_eq!(at_rest_since(&state, &rule, 0, 4_000), Some(0));
        state.meters = [5_000, WINDOW_LOCK, 0];
        assert_eq!(at_rest_since(&state, &rule, 0, 4_000), None);
    }

    #[test]
    fn window_counts_round_trip_without_the_lock() {
        let state = KeyState {
            meters: [
                7_000,
                (5 << 32) | WINDOW_LOCK | 9,
                (MAX_WINDOW_LIMIT << 32) | MAX_WINDOW_LIMIT,
            ],
            ..KeyState::default()
        };
        let packets = window_state(&state, 1);
        assert_eq!(
            packets,
            WindowState {
                start: 7_000,
                previous: 5,
                current: 9
            }
        );
        assert_eq!(pack_counts(&packets), (5 << 32) | 9);
        let bytes = window_state(&state, 2);
        assert_eq!(bytes.previous, MAX_WINDOW_LIMIT);
        assert_eq!(bytes.current, MAX_WINDOW_LIMIT);
        assert_eq!(pack_counts(&bytes), state.meters[2]);
        assert_eq!(pack_counts(&bytes) & WINDOW_LOCK, 0);
    }
}
