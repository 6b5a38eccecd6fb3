//! The key table (`limiter_common::keytable`): finding a key's state, and
//! claiming a slot for a new key.

use core::intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xchg};

use limiter_common::{
    abi::{FlowKey, GlobalConfig, GlobalCounters, KeyState, rule_slot},
    keytable::{self, Slot, Tags, WAYS, slot_index, tag},
};

use crate::maps::{KEY_TAGS, KEYS, RULES};

/// The key's bucket: its index and its tags; and the key's tag.
#[inline(always)]
fn place(config: &GlobalConfig, key: &FlowKey) -> Option<(u32, *mut Tags, u32)> {
    let hash = keytable::hash(key, config.key_seed);
    let bucket = keytable::bucket_of(hash, config.key_buckets);
    let tags = KEY_TAGS.get_ptr_mut(bucket)?;
    Some((bucket, tags, keytable::tag_of(hash)))
}

/// The key's state, if the table holds the key.
#[inline(always)]
pub fn find(config: &GlobalConfig, key: &FlowKey) -> Option<*mut KeyState> {
    let (bucket, tags, tag) = place(config, key)?;
    for way in 0..WAYS {
        let seen = unsafe { core::ptr::read_volatile(&raw const (*tags)[way]) };
        if seen != tag {
            continue;
        }
        if let Some(slot) = KEYS.get_ptr_mut(slot_index(bucket, way))
            && unsafe { same_key(&(*slot).key, key) }
        {
            return Some(unsafe { &raw mut (*slot).state });
        }
    }
    None
}

/// A slot for `key` in its bucket, reset to a new key's state: a free one,
/// else the one at rest the longest (counted in `key_evictions`); `None`
/// when every slot holds a key still in debt, or is being claimed, or
/// another CPU claimed the chosen slot first.
///
/// Two CPUs that both miss the same new key at once may claim two slots;
/// lookups then find the first, and the other goes to rest unused.
///
/// Not inlined: its own stack frame keeps the program within 512 bytes
/// (and a new key is the rare path).
#[inline(never)]
pub fn claim(
    config: &GlobalConfig,
    key: &FlowKey,
    now: u64,
    global: &mut GlobalCounters,
) -> Option<*mut KeyState> {
    let (bucket, tags, tag) = place(config, key)?;
    let mut chosen = WAYS;
    let mut chosen_tag = tag::FREE;
    let mut oldest = u64::MAX;
    for way in 0..WAYS {
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
            && let Some(since) = unsafe { rests_since(config, &*slot, now) }
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
    let tag_ptr = unsafe { &raw mut (*tags)[chosen & (WAYS - 1)] };
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
    unsafe {
        (*slot).key.rule = key.rule;
        (*slot).key.addr = key.addr;
        core::ptr::write_bytes(&raw mut (*slot).state, 0, 1);
        // A full barrier: a CPU that sees the tag sees the key written.
        atomic_xchg::<u32, { AtomicOrdering::SeqCst }>(tag_ptr, tag);
    }
    if chosen_tag != tag::FREE {
        global.key_evictions += 1;
    }
    Some(unsafe { &raw mut (*slot).state })
}

/// Since when a slot's key has been at rest under its rule in the active
/// generation (`keytable::at_rest_since`).
#[inline(always)]
fn rests_since(config: &GlobalConfig, slot: &Slot, now: u64) -> Option<u64> {
    let rule = RULES.get(rule_slot(config.generation, slot.key.rule))?;
    keytable::at_rest_since(&slot.state, rule, now, config.realtime_offset_ns)
}

/// Key equality word by word (no `memcmp` on this target).
#[inline(always)]
fn same_key(a: &FlowKey, b: &FlowKey) -> bool {
    let mut same = a.rule == b.rule;
    for i in 0..4 {
        let word = |k: &FlowKey| {
            u32::from_ne_bytes([
                k.addr[4 * i],
                k.addr[4 * i + 1],
                k.addr[4 * i + 2],
                k.addr[4 * i + 3],
            ])
        };
        same &= word(a) == word(b);
    }
    same
}
