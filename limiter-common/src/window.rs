//! Window counters: `fixed_window` (envoy ratelimit's behaviour: at most
//! `R` per window of length `U`, windows aligned to the Unix epoch) and
//! `sliding_window` (the weighted two-window estimate Cloudflare describes:
//! `prev × (U − elapsed) / U + current`, which must stay within `R`).
//!
//! Integer nanoseconds of the Unix epoch, no floating point and no division:
//! the sliding estimate is compared multiplied through by `U` (overflow
//! excluded when the limit is loaded), and the one remainder needed when a
//! key returns after two or more idle windows is computed by multiplying
//! with a reciprocal of `U` computed at load time, then correcting by at
//! most one subtraction.

use crate::gcra::LimitError;

/// `R` per window of `U` ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub length_ns: u64,
    pub limit: u64,
    /// `floor((2^64 − 1) / length_ns)`, for [`remainder`].
    pub reciprocal: u64,
}

/// A key's window state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowState {
    /// Start of the current window (a multiple of `length_ns`), epoch ns.
    pub start: u64,
    /// Cost admitted in the window before it (sliding window only).
    pub previous: u64,
    /// Cost admitted in the current window.
    pub current: u64,
}

impl WindowState {
    /// The state kept in a key's `[start, previous, current]` slots, in place.
    #[inline(always)]
    pub fn in_slots(slots: &mut [u64; 3]) -> &mut Self {
        // SAFETY: WindowState is repr(C) with exactly three u64 fields,
        // the layout and alignment of [u64; 3].
        unsafe { &mut *(slots as *mut [u64; 3]).cast::<Self>() }
    }
}

const _: () = assert!(core::mem::size_of::<WindowState>() == core::mem::size_of::<[u64; 3]>());

impl Window {
    /// `limit` per `length_ns`. For the sliding window, `2 × R × U` must fit
    /// in 64 bits so the multiplied-through comparison cannot overflow.
    pub const fn new(limit: u64, length_ns: u64) -> Result<Self, LimitError> {
        if limit == 0 {
            return Err(LimitError::ZeroRate);
        }
        if length_ns == 0 {
            return Err(LimitError::ZeroPeriod);
        }
        match limit.checked_mul(2) {
            Some(twice) if twice.checked_mul(length_ns).is_some() => {}
            _ => return Err(LimitError::WindowTooLarge),
        }
        Ok(Self {
            length_ns,
            limit,
            reciprocal: u64::MAX / length_ns,
        })
    }

    /// A window of `length_ns` that admits nothing: a fleet-wide rule's
    /// share while a node holds none.
    pub const fn closed(length_ns: u64) -> Self {
        Self {
            length_ns,
            limit: 0,
            reciprocal: match u64::MAX.checked_div(length_ns) {
                Some(r) => r,
                None => 0,
            },
        }
    }

    /// The state as of `now`: rolled over to `now`'s window. A state from
    /// the future (the clock went backwards) is kept as it is, so counts
    /// are never forgotten early. The last window of the u64 clock, which
    /// cannot end within it, never ends.
    #[inline(always)]
    fn roll(&self, state: &WindowState, now: u64) -> WindowState {
        let u = self.length_ns;
        match state.start.checked_add(u) {
            Some(end) if now >= end => {}
            _ => return *state,
        }
        if now - state.start < 2 * u.min(u64::MAX / 2) {
            return WindowState {
                start: state.start + u,
                previous: state.current,
                current: 0,
            };
        }
        WindowState {
            start: now - remainder(now, u, self.reciprocal),
            previous: 0,
            current: 0,
        }
    }

    /// Fixed window: admits `cost` at `now` if the window's total stays
    /// within the limit. Returns the new state, or `None` (denied, uncharged).
    #[inline(always)]
    pub fn check_fixed(&self, state: &WindowState, now: u64, cost: u64) -> Option<WindowState> {
        let mut next = self.roll(state, now);
        if cost > self.limit || next.current > self.limit - cost {
            return None;
        }
        next.current += cost;
        Some(next)
    }

    /// Sliding window: admits `cost` at `now` if
    /// `previous × (U − elapsed) / U + current + cost ≤ R`, evaluated as
    /// `previous × (U − elapsed) + (current + cost) × U ≤ R × U`.
    #[inline(always)]
    pub fn check_sliding(&self, state: &WindowState, now: u64, cost: u64) -> Option<WindowState> {
        let mut next = self.roll(state, now);
        if cost > self.limit || next.current > self.limit - cost {
            return None;
        }
        let u = self.length_ns;
        // A state from the future counts as the window's first instant.
        let elapsed = now.saturating_sub(next.start).min(u);
        // previous ≤ R and current + cost ≤ R, so both products are at most
        // R × U, and their sum at most 2 × R × U, which `new` proved fits.
        let weighted = next.previous * (u - elapsed) + (next.current + cost) * u;
        if weighted > self.limit * u {
            return None;
        }
        next.current += cost;
        Some(next)
    }

