//! The key table (`limiter_common::keytable`): finding a key's state, and
//! claiming a slot for a new key.

use core::{
    intrinsics::{AtomicOrdering, atomic_cxchg, atomic_or, atomic_xchg},
    ptr::NonNull,
};

use limiter_common::{
    abi::{FlowKey, GlobalConfig, GlobalCounters, algorithm, rule_slot},
    keytable::{self, Slot, Tags, WAYS, WINDOW_LOCK, filter_words, slot_index, tag},
};

use crate::maps::{KEY_FILTER, KEY_TAGS, KEYS, RULES};

/// The key's bucket: its index and its tags; and the key's tag.
#[inline(always)]
fn place(config: &GlobalConfig, hash: u64) -> Option<(u32, *mut Tags, u32)> {
    let bucket = keytable::bucket_of(hash, config.key_buckets);
    let tags = KEY_TAGS.get_ptr_mut(bucket)?;
    Some((bucket, tags, keytable::tag_of(hash)))
}

/// The key's slot, if the table holds the key. (`NonNull`, so `None` is a
/// null pointer: an `Option` of a raw pointer would carry an undefined
/// word when `None`, which the compiler may spill and the verifier then
/// refuses to read.)
#[inline(always)]
pub fn find(config: &GlobalConfig, key: &FlowKey) -> Option<NonNull<Slot>> {
    let hash = keytable::hash(key, config.key_seed);
    if !may_hold(config, hash) {
        return None;
    }
    let (bucket, tags, tag) = place(config, hash)?;
    // From the preferred way on (`keytable::preferred_way`). One lookup
    // of the slot found, wherever it was found: the verifier then walks
    // what follows once, not once per way that matched.
    let first = keytable::preferred_way(tag);
    let mut found = WAYS;
    for i in 0..WAYS {
        let way = (first + i) & (WAYS - 1);
        // SAFETY: `tags` is this bucket's `KEY_TAGS` value (`place`), which other
        // CPUs and userspace change by CAS, and `way` < WAYS: one volatile load
        // of an aligned u32.
        let seen = unsafe { core::ptr::read_volatile(&raw const (*tags)[way]) };
        if seen != tag {
            continue;
        }
        // SAFETY: `slot` is a `KEYS` value, allocated while the program runs; its
        // key is only read (aligned loads: a claim racing them makes the answer
        // stale, as a lookup an instant earlier would be, not unsound).
        if let Some(slot) = KEYS.get_ptr(slot_index(bucket, way))
            && unsafe { same_key(&raw const (*slot).key, key) }
        {
            found = way;
            break;
        }
    }
    if found >= WAYS {
        return None;
    }
    NonNull::new(KEYS.get_ptr_mut(slot_index(bucket, found))?)
}

/// Whether the table may hold the key of `hash`: its bit in the active
/// half of the presence filter (`keytable::filter_words`). A source never
/// stored, which is what a forged source is, costs this one small load
/// instead of a miss in the tags.
#[inline(always)]
fn may_hold(config: &GlobalConfig, hash: u64) -> bool {
    let words = filter_words(config.key_buckets);
    let (word, bit) = keytable::filter_bit(hash, words);
    let half = if config.key_filter != 0 { words } else { 0 };
    // SAFETY: a word of `KEY_FILTER`, an aligned u64 of a map value that
    // other CPUs and userspace change: one volatile load.
    KEY_FILTER
        .get(half + word)
        .is_none_or(|bits| unsafe { core::ptr::read_volatile(bits) } & bit != 0)
}

/// Sets the bit of `hash` in both halves of the filter, after the key's
/// tag is published: a rebuild that read the slot before it was published
/// cleared its half before that read, so this comes after the clearing.
#[inline(always)]
fn remember(config: &GlobalConfig, hash: u64) {
    let words = filter_words(config.key_buckets);
    let (word, bit) = keytable::filter_bit(hash, words);
    for half in [0, words] {
        if let Some(bits) = KEY_FILTER.get_ptr_mut(half + word) {
            // SAFETY: a word of `KEY_FILTER` (an aligned u64 of a map value) that
            // other CPUs set bits in too: an atomic or.
            unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(bits, bit) };
        }
    }
}

/// A slot for `key` in its bucket, reset to a new key's state: a free one,
/// else the one at rest the longest (counted in `key_evictions`); `None`
/// when every slot holds a key still in debt, or is being claimed, or
/// another CPU changed the chosen slot first.
///
/// Two CPUs that both miss the same new key at once may claim two slots;
/// lookups then find one, and only the packets in flight at that instant
/// were charged to the other.
///
/// A function of its own (a BPF subprogram: five arguments at most, so it
/// returns a plain pointer, null for none): its stack frame keeps the
/// program within 512 bytes, and a new key is the rare path.
#[inline(never)]
pub fn claim(
    config: &GlobalConfig,
    generation: u32,
    key: &FlowKey,
    now: u64,
    global: &mut GlobalCounters,
) -> *mut Slot {
    claim_slot(config, generation, key, now, global).unwrap_or_default()
}

