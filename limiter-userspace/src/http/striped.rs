//! A counter that many threads add to without sharing a cache line: a
//! rule's counts are added to at every request, from every worker, and
//! one `AtomicU64` between two CPUs moved its line back and forth at
//! every request (the kernel's counters are per CPU for the same reason).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Stripes a counter has: threads beyond this many share stripes (still
/// counted exactly, atomically).
const STRIPES: usize = 8;

/// One stripe on a cache line of its own.
#[derive(Default)]
#[repr(align(64))]
struct Stripe(AtomicU64);

#[derive(Default)]
pub struct StripedCounter([Stripe; STRIPES]);

impl StripedCounter {
    /// Adds `n` on the calling thread's stripe.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0[stripe()].0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count: every stripe's, summed.
    pub fn get(&self) -> u64 {
        self.0
            .iter()
            .fold(0, |sum, s| sum.wrapping_add(s.0.load(Ordering::Relaxed)))
    }
}

/// The calling thread's stripe: threads take stripes in turn.
#[inline]
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn counts_every_add_of_every_thread() {
        let counter = Arc::new(StripedCounter::default());
        std::thread::scope(|scope| {
            for t in 0..20u64 {
                let counter = &counter;
                scope.spawn(move || {
                    for _ in 0..1_000 {
                        counter.add(t + 1);
                    }
                });
            }
        });
        assert_eq!(counter.get(), 1_000 * (1..=20).sum::<u64>());
    }
}