    /// [`Window::check_sliding`] or [`Window::check_fixed`].
    #[inline(always)]
    pub fn check(
        &self,
        state: &WindowState,
        now: u64,
        cost: u64,
        sliding: bool,
    ) -> Option<WindowState> {
        if sliding {
            self.check_sliding(state, now, cost)
        } else {
            self.check_fixed(state, now, cost)
        }
    }

    /// What the window counts against its limit at `now`: the current
    /// window's total, and for the sliding window the previous one's
    /// weighted share too, rounded up.
    pub fn used(&self, state: &WindowState, now: u64, sliding: bool) -> u64 {
        let rolled = self.roll(state, now);
        if !sliding {
            return rolled.current;
        }
        let u = self.length_ns;
        let elapsed = now.saturating_sub(rolled.start).min(u);
        let weighted = u128::from(rolled.previous) * u128::from(u - elapsed);
        rolled.current + weighted.div_ceil(u128::from(u)) as u64
    }

    /// Units of cost left in the window at `now`.
    pub fn remaining(&self, state: &WindowState, now: u64, sliding: bool) -> u64 {
        self.limit.saturating_sub(self.used(state, now, sliding))
    }

    /// Nanoseconds from `now` until the current window ends.
    pub fn reset_ns(&self, state: &WindowState, now: u64) -> u64 {
        // (Saturates in the last window of the clock.)
        let rolled = self.roll(state, now);
        rolled
            .start
            .saturating_add(self.length_ns)
            .saturating_sub(now)
    }
}

/// `value mod divisor`, given `reciprocal = floor((2^64 − 1) / divisor)`:
/// the estimated quotient `value × reciprocal / 2^64` is at most one short
/// of the true one (`reciprocal > (2^64 − divisor) / divisor`, so the
/// estimate exceeds `value / divisor − value / 2^64 > value / divisor − 1`),
/// so one subtraction corrects the remainder.
#[inline(always)]
pub fn remainder(value: u64, divisor: u64, reciprocal: u64) -> u64 {
    let quotient = mul_high(value, reciprocal);
    let rem = value - quotient * divisor;
    if rem >= divisor { rem - divisor } else { rem }
}

