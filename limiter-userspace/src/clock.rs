//! The host's clocks as the limiter uses them: `CLOCK_MONOTONIC` (the clock
//! the XDP program reads and every GCRA state is kept in) and
//! `CLOCK_REALTIME` (window algorithms align to the Unix epoch).

use std::sync::OnceLock;

use nix::time::ClockId;

/// Now on `CLOCK_MONOTONIC`, in ns.
pub fn monotonic_ns() -> u64 {
    read(ClockId::CLOCK_MONOTONIC)
}

/// Now on `CLOCK_MONOTONIC`, in ns, read from the CPU's counter (the
/// invariant TSC, through `quanta`) rather than the vDSO: layer 7 reads
/// the time at every request, and the vDSO's read is a fifth of a
/// decision there. Anchored to `CLOCK_MONOTONIC` at first use and
/// advancing at the counter's rate as calibrated against it, so it can
/// part from `CLOCK_MONOTONIC` by the calibration's error (parts per
/// million: measured by `clock_tests`); nothing compares the two without
/// converting a span (`http::fleet`). Where the CPU has no invariant
/// counter, quanta reads `CLOCK_MONOTONIC` itself.
pub fn counter_monotonic_ns() -> u64 {
    let counter = Counter::get();
    counter.anchor_ns.wrapping_add(
        counter
            .clock
            .delta_as_nanos(counter.anchor_raw, counter.clock.raw()),
    )
}

/// The counter and the reading of both clocks it is anchored to.
struct Counter {
    clock: quanta::Clock,
    anchor_raw: u64,
    anchor_ns: u64,
}

impl Counter {
    #[inline(always)]
    fn get() -> &'static Self {
        static COUNTER: OnceLock<Counter> = OnceLock::new();
        // Calibration runs once, at the first read (up to 200 ms: callers
        // read once at start-up, see `http::SystemClock`).
        COUNTER.get_or_init(|| {
            let clock = quanta::Clock::new();
            let anchor_raw = clock.raw();
            Counter {
                anchor_ns: monotonic_ns(),
                anchor_raw,
                clock,
            }
        })
    }
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
    // Every request reads it: straight to the vDSO, without a `Result`
    // (these clocks always exist on Linux; clock_gettime cannot fail).
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(clock.as_raw(), &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

#[cfg(test)]
mod clock_tests {
    use std::time::Duration;

    use super::*;

    /// The counter's clock keeps to `CLOCK_MONOTONIC`: within 100 µs
    /// once anchored, and within 200 ppm of the time since over a quarter
    /// of a second.
    #[test]
    fn the_counter_keeps_to_clock_monotonic() {
        // Calibrated and anchored by the first read.
        counter_monotonic_ns();
        let between = || {
            let before = monotonic_ns();
            let counter = counter_monotonic_ns();
            (before, counter, monotonic_ns())
        };
        let (before, start, after) = between();
        assert!(
            start + 100_000 >= before && start <= after + 100_000,
            "counter {start} ns, CLOCK_MONOTONIC {before}..{after} ns"
        );
        std::thread::sleep(Duration::from_millis(250));
        let (before, counter, after) = between();
        let elapsed = counter - start;
        let slack = (after - start) / 5_000 + 100_000;
        assert!(
            counter + slack >= before && counter <= after + slack,
            "after {elapsed} ns: counter {counter} ns, CLOCK_MONOTONIC {before}..{after} ns"
        );
    }

    #[test]
    fn the_counter_never_goes_back_on_one_thread() {
        let mut last = counter_monotonic_ns();
        for _ in 0..100_000 {
            let now = counter_monotonic_ns();
            assert!(now >= last, "{now} after {last}");
            last = now;
        }
    }
}
