//! A refused frame counted on its key (`KeyState::dropped_packets`, read
//! by `limiter top` and by escalation), without writing the key's slot
//! for every frame of a flood: this CPU's entry of `PENDING_DROPS` counts
//! the key it refuses most (see `PendingDrops`).
//!
//! Each change of the entry other than a count going up is bracketed by
//! two atomic increments of its `flushes` (odd meanwhile): a reader of the
//! entries and the slots (`KeyTable::visit`) reads the entries' `flushes`,
//! then the entries, then the slots, then `flushes` again, and reads again
//! if it saw a change, so that a count moved meanwhile is not seen both on
//! the entry and on a slot.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use limiter_common::{
    abi::{FlowKey, GlobalConfig, PendingDrops},
    keytable::Slot,
};

use crate::{keys, maps::PENDING_DROPS};

/// Counts one refusal on the key of `slot` (a `KEYS` value).
///
/// A BPF subprogram: its paths end at its return, where the verifier
/// finds them alike (its frame gone) and walks the rest of the decision
/// once, not once per path through here (inlined, this cost the decision
/// half its verified instructions again).
#[inline(never)]
pub fn count(slot: *mut Slot) {
    // SAFETY: the slot's count, an aligned u32 of a `KEYS` value.
    let dropped = unsafe { &raw mut (*slot).state.dropped_packets };
    let Some(pending) = PENDING_DROPS.get_ptr_mut(0) else {
        add(dropped, 1);
        return;
    };
    // SAFETY: `pending` is this CPU's `PENDING_DROPS` value, which only this
    // CPU's running program writes (XDP runs to the end on its CPU); the
    // slot's key is only read (a claim racing it makes this refusal count on
    // the entry's key or the slot's, as a refusal an instant earlier would).
    unsafe {
        let key = &raw const (*slot).key;
        let held = (*pending).count;
        let others = (*pending).others;
        // Without short-circuits: each branch here doubles the paths the
        // verifier walks through the rest of the decision. (Counts wrap as
        // the slots' do: readers add them modulo 2^32, so none is moved for
        // its size.)
        let holds = held != 0;
        if holds & keys::same_key(&raw const (*pending).key, key) {
            (*pending).count = held.wrapping_add(1);
            if others != 0 {
                (*pending).others = 0;
            }
            return;
        }
        // Kept by a key refused here lately, or the former key's count not
        // yet moved (the entry taken only with no count waiting, even when
        // its own count wrapped to 0): this refusal goes to its slot.
        if (holds & (others < PendingDrops::TAKE_OVER_AFTER)) | ((*pending).old_count != 0) {
            (*pending).others = others.saturating_add(1);
            add(dropped, 1);
            return;
        }
        // The key refused now takes the entry; the former key's count (none
        // if the entry was free) waits for the report program (`move_old`).
        changing(pending);
        (&raw mut (*pending).old_key).write_volatile((*pending).key);
        (&raw mut (*pending).old_count).write_volatile(held);
        copy_words(key, &raw mut (*pending).key);
        (&raw mut (*pending).count).write_volatile(1);
        (*pending).others = 0;
        changing(pending);
    }
}

/// Copies a key word by word, with volatile stores (see `changing`).
///
/// # Safety
/// `from` is readable, `to` writable.
#[inline(always)]
unsafe fn copy_words(from: *const FlowKey, to: *mut FlowKey) {
    let (from, to) = (from.cast::<u32>(), to.cast::<u32>());
    for i in 0..5 {
        // SAFETY: as the caller vouches, within the key's five words.
        unsafe { to.add(i).write_volatile(from.add(i).read()) };
    }
}

/// Whether a former key's count waits to be moved to its slot.
#[inline(always)]
pub fn old_waiting() -> bool {
    PENDING_DROPS.get(0).is_some_and(|p| p.old_count != 0)
}

/// Adds the former key's waiting count to its slot, if the table still
/// holds the key (else the count went with it). The report program's.
#[inline(always)]
pub fn move_old(config: &GlobalConfig) {
    let Some(pending) = PENDING_DROPS.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's `PENDING_DROPS` value (see `count`).
    unsafe {
        let held = (*pending).old_count;
        if held == 0 {
            return;
        }
        let key: FlowKey = (*pending).old_key;
        changing(pending);
        if let Some(slot) = keys::find(config, &key) {
            add(&raw mut (*slot.as_ptr()).state.dropped_packets, held);
        }
        (&raw mut (*pending).old_count).write_volatile(0);
        changing(pending);
    }
}

/// One of the two increments of `flushes` around a change of the entry.
///
/// # Safety
/// `pending` is this CPU's `PENDING_DROPS` value.
#[inline(always)]
unsafe fn changing(pending: *mut PendingDrops) {
    // SAFETY: as the caller vouches. An atomic add (a fully ordered BPF
    // atomic, as `flushes` is read by userspace meanwhile); the change's
    // other stores are volatile, so that the compiler keeps them between
    // the two (BPF has no compiler fence).
    unsafe {
        atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(&raw mut (*pending).flushes, 1);
    }
}

/// A plain add: a key's counts may lose an increment to another CPU's at
/// the same instant, as `KeyState::passed_packets` says.
#[inline(always)]
fn add(count: *mut u32, n: u32) {
    // SAFETY: callers pass an aligned u32 of a `KEYS` value. Volatile: see
    // `changing`.
    unsafe { count.write_volatile(count.read().wrapping_add(n)) };
}