#[inline(always)]
fn claim_slot(
    config: &GlobalConfig,
    generation: u32,
    key: &FlowKey,
    now: u64,
    global: &mut GlobalCounters,
) -> Option<*mut Slot> {
    let hash = keytable::hash(key, config.key_seed);
    let (bucket, tags, tag) = place(config, hash)?;
    let mut chosen = WAYS;
    let mut chosen_tag = tag::FREE;
    let mut oldest = u64::MAX;
    // The first free way from the preferred one on (so the preferred way
    // when free: see `keytable::preferred_way`), else the one at rest the
    // longest.
    let first = keytable::preferred_way(tag);
    for i in 0..WAYS {
        let way = (first + i) & (WAYS - 1);
        // SAFETY: as in `find`: an aligned u32 of this bucket's `KEY_TAGS`
        // value, `way` < WAYS, read with one volatile load.
        let seen = unsafe { core::ptr::read_volatile(&raw const (*tags)[way]) };
        if seen == tag::FREE {
            chosen = way;
            chosen_tag = seen;
            break;
        }
        if seen == tag::CLAIMED {
            continue;
        }
        if let Some(slot) = KEYS.get_ptr(slot_index(bucket, way))
            // SAFETY: `slot` is a `KEYS` value, allocated while the program runs;
            // its rule id is only read (at worst stale: an index `RULES.get` checks).
            && let Some(rule) = RULES.get(rule_slot(generation, unsafe { (*slot).key.rule_id() }))
            && let Some(since) = keytable::at_rest_since(
                // SAFETY: the same slot's state, only read, which other CPUs update: at
                // worst stale, and `seize` checks the chosen slot again with atomics.
                unsafe { &(*slot).state },
                rule,
                now,
                config.realtime_offset_ns,
            )
            && since < oldest
        {
            chosen = way;
            chosen_tag = seen;
            oldest = since;
        }
    }
    if chosen >= WAYS {
        return None;
    }
    let slot = KEYS.get_ptr_mut(slot_index(bucket, chosen))?;
    // SAFETY: `tags` is this bucket's `KEY_TAGS` value (`place`), the index
    // below WAYS: only the address of the chosen way's tag is taken.
    let tag_ptr = unsafe { &raw mut (*tags)[chosen & (WAYS - 1)] };
    // SAFETY: an aligned u32 of a map value that other CPUs and userspace
    // change by CAS too: this CAS gives the slot to one claimer only.
    let (_, won) = unsafe {
        atomic_cxchg::<u32, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            tag_ptr,
            chosen_tag,
            tag::CLAIMED,
        )
    };
    if !won {
        return None;
    }
    if chosen_tag != tag::FREE && !seize(config, generation, slot, now) {
        // SAFETY: the tag our CAS made `CLAIMED`, restored atomically, as other
        // CPUs and userspace read it.
        unsafe { atomic_xchg::<u32, { AtomicOrdering::SeqCst }>(tag_ptr, chosen_tag) };
        return None;
    }
    // SAFETY: the tag CAS above gave this CPU the slot exclusively (no lookup
    // matches `CLAIMED`, no claim or userspace free takes it); a CPU that found
    // the old key may still store a count or its block epoch (one aligned word:
    // a miscount at worst). The exchange then publishes the tag.
    unsafe {
        (*slot).key.rule = key.rule;
        (*slot).key.addr = key.addr;
        (*slot).block_epoch = 0;
        // Zeroes the window lock `seize` took too.
        core::ptr::write_bytes(&raw mut (*slot).state, 0, 1);
        // A full barrier: a CPU that sees the tag sees the key written.
        atomic_xchg::<u32, { AtomicOrdering::SeqCst }>(tag_ptr, tag);
    }
    remember(config, hash);
    if chosen_tag != tag::FREE {
        global.key_evictions += 1;
    }
    Some(slot)
}

