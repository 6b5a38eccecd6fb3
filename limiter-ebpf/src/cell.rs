//! The kernel side of `limiter_common::meter::AtomicCell`, and counters
//! shared between CPUs.

use core::{
    cell::UnsafeCell,
    intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xadd, atomic_xchg},
};
use limiter_common::{keytable::WINDOW_LOCK, meter::AtomicCell};

/// A `u64` inside a map value that other CPUs update: read with one load,
/// changed only with the BPF `cmpxchg` instruction. Shared memory, so an
/// `UnsafeCell` (as `AtomicU64` is) reached by shared references, never
/// by `&mut`.
#[repr(transparent)]
pub struct MapCell(UnsafeCell<u64>);

impl MapCell {
    /// The cell at `word`.
    ///
    /// # Safety
    /// `word` is a map lookup's pointer to an aligned u64 of an array or
    /// hash map value (an `ADMISSIONS` TAT, a key's or an aggregate's
    /// meter), which stays allocated while the program runs: the
    /// reference must not outlive the run.
    #[inline(always)]
    pub unsafe fn at<'a>(word: *mut u64) -> &'a MapCell {
        // SAFETY: as the caller vouches; `MapCell` is a transparent u64.
        unsafe { &*word.cast::<MapCell>() }
    }
}

impl AtomicCell for MapCell {
    #[inline(always)]
    fn load(&self) -> u64 {
        // SAFETY: an aligned u64 of a map value (`MapCell::at`); a volatile
        // read of it is one 8-byte BPF load, atomic against other CPUs'
        // compare-and-swap.
        unsafe { core::ptr::read_volatile(self.0.get()) }
    }

    #[inline(always)]
    fn compare_exchange(&self, current: u64, new: u64) -> Result<(), u64> {
        // SAFETY: the aligned u64 of a map value that `load` reads, which other
        // CPUs update too: changed only by this atomic BPF_CMPXCHG (cpu v3).
        let (seen, swapped) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                self.0.get(),
                current,
                new,
            )
        };
        if swapped { Ok(()) } else { Err(seen) }
    }
}

/// Adds `n` to a counter that several CPUs update (BPF atomic add).
#[inline(always)]
pub fn add_shared(counter: *mut u64, n: u64) {
    // SAFETY: callers pass an aligned u64 of a map value (a `Block`'s
    // `dropped_packets`) that other CPUs add to at once: a BPF atomic add.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counter, n) };
}

/// How often taking a held lock is retried. The holder is another CPU in
/// the middle of a few dozen instructions (XDP does not sleep or migrate).
const LOCK_ATTEMPTS: usize = 64;

/// Takes a lock word (0 free, 1 held); `false` if it stayed held.
#[inline(always)]
pub fn lock(word: *mut u32) -> bool {
    for _ in 0..LOCK_ATTEMPTS {
        // SAFETY: `word` is an aggregate's `lock`, an aligned u32 of an
        // `AGGREGATES` value that other CPUs take too: changed only atomically.
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
    // SAFETY: the lock word `lock` took (an aligned u32 of an `AGGREGATES`
    // value), released with an atomic exchange, as other CPUs CAS it.
    unsafe { atomic_xchg::<u32, { AtomicOrdering::Release }>(word, 0) };
}

/// Takes a window key's lock (bit [`WINDOW_LOCK`] of its packets word);
/// the word as it was (its counts), or `None` if it stayed held.
#[inline(always)]
pub fn lock_window(word: *mut u64) -> Option<u64> {
    for _ in 0..LOCK_ATTEMPTS {
        // SAFETY: `word` is a key's packets word (`KeyState::meters[1]` of a
        // `KEYS` slot), an aligned u64 that other CPUs lock too: one volatile
        // 8-byte load, then an atomic compare-and-swap.
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
    // SAFETY: the packets word `lock_window` locked (an aligned u64 of a
    // `KEYS` slot), released with an atomic exchange, as other CPUs CAS it.
    unsafe { atomic_xchg::<u64, { AtomicOrdering::Release }>(word, counts) };
}
