//! Where layer 7 reads the time: the trait the limiter asks, so tests can
//! drive their own clocks, and the system's.

/// Where the limiter reads the time: monotonic ns for GCRA, Unix-epoch ns
/// for windows (aligned to the epoch, as envoy's). Tests drive their own.
pub trait Clock: Send + Sync {
    fn monotonic_ns(&self) -> u64;
    fn epoch_ns(&self) -> u64;
}

/// The system's clocks: `CLOCK_MONOTONIC` read from the CPU's counter
/// ([`crate::clock::counter_monotonic_ns`]).
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn monotonic_ns(&self) -> u64 {
        crate::clock::counter_monotonic_ns()
    }

    fn epoch_ns(&self) -> u64 {
        crate::clock::realtime_ns()
    }
}
