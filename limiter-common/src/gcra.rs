//! GCRA (the generic cell rate algorithm): a token bucket kept as one `u64`
//! per key, the theoretical arrival time (TAT), in integer nanoseconds.
//!
//! With emission interval `T` (nanoseconds one unit of cost is worth) and
//! burst `B`, a request of cost `c` arriving at `now` conforms when
//! `max(TAT, now) + c·T − now ≤ B·T`; it then moves TAT there. In any
//! interval of length `t` at most `B + floor(t/T)` units of cost conform.
//!
//! The per-packet path has no division and no floating point: everything
//! that needs either is computed once, when a rule is loaded ([`Gcra::new`]),
//! which also rejects parameters whose arithmetic could overflow.

/// Horizon that keeps `now + B·T` well inside `u64` for any monotonic clock
/// reading below 2^63 ns (292 years of uptime). A cost so large that
/// `cost·T` still overflows is denied by [`Gcra::check`].
const MAX_CAPACITY_NS: u64 = 1 << 61;

/// One meter: emission interval and bucket capacity, both in nanoseconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gcra {
    /// `T = ceil(period / rate)`: nanoseconds one unit of cost is worth.
    pub emission_ns: u64,
    /// `B × T`: how far past `now` the TAT may run.
    pub capacity_ns: u64,
    /// `B`: no request costing more can ever conform, so [`Gcra::check`]
    /// denies it before multiplying (which keeps `cost × T` within `B × T`).
    pub burst: u64,
}

/// Why a limit cannot be represented; reported when the rule is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitError {
    ZeroRate,
    ZeroBurst,
    ZeroPeriod,
    /// More than one unit per nanosecond: `T` would round to zero.
    RateTooHigh,
    /// `B × T` beyond the representable horizon.
    BurstTooLarge,
    /// `2 × R × U` does not fit in 64 bits (window algorithms).
    WindowTooLarge,
}

impl core::fmt::Display for LimitError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::ZeroRate => "rate must be at least 1",
            Self::ZeroBurst => "burst must be at least 1",
            Self::ZeroPeriod => "the unit must be at least 1 ns long",
            Self::RateTooHigh => "rate exceeds one per nanosecond (the clock's resolution)",
            Self::BurstTooLarge => "burst × (unit / rate) overflows the 2^61 ns horizon",
            Self::WindowTooLarge => "2 × rate × unit (in ns) overflows 64 bits; use a shorter unit",
        })
    }
}

/// The outcome of checking one request against a meter's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Conforms; store this TAT.
    Allow { new_tat: u64 },
    /// Does not conform; the state is left as it was (denials are not charged).
    Deny,
}

impl Gcra {
    /// A meter that admits nothing (its burst is zero, so every cost
    /// exceeds it): a fleet-wide rule's share while a node holds none.
    pub const CLOSED: Self = Self {
        emission_ns: MAX_CAPACITY_NS,
        capacity_ns: 0,
        burst: 0,
    };

    /// A meter admitting `rate` units per `period_ns`, with `burst` units of
    /// headroom. `T` is rounded up, so the meter never admits more than asked.
    pub const fn new(rate: u64, period_ns: u64, burst: u64) -> Result<Self, LimitError> {
        if rate == 0 {
            return Err(LimitError::ZeroRate);
        }
        if burst == 0 {
            return Err(LimitError::ZeroBurst);
        }
        if period_ns == 0 {
            return Err(LimitError::ZeroPeriod);
        }
        if period_ns < rate {
            return Err(LimitError::RateTooHigh);
        }
        let emission_ns = period_ns.div_ceil(rate);
        let capacity_ns = match burst.checked_mul(emission_ns) {
            Some(c) if c <= MAX_CAPACITY_NS => c,
            _ => return Err(LimitError::BurstTooLarge),
        };
        Ok(Self {
            emission_ns,
            capacity_ns,
            burst,
        })
    }

