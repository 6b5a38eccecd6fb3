//! The host's clocks as the limiter uses them: `CLOCK_MONOTONIC` (the clock
//! the XDP program reads and every GCRA state is kept in) and
//! `CLOCK_REALTIME` (window algorithms align to the Unix epoch).

use std::{cell::Cell, sync::OnceLock, time::Duration};

use nix::time::ClockId;

/// How long after a switch (a generation flip, the key filter's halves, a
/// layer-7 rule swap) what was switched from may still be read by work
/// already under way (an XDP run takes microseconds, a decision less:
/// this is a wide margin). Only after it is the old state touched again.
pub const GRACE: Duration = Duration::from_millis(20);

/// Now on `CLOCK_MONOTONIC`, in ns.
pub fn monotonic_ns() -> u64 {
    read(ClockId::CLOCK_MONOTONIC)
}

/// Now on `CLOCK_MONOTONIC`, in ns, at the cost of a read of the CPU's
/// counter (the invariant TSC, through `quanta`) rather than of the vDSO:
/// layer 7 reads the time at every request, and the vDSO's read is a
/// fifth of a decision there. Each thread anchors the counter to
/// `CLOCK_MONOTONIC` and reads it again once a [`REANCHOR_NS`], so the
/// counter only measures spans under a millisecond: a calibration a few
/// parts per million off (or one taken while NTP slewed the clock) parts
/// from `CLOCK_MONOTONIC` by nanoseconds, never by more as uptime grows,
/// and the rate it keeps is `CLOCK_MONOTONIC`'s. Never goes back on one
/// thread. Where the CPU has no invariant counter, quanta reads
/// `CLOCK_MONOTONIC` itself.
#[inline]
pub fn counter_monotonic_ns() -> u64 {
    thread_local! {
        static ANCHOR: Cell<Anchor> = const { Cell::new(Anchor::NONE) };
    }
    let counter = counter();
    let raw = counter.raw();
    ANCHOR.with(|cell| {
        let mut anchor = cell.get();
        let now = anchor.now(
            raw,
            |from, to| counter.delta_as_nanos(from, to),
            || reanchor(counter),
        );
        cell.set(anchor);
        now
    })
}

/// How long a thread's anchor serves before `CLOCK_MONOTONIC` is read
/// again (a vDSO read a millisecond, per thread, costs nothing).
pub const REANCHOR_NS: u64 = 1_000_000;

/// The process's counter, calibrated at its first use (up to 200 ms:
/// callers read once at start-up, see `http::Limiter::new`).
fn counter() -> &'static quanta::Clock {
    static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();
    COUNTER.get_or_init(quanta::Clock::new)
}

/// Both clocks read together: the counter's reading (the middle of two
/// reads around `CLOCK_MONOTONIC`'s) and `CLOCK_MONOTONIC`'s. A thread
/// preempted between the reads would pair readings apart in time, so
/// pairs more than 2 µs apart are read again (thrice at most).
fn reanchor(counter: &quanta::Clock) -> (u64, u64) {
    let mut pair = (0, 0);
    for _ in 0..3 {
        let before = counter.raw();
        let ns = monotonic_ns();
        let after = counter.raw();
        pair = (before + after.saturating_sub(before) / 2, ns);
        if counter.delta_as_nanos(before, after) < 2_000 {
            break;
        }
    }
    pair
}

/// One thread's reading of both clocks, and the last time it gave.
#[derive(Clone, Copy, Debug)]
struct Anchor {
    raw: u64,
    /// `CLOCK_MONOTONIC` at `raw` (0: no anchor yet).
    ns: u64,
    last: u64,
}

impl Anchor {
    const NONE: Self = Self {
        raw: 0,
        ns: 0,
        last: 0,
    };

    /// Now, from the counter's reading `raw`: the anchor's time plus the
    /// span since (`span_ns`, the counter's calibration), or a new anchor
    /// (`reanchor`) once the span reaches [`REANCHOR_NS`]; never before
    /// the last time given (a new anchor may put the time a few ns behind
    /// the counter's measure of it).
    fn now(
        &mut self,
        raw: u64,
        span_ns: impl Fn(u64, u64) -> u64,
        reanchor: impl FnOnce() -> (u64, u64),
    ) -> u64 {
        let since = span_ns(self.raw, raw);
        let now = if self.ns != 0 && since < REANCHOR_NS {
            self.ns + since
        } else {
            (self.raw, self.ns) = reanchor();
            self.ns
        };
        self.last = self.last.max(now);
        self.last
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

    /// A counter 8% fast by its calibration (as one taken while NTP slewed
    /// the clock at boot could be), read at uneven steps for ten simulated
    /// seconds: the time given stays within 8% of a re-anchoring span of
    /// `CLOCK_MONOTONIC`, never goes back, and ends where it does.
    #[test]
    fn a_miscalibrated_counter_stays_within_a_span_of_clock_monotonic() {
        let raw_at = |t: u64| t + t / 12;
        // What the calibration says a span of counter ticks is: 8% more
        // than the true span (the counter runs 1/12 faster).
        let span = |from: u64, to: u64| to.saturating_sub(from);
        let mut anchor = Anchor::NONE;
        let (mut t, mut last, mut step) = (1_000_000_000u64, 0, 7_919u64);
        while t < 11_000_000_000 {
            let now = anchor.now(raw_at(t), span, || (raw_at(t), t));
            assert!(now >= last, "went back from {last} to {now}");
            assert!(
                now.abs_diff(t) <= REANCHOR_NS / 12 + 1,
                "{now} at {t}: {} ns apart",
                now.abs_diff(t)
            );
            last = now;
            // Uneven steps from 0 to ~300 µs.
            step = step.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1) >> 1;
            t += step % 300_000;
        }
        assert!(last.abs_diff(t) <= REANCHOR_NS / 12 + 300_000);
    }

    /// A thread that reads rarely reads `CLOCK_MONOTONIC` itself.
    #[test]
    fn after_a_pause_the_time_is_clock_monotonics() {
        let mut anchor = Anchor::NONE;
        let span = |from: u64, to: u64| to.saturating_sub(from);
        assert_eq!(anchor.now(100, span, || (100, 5_000)), 5_000);
        assert_eq!(anchor.now(300, span, || unreachable!()), 5_200);
        assert_eq!(
            anchor.now(100 + REANCHOR_NS, span, || (100 + REANCHOR_NS, 9_000_000)),
            9_000_000
        );
    }

    /// The real counter keeps to `CLOCK_MONOTONIC` within 100 µs,
    /// now and a quarter of a second later.
    #[test]
    fn the_counter_keeps_to_clock_monotonic() {
        // Calibrated and anchored by the first read.
        counter_monotonic_ns();
        let between = || {
            let before = monotonic_ns();
            let counter = counter_monotonic_ns();
            (before, counter, monotonic_ns())
        };
        for pause in [0, 250] {
            std::thread::sleep(Duration::from_millis(pause));
            for _ in 0..1_000 {
                let (before, counter, after) = between();
                assert!(
                    counter + 100_000 >= before && counter <= after + 100_000,
                    "counter {counter} ns, CLOCK_MONOTONIC {before}..{after} ns"
                );
            }
        }
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