/// Takes an occupied slot's state from any CPU still metering its old key
/// (found before the claim): for windows, takes the key's window lock and
/// checks again that it is at rest; for GCRA, swaps each TAT (the third
/// word's too) for `u64::MAX`, so a charge in flight fails its
/// compare-and-swap and then finds no budget. `false` (and the state as
/// it was) if anything moved meanwhile. (No other CPU can seize it at
/// once: the tag is `CLAIMED`.)
#[inline(always)]
fn seize(config: &GlobalConfig, generation: u32, slot: *mut Slot, now: u64) -> bool {
    // SAFETY: `slot` is the `KEYS` value whose tag the caller made `CLAIMED`,
    // so no other CPU rewrites its key; of its state, which other CPUs still
    // update, only the address is taken.
    let state = unsafe { &raw mut (*slot).state };
    let Some(rule) = RULES.get(rule_slot(generation, unsafe { (*slot).key.rule_id() })) else {
        return false;
    };
    if rule.algorithm != algorithm::GCRA {
        // Windows change only under the lock: at rest now, at rest until
        // the caller zeroes them (which releases the lock).
        // SAFETY: the key's packets word, an aligned u64 of the slot that other
        // CPUs lock too: its address, then one volatile load.
        let lock = unsafe { &raw mut (*state).meters[1] };
        let seen = unsafe { core::ptr::read_volatile(lock) };
        if seen & WINDOW_LOCK != 0 {
            return false;
        }
        // SAFETY: the same word, taken with an atomic compare-and-swap.
        let (_, locked) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Acquire }, { AtomicOrdering::Relaxed }>(
                lock,
                seen,
                seen | WINDOW_LOCK,
            )
        };
        if !locked {
            return false;
        }
        // As it is under the lock we hold, with the lock bit clear.
        // SAFETY: the window lock taken above keeps other writers off the meters;
        // the pass/drop counts beside them may race (plain aligned words, a stale
        // count at worst), and `at_rest_since` does not read them.
        let mut unlocked = unsafe { *state };
        unlocked.meters[1] = seen;
        let at_rest = keytable::at_rest_since(&unlocked, rule, now, config.realtime_offset_ns);
        if at_rest.is_none() {
            // SAFETY: the lock word taken above, released atomically as it was.
            unsafe { atomic_xchg::<u64, { AtomicOrdering::Release }>(lock, seen) };
        }
        return at_rest.is_some();
    }
    // GCRA charges without a lock: at rest means every TAT at or before
    // now, which each swap checks against the value it replaces. The
    // third word too (a third or soft limit's): a charge in flight there
    // would otherwise land on the new key's fresh word.
    // SAFETY: the slot's three TAT words (aligned u64s other CPUs CAS):
    // addresses only; `poison` changes them atomically.
    let packets = unsafe { &raw mut (*state).meters[0] };
    let bytes = unsafe { &raw mut (*state).meters[1] };
    let third = unsafe { &raw mut (*state).meters[2] };
    let Some(packets_tat) = poison(packets, now) else {
        return false;
    };
    let Some(bytes_tat) = poison(bytes, now) else {
        // SAFETY: the packets TAT `poison` swapped, restored atomically.
        unsafe { atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(packets, packets_tat) };
        return false;
    };
    if poison(third, now).is_none() {
        // SAFETY: the TATs `poison` swapped, restored atomically.
        unsafe {
            atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(packets, packets_tat);
            atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(bytes, bytes_tat);
        }
        return false;
    }
    true
}

/// Swaps a TAT at or before `now` for `u64::MAX`; the TAT it replaced, or
/// `None` if it was later than `now` or changed meanwhile.
#[inline(always)]
fn poison(tat: *mut u64, now: u64) -> Option<u64> {
    // SAFETY: `tat` is a TAT word of a claimed slot (`seize`), an aligned u64
    // of a `KEYS` value that other CPUs CAS: one volatile load.
    let seen = unsafe { core::ptr::read_volatile(tat) };
    if seen > now {
        return None;
    }
    // SAFETY: the same word, swapped with an atomic compare-and-swap.
    let (_, swapped) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            tat,
            seen,
            u64::MAX,
        )
    };
    swapped.then_some(seen)
}

/// Key equality word by word (no `memcmp` on this target; `FlowKey` is
/// five aligned u32s, where its fields would be read the address byte by
/// byte), as one difference tested once: BPF has no set-on-compare, so a
/// comparison per word is a branch per word, and the verifier walks the
/// rest of the lookup once for each way those branches can fall. Raw
/// pointers: both callers compare keys in map memory other CPUs write.
///
/// # Safety
/// Both point to readable keys.
#[inline(always)]
pub unsafe fn same_key(a: *const FlowKey, b: *const FlowKey) -> bool {
    let (a, b) = (a.cast::<u32>(), b.cast::<u32>());
    let mut difference = 0;
    for i in 0..5 {
        // SAFETY: as the caller vouches, within the key's five words.
        difference |= unsafe { a.add(i).read() ^ b.add(i).read() };
    }
    difference == 0
}
