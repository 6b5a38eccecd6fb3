//! The host's clocks as the limiter uses them: `CLOCK_MONOTONIC` (the clock
//! the XDP program reads and every GCRA state is kept in) and
//! `CLOCK_REALTIME` (window algorithms align to the Unix epoch).

use nix::time::{ClockId, clock_gettime};

/// Now on `CLOCK_MONOTONIC`, in ns.
pub fn monotonic_ns() -> u64 {
    read(ClockId::CLOCK_MONOTONIC)
}

/// Now on `CLOCK_REALTIME`, in ns of the Unix epoch.
pub fn realtime_ns() -> u64 {
    read(ClockId::CLOCK_REALTIME)
}

/// `CLOCK_REALTIME − CLOCK_MONOTONIC` in ns: what the kernel adds to its
/// monotonic clock to align windows to the epoch.
pub fn realtime_offset_ns() -> u64 {
    realtime_ns().wrapping_sub(monotonic_ns())
}

fn read(clock: ClockId) -> u64 {
    // Both clocks always exist on Linux; clock_gettime cannot fail for them.
    let now = clock_gettime(clock).expect("clock_gettime of a standard clock");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}
