//! A counter that many threads add to without sharing a cache line, and
//! mostly without a locked instruction: a rule's counts are added to at
//! every request, from every worker. One `AtomicU64` between two CPUs moved
//! its line back and forth at every request. As the kernel's per-CPU
//! counters, each of the first threads has a stripe it alone writes.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Stripes each written by one thread alone (the first threads to count:
/// a proxy's workers).
const OWNED: usize = 8;
/// Stripes later threads share, taking them in turn, added to atomically
/// (a host with more CPUs than owned stripes runs more workers).
const SHARED: usize = 8;

/// One stripe on a cache line of its own.
#[derive(Default)]
#[repr(align(64))]
struct Stripe(AtomicU64);

#[derive(Default)]
pub struct StripedCounter([Stripe; OWNED + SHARED]);

impl StripedCounter {
    /// Adds `n` on the calling thread's stripe.
    #[inline]
    pub fn add(&self, n: u64) {
        self.add_on(stripe(), n);
    }

    /// Adds `n` on stripe `s`: below [`OWNED`], a stripe only one thread
    /// ever writes, so a read and a store count exactly.
    #[inline]
    fn add_on(&self, s: usize, n: u64) {
        let stripe = &self.0[s].0;
        if s < OWNED {
            stripe.store(
                stripe.load(Ordering::Relaxed).wrapping_add(n),
                Ordering::Relaxed,
            );
        } else {
            stripe.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The count: every stripe's, summed.
    pub fn get(&self) -> u64 {
        self.0
            .iter()
            .fold(0, |sum, s| sum.wrapping_add(s.0.load(Ordering::Relaxed)))
    }
}

/// The calling thread's stripe: its own for the first [`OWNED`] threads
/// (never handed to another, even after the thread ends), shared ones in
/// turn after.
#[inline]
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        // (Stops counting threads at the end of `usize`, not wrapping back
        // to the owned stripes.)
        static STRIPE: usize = stripe_of(
            NEXT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1))
                .unwrap_or(usize::MAX),
        );
    }
    STRIPE.with(|s| *s)
}

/// The stripe of the `n`th thread to count.
fn stripe_of(n: usize) -> usize {
    if n < OWNED {
        n
    } else {
        OWNED + (n - OWNED) % SHARED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every add of every thread is counted: on stripes each thread owns,
    /// and on the shared one many threads add to at once.
    #[test]
    fn counts_every_add_of_every_thread() {
        let counter = StripedCounter::default();
        std::thread::scope(|scope| {
            for t in 0..20u64 {
                let counter = &counter;
                scope.spawn(move || {
                    // Threads 0-7 each on a stripe of their own, the rest
                    // on the shared ones.
                    let s = stripe_of(t as usize);
                    for _ in 0..10_000 {
                        counter.add_on(s, t + 1);
                    }
                });
            }
        });
        assert_eq!(counter.get(), 10_000 * (1..=20).sum::<u64>());
    }

    /// No two threads are given one owned stripe, however many start at
    /// once (other tests of this binary may have taken some already).
    #[test]
    fn each_owned_stripe_has_one_thread() {
        let taken = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..3 * OWNED {
                scope.spawn(|| taken.lock().unwrap().push(stripe()));
            }
        });
        let mut owned: Vec<usize> = taken.into_inner().unwrap();
        assert!(owned.iter().all(|&s| s < OWNED + SHARED), "{owned:?}");
        owned.retain(|&s| s < OWNED);
        let n = owned.len();
        owned.sort_unstable();
        owned.dedup();
        assert_eq!(owned.len(), n, "an owned stripe given twice");
        // Threads past the owned ones take the shared ones in turn.
        let later: Vec<usize> = (OWNED..OWNED + 2 * SHARED).map(stripe_of).collect();
        assert!((OWNED..OWNED + SHARED).all(|s| later.iter().filter(|&&t| t == s).count() == 2));
    }

    /// Threads past the owned stripes count on the shared ones.
    #[test]
    fn threads_past_the_owned_stripes_are_counted_too() {
        let counter = StripedCounter::default();
        std::thread::scope(|scope| {
            for _ in 0..3 * OWNED {
                scope.spawn(|| {
                    for _ in 0..1_000 {
                        counter.add(1);
                    }
                });
            }
        });
        assert_eq!(counter.get(), 3_000 * OWNED as u64);
    }
}