    /// Checks a request of `cost` units at `now` against state `tat`.
    ///
    /// A TAT more than `B·T` ahead of `now` cannot come from the clock it
    /// is kept in (monotonic, in the kernel and in layer 7), only from a
    /// clock that went backwards. It is honoured as written: the key waits
    /// until the clock catches up, at most as long as the jump, and never
    /// gets a fresh burst from a jump (fail closed).
    #[inline(always)]
    pub fn check(&self, tat: u64, now: u64, cost: u64) -> Check {
        let base = if tat > now { tat } else { now };
        if cost > self.burst {
            return Check::Deny;
        }
        // cost ≤ B, so cost × T ≤ B × T, which `new` proved fits. The sum
        // overflows only with a clock near 2^64; fail closed then.
        let Some(new_tat) = base.checked_add(cost * self.emission_ns) else {
            return Check::Deny;
        };
        if new_tat - now <= self.capacity_ns {
            Check::Allow { new_tat }
        } else {
            Check::Deny
        }
    }

    /// The state after handing back a charge of `cost` made at or before
    /// `now`, or `None` when there is nothing to hand back. Any TAT at or
    /// before `now` means "full bucket", so a refund never goes below `now`.
    #[inline(always)]
    pub fn refunded(&self, tat: u64, now: u64, cost: u64) -> Option<u64> {
        if tat <= now {
            return None;
        }
        let charge = if cost > self.burst {
            self.capacity_ns
        } else {
            cost * self.emission_ns
        };
        let back = tat.saturating_sub(charge);
        Some(if back > now { back } else { now })
    }

    /// State `tat`, kept under this meter, carried over at `now` to `new`
    /// (the rule's limit changed, its keys kept): the same fraction of the
    /// burst in use, rounded up, so the key never has more of the new
    /// burst than it had of the old. A TAT at or before `now` (a full
    /// bucket) stays as it is; a debt beyond the whole burst (a clock that
    /// went back, a change cut short) counts as the whole burst, so a
    /// change never lengthens a wait beyond a spent new burst.
    pub fn carried(&self, tat: u64, now: u64, new: &Gcra) -> u64 {
        if tat <= now {
            return tat;
        }
        let debt = u128::from((tat - now).min(self.capacity_ns));
        let carried = if self.capacity_ns == 0 {
            // A closed meter in debt: all of the new burst in use.
            u128::from(new.capacity_ns)
        } else {
            (debt * u128::from(new.capacity_ns)).div_ceil(u128::from(self.capacity_ns))
        };
        // Below u64::MAX, which marks a slot being claimed (`keytable`).
        let carried = u64::try_from(carried).unwrap_or(u64::MAX);
        now.saturating_add(carried).min(u64::MAX - 1)
    }

    /// Units of cost that would conform now, given state `tat`: what is
    /// left of the burst.
    pub fn remaining(&self, tat: u64, now: u64) -> u64 {
        let used = tat.saturating_sub(now).min(self.capacity_ns);
        (self.capacity_ns - used) / self.emission_ns.max(1)
    }