/// The high 64 bits of a 64 × 64-bit product, from 32-bit halves (BPF has
/// no 128-bit multiply).
#[inline(always)]
pub fn mul_high(a: u64, b: u64) -> u64 {
    // The high halves pass through volatile reads: LLVM would otherwise
    // recognise the idiom and emit a 128-bit multiply, which BPF lacks.
    // SAFETY: reads of initialised locals.
    let (a_hi, a_lo) = (
        unsafe { core::ptr::read_volatile(&(a >> 32)) },
        a & 0xffff_ffff,
    );
    let (b_hi, b_lo) = (
        unsafe { core::ptr::read_volatile(&(b >> 32)) },
        b & 0xffff_ffff,
    );
    let lo_lo = a_lo * b_lo;
    let hi_lo = a_hi * b_lo;
    let lo_hi = a_lo * b_hi;
    let hi_hi = a_hi * b_hi;
    let middle = (lo_lo >> 32) + (hi_lo & 0xffff_ffff) + (lo_hi & 0xffff_ffff);
    hi_hi + (hi_lo >> 32) + (lo_hi >> 32) + (middle >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn used_and_remaining_weigh_the_last_window_when_sliding() {
        let ten = Window::new(10, SEC).unwrap();
        let start = 1_700_000_000 * SEC;
        let state = WindowState {
            start,
            previous: 10,
            current: 4,
        };
        let quarter = start + SEC / 4;
        assert_eq!(ten.used(&state, quarter, false), 4);
        assert_eq!(ten.remaining(&state, quarter, false), 6);
        // 4 + 10 × 3/4, rounded up: 12, over the limit.
        assert_eq!(ten.used(&state, quarter, true), 12);
        assert_eq!(ten.remaining(&state, quarter, true), 0);
        let half = start + SEC / 2;
        assert_eq!(ten.used(&state, half, true), 9);
        assert_eq!(ten.remaining(&state, half, true), 1);
        // The next window: this one's 4 is the last one's, weighed whole.
        assert_eq!(ten.used(&state, start + SEC, true), 4);
        assert_eq!(ten.used(&state, start + SEC, false), 0);
    }

    #[test]
    fn a_closed_window_admits_nothing() {
        let closed = Window::closed(SEC);
        for state in [
            WindowState::default(),
            WindowState {
                start: 3 * SEC,
                previous: 0,
                current: 0,
            },
        ] {
            for sliding in [false, true] {
                assert_eq!(closed.check(&state, 3 * SEC + 1, 1, sliding), None);
            }
        }
    }

    #[test]
    fn remainder_matches_the_operator() {
        for (v, d) in [
            (0, 1),
            (7, 3),
            (u64::MAX, 1),
            (u64::MAX, u64::MAX),
            (u64::MAX, 3),
            (1 << 63, (1 << 63) + 1),
            (12345678901234, SEC),
            (u64::MAX - 1, 86_400 * SEC),
        ] {
            assert_eq!(remainder(v, d, u64::MAX / d), v % d, "{v} mod {d}");
            assert_eq!(
                mul_high(v, d),
                ((u128::from(v) * u128::from(d)) >> 64) as u64
            );
        }
    }

    #[test]
    fn fixed_window_resets_at_epoch_multiples() {
        let w = Window::new(3, 10 * SEC).unwrap();
        let mut s = WindowState::default();
        let t0 = 1_700_000_005 * SEC; // 5 s into a window
        for _ in 0..3 {
            s = w.check_fixed(&s, t0, 1).unwrap();
        }
        assert_eq!(s.start, 1_700_000_000 * SEC);
        assert_eq!(w.check_fixed(&s, t0 + 4 * SEC, 1), None);
        assert!(w.check_fixed(&s, t0 + 5 * SEC, 1).is_some());
        assert_eq!(w.reset_ns(&s, t0), 5 * SEC);
    }

    #[test]
    fn sliding_window_weighs_the_previous_window() {
        let w = Window::new(10, 10 * SEC).unwrap();
        let s = WindowState {
            start: 100 * SEC,
            previous: 0,
            current: 10,
        };
        // 2.5 s into the next window: 10 × 7.5 / 10 = 7.5 estimated; 2 more fit, not 3.
        let t = 112 * SEC + SEC / 2;
        let s = w.check_sliding(&s, t, 2).unwrap();
        assert_eq!((s.start, s.previous, s.current), (110 * SEC, 10, 2));
        assert_eq!(w.check_sliding(&s, t, 1), None);
    }

    #[test]
    fn overflowing_windows_are_refused() {
        assert_eq!(
            Window::new(u64::MAX / 2, 2),
            Err(LimitError::WindowTooLarge)
        );
        assert!(Window::new(100_000, 86_400 * SEC).is_ok());
    }

    /// Guards the cost bounds: a request costing exactly the limit fits an
    /// empty window of either kind; one unit more never does.
    #[test]
    fn a_cost_of_exactly_the_limit_fits_an_empty_window() {
        let w = Window::new(5, SEC).unwrap();
        let fresh = WindowState::default();
        let t = 1_000 * SEC + SEC / 3;
        for sliding in [false, true] {
            let s = w.check(&fresh, t, 5, sliding).expect("the limit fits");
            assert_eq!((s.start, s.previous, s.current), (1_000 * SEC, 0, 5));
            assert_eq!(w.check(&fresh, t, 6, sliding), None);
            assert_eq!(w.check(&s, t, 1, sliding), None);
        }
    }

    /// Guards the roll-over: a key back exactly two windows later starts
    /// the window `now` is in, with nothing carried over, not the window
    /// after its old one.
    #[test]
    fn exactly_two_windows_later_starts_afresh() {
        let w = Window::new(3, 10 * SEC).unwrap();
        let s = WindowState {
            start: 100 * SEC,
            previous: 3,
            current: 3,
        };
        let next = w.check_fixed(&s, 120 * SEC, 1).expect("a new window");
        assert_eq!((next.start, next.previous, next.current), (120 * SEC, 0, 1));
        let next = w
            .check_sliding(&s, 120 * SEC, 3)
            .expect("nothing carried over");
        assert_eq!((next.start, next.previous, next.current), (120 * SEC, 0, 3));
    }

    /// Guards the early refusal in the sliding check: it is what keeps the
    /// weighted sum within the `2 × R × U` that `new` proved fits. Without
    /// it, a full window and a large cost would overflow 64 bits (and wrap
    /// in the kernel) at the largest limit allowed.
    #[test]
    fn the_sliding_sum_stays_in_range_at_the_largest_limit() {
        let u = SEC;
        let r = u64::MAX / (2 * u);
        let w = Window::new(r, u).unwrap();
        let full = WindowState {
            start: 100 * u,
            previous: r,
            current: r,
        };
        assert_eq!(w.check_sliding(&full, 100 * u, r), None);
        assert_eq!(w.check_sliding(&full, 100 * u, 1), None);
    }
}
