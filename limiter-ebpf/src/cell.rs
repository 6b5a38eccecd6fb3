//! The kernel side of `limiter_common::meter::AtomicCell`, and counters
//! shared between CPUs.

use core::intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xadd, atomic_xchg};
use limiter_common::{keytable::WINDOW_LOCK, meter::AtomicCell};

/// A `u64` inside a map value, updated with the BPF `cmpxchg` instruction.
pub struct MapCell(pub *mut u64);

impl AtomicCell for MapCell {
    #[inline(always)]
    fn load(&self) -> u64 {
        // An aligned 64-bit load is atomic on BPF.
        unsafe { core::ptr::read_volatile(self.0) }
    }

    #[inline(always)]
    fn compare_exchange(&self, current: u64, new: u64) -> Result<(), u64> {
        let (seen, swapped) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                self.0, current, new,
            )
        };
        if swapped { Ok(()) } else { Err(seen) }
    }
}

/// Adds `n` to a counter that several CPUs update (BPF atomic add).
#[inline(always)]
pub fn add_shared(counter: *mut u64, n: u64) {
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, n) };
}

/// How often taking a held lock is retried. The holder is another CPU in
/// the middle of a few dozen instructions (XDP does not sleep or migrate).
const LOCK_ATTEMPTS: usize = 64;

/// Takes a lock word (0 free, 1 held); `false` if it stayed held.
#[inline(always)]
pub fn lock(word: *mut u32) -> bool {
    for _ in 0..LOCK_ATTEMPTS {
        let (_, taken) = unsafe {
            atomic_cxchg::<u32, { AtomicOrdering::Acquire }, { AtomicOrdering::Relaxed }>(
                word, 0, 1,
            )
        };
        if taken {
            return true;
        }
    }
    false
}

/// Releases a lock word taken with [`lock`]; the exchange orders the
/// state's writes before the release.
#[inline(always)]
pub fn unlock(word: *mut u32) {
    unsafe { atomic_xchg::<u32, { AtomicOrdering::Release }>(word, 0) };
}

/// Takes a window key's lock (bit [`WINDOW_LOCK`] of its packets word);
/// the word as it was (its counts), or `None` if it stayed held.
#[inline(always)]
pub fn lock_window(word: *mut u64) -> Option<u64> {
    for _ in 0..LOCK_ATTEMPTS {
        let seen = unsafe { core::ptr::read_volatile(word) } & !WINDOW_LOCK;
        let (_, taken) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Acquire }, { AtomicOrdering::Relaxed }>(
                word,
                seen,
                seen | WINDOW_LOCK,
            )
        };
        if taken {
            return Some(seen);
        }
    }
    None
}

/// Releases a window key's lock, storing its packets word `counts` (the
/// lock bit clear); the exchange orders the state's writes before it.
#[inline(always)]
pub fn unlock_window(word: *mut u64, counts: u64) {
    unsafe { atomic_xchg::<u64, { AtomicOrdering::Release }>(word, counts) };
}