    /// How long until a request of `cost` would conform, given state `tat`.
    /// `u64::MAX` when it never will (the cost exceeds the burst).
    pub fn wait_ns(&self, tat: u64, now: u64, cost: u64) -> u64 {
        if cost > self.burst {
            return u64::MAX;
        }
        let base = if tat > now { tat } else { now };
        let new_tat = base.saturating_add(cost * self.emission_ns);
        (new_tat - now).saturating_sub(self.capacity_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_is_what_would_conform_now() {
        let g = Gcra::new(10, 1_000_000_000, 5).unwrap();
        let now = 50_000_000_000;
        assert_eq!(g.remaining(now, now), 5, "a full bucket");
        assert_eq!(g.remaining(now - 1, now), 5, "a TAT in the past");
        // Two and a half requests' worth in use: two whole ones left.
        assert_eq!(g.remaining(now + 250_000_000, now), 2);
        assert_eq!(g.remaining(now + g.capacity_ns, now), 0, "spent");
        assert_eq!(g.remaining(now + 10 * g.capacity_ns, now), 0, "in debt");
    }

    #[test]
    fn a_carried_debt_is_the_same_share_of_the_new_burst() {
        let old = Gcra::new(10, 1_000_000_000, 4).unwrap();
        let new = Gcra::new(10, 1_000_000_000, 8).unwrap();
        let now = 50_000_000_000;
        // A quarter of the old burst in use: a quarter of the new.
        let tat = now + old.capacity_ns / 4;
        assert_eq!(old.carried(tat, now, &new), now + new.capacity_ns / 4);
        assert_eq!(
            old.carried(now - 5, now, &new),
            now - 5,
            "a full bucket stays"
        );
    }

    /// A debt carried past the end of the clock stops below `u64::MAX`,
    /// the key table's mark of a slot being claimed.
    #[test]
    fn a_carried_tat_never_reaches_the_claimed_mark() {
        let old = Gcra::new(10, 1_000_000_000, 4).unwrap();
        let new = Gcra::new(10, 1_000_000_000, 8).unwrap();
        let now = u64::MAX - 10;
        assert_eq!(old.carried(u64::MAX - 1, now, &new), u64::MAX - 1);
        assert_eq!(Gcra::CLOSED.carried(now + 1, now, &new), u64::MAX - 1);
    }

    /// Admitted at once from `tat` at `now` (each request of cost 1).
    fn admitted_at_once(g: &Gcra, mut tat: u64, now: u64) -> u64 {
        let mut n = 0;
        while let Check::Allow { new_tat } = g.check(tat, now, 1) {
            tat = new_tat;
            n += 1;
        }
        n
    }

    /// Guards a limit change: the fraction of the burst in use is kept,
    /// rounded against the key, and a full bucket stays full.
    #[test]
    fn a_changed_limit_keeps_the_fraction_of_the_burst_in_use() {
        const S: u64 = 1_000_000_000;
        let now = 1_000 * S;
        let old = Gcra::new(10, S, 10).unwrap();
        // Half the burst spent: 5 of 10 left.
        let tat = now + S / 2;
        assert_eq!(admitted_at_once(&old, tat, now), 5);
        let lower = Gcra::new(1, S, 2).unwrap();
        let carried = old.carried(tat, now, &lower);
        assert_eq!(carried, now + S);
        assert_eq!(admitted_at_once(&lower, carried, now), 1);
        let higher = Gcra::new(100, S, 100).unwrap();
        assert_eq!(
            admitted_at_once(&higher, old.carried(tat, now, &higher), now),
            50
        );
        // A key with its whole burst spent has none of the new one.
        let spent = now + old.capacity_ns;
        assert_eq!(admitted_at_once(&old, spent, now), 0);
        for new in [lower, higher, Gcra::new(3, S, 7).unwrap()] {
            assert_eq!(
                admitted_at_once(&new, old.carried(spent, now, &new), now),
                0
            );
        }
        // At rest, it stays at rest; a sliver of debt rounds up.
        assert_eq!(old.carried(now - 5, now, &lower), now - 5);
        let thirds = Gcra {
            emission_ns: 1,
            capacity_ns: 3,
            burst: 3,
        };
        let halves = Gcra {
            emission_ns: 1,
            capacity_ns: 2,
            burst: 2,
        };
        assert_eq!(thirds.carried(now + 1, now, &halves), now + 1);
        // A closed meter in debt hands on a spent burst.
        assert_eq!(
            Gcra::CLOSED.carried(now + 1, now, &lower),
            now + lower.capacity_ns
        );
    }

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_closed_meter_admits_nothing() {
        for (tat, now) in [(0, 0), (0, SEC), (5 * SEC, SEC), (u64::MAX, 0)] {
            assert_eq!(Gcra::CLOSED.check(tat, now, 1), Check::Deny);
        }
        assert_eq!(Gcra::CLOSED.wait_ns(0, SEC, 1), u64::MAX);
    }

    #[test]
    fn rejects_unrepresentable_limits() {
        assert_eq!(Gcra::new(0, SEC, 1), Err(LimitError::ZeroRate));
        assert_eq!(Gcra::new(1, SEC, 0), Err(LimitError::ZeroBurst));
        assert_eq!(Gcra::new(1, 0, 1), Err(LimitError::ZeroPeriod));
        assert_eq!(Gcra::new(SEC + 1, SEC, 1), Err(LimitError::RateTooHigh));
        assert_eq!(
            Gcra::new(1, 86_400 * SEC, u64::MAX),
            Err(LimitError::BurstTooLarge)
        );
        assert_eq!(Gcra::new(1, u64::MAX, 1), Err(LimitError::BurstTooLarge));
    }

    #[test]
    fn emission_rounds_up() {
        let g = Gcra::new(3, SEC, 1).unwrap();
        assert_eq!(g.emission_ns, 333_333_334);
        assert_eq!(g.capacity_ns, 333_333_334);
    }

    #[test]
    fn burst_then_rate() {
        let g = Gcra::new(10, SEC, 5).unwrap();
        let now = 1_000 * SEC;
        let mut tat = 0;
        let mut admitted = 0;
        for _ in 0..20 {
            if let Check::Allow { new_tat } = g.check(tat, now, 1) {
                tat = new_tat;
                admitted += 1;
            }
        }
        assert_eq!(admitted, 5);
        // 100 ms later exactly one more unit has accrued.
        assert!(matches!(
            g.check(tat, now + SEC / 10, 1),
            Check::Allow { .. }
        ));
        assert_eq!(g.check(tat, now + SEC / 10 - 1, 1), Check::Deny);
    }

    /// Guards against a clamp that refills the bucket when the clock jumps
    /// back (a fresh burst for every key) or one that never lets it recover.
    #[test]
    fn state_ahead_of_a_clock_that_went_back_is_honoured() {
        let g = Gcra::new(10, SEC, 5).unwrap();
        let emptied_at = 1_000 * SEC;
        let tat = emptied_at + g.capacity_ns;
        let jumped = emptied_at - 10 * SEC;
        assert_eq!(g.check(tat, jumped, 1), Check::Deny);
        assert_eq!(g.wait_ns(tat, jumped, 1), 10 * SEC + g.emission_ns);
        let recovered = emptied_at + g.emission_ns;
        assert_eq!(g.check(tat, recovered - 1, 1), Check::Deny);
        assert_eq!(
            g.check(tat, recovered, 1),
            Check::Allow {
                new_tat: tat + g.emission_ns
            }
        );
    }

    #[test]
    fn fails_closed_at_extremes() {
        let g = Gcra::new(1, SEC, 1).unwrap();
        assert_eq!(g.check(0, u64::MAX, 1), Check::Deny);
        assert_eq!(
            g.check(0, u64::MAX - SEC, 1),
            Check::Allow { new_tat: u64::MAX }
        );
        assert_eq!(g.check(0, 0, u64::MAX), Check::Deny);
    }

    #[test]
    fn refund_restores_budget() {
        let g = Gcra::new(10, SEC, 2).unwrap();
        let now = 50 * SEC;
        let Check::Allow { new_tat } = g.check(0, now, 1) else {
            panic!("first request must conform")
        };
        assert_eq!(g.refunded(new_tat, now, 1), Some(now));
        assert_eq!(g.refunded(now - 1, now, 1), None);
    }

    /// Guards the cap on what a refund hands back: a cost beyond the burst
    /// hands back at most a full bucket, without multiplying (cost × T
    /// would overflow).
    #[test]
    fn refunds_never_hand_back_more_than_a_bucket() {
        let g = Gcra::new(10, SEC, 4).unwrap();
        let now = 100 * SEC;
        let tat = now + 3 * g.emission_ns;
        assert_eq!(g.refunded(tat, now, u64::MAX), Some(now));
        assert_eq!(
            g.refunded(now + 2 * g.capacity_ns, now, 5),
            Some(now + g.capacity_ns)
        );
        assert_eq!(g.refunded(tat, now, 4), Some(now));
    }

    /// Guards the boundary of `wait_ns`: a cost equal to the burst fits a
    /// full bucket at once; only a larger one never does.
    #[test]
    fn waits_at_the_burst_boundary() {
        let g = Gcra::new(10, SEC, 4).unwrap();
        let now = 100 * SEC;
        assert_eq!(g.wait_ns(now, now, 4), 0);
        assert_eq!(g.wait_ns(now + g.emission_ns, now, 4), g.emission_ns);
        assert_eq!(g.wait_ns(now, now, 5), u64::MAX);
    }

    /// Guards the messages a rule file's errors show.
    #[test]
    fn limit_errors_say_what_is_wrong() {
        extern crate std;
        use std::string::ToString;
        assert_eq!(LimitError::ZeroRate.to_string(), "rate must be at least 1");
        assert!(
            LimitError::WindowTooLarge
                .to_string()
                .contains("2 × rate × unit")
        );
    }
}
