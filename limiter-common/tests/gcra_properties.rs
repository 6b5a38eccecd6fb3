//! Properties of the shared GCRA, checked on random arrival sequences.

use limiter_common::gcra::{Check, Gcra};
use proptest::prelude::*;

/// Runs arrivals (ns, cost) through one meter; returns the admitted ones.
fn admitted(gcra: &Gcra, arrivals: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut tat = 0;
    arrivals
        .iter()
        .copied()
        .filter(|&(now, cost)| match gcra.check(tat, now, cost) {
            Check::Allow { new_tat } => {
                tat = new_tat;
                true
            }
            Check::Deny => false,
        })
        .collect()
}

fn sorted_arrivals(max_gap: u64, len: usize) -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0..max_gap, 1u64..4), 1..len).prop_map(|gaps| {
        let mut now = 1_000_000_000;
        gaps.into_iter()
            .map(|(gap, cost)| {
                now += gap;
                (now, cost)
            })
            .collect()
    })
}

proptest! {
    /// In every interval [a, b] between two admitted arrivals, the admitted
    /// cost is at most B + floor((b - a) / T).
    #[test]
    fn never_more_than_burst_plus_rate(
        rate in 1u64..1000,
        burst in 1u64..50,
        arrivals in sorted_arrivals(20_000_000, 300),
    ) {
        let gcra = Gcra::new(rate, 1_000_000_000, burst).unwrap();
        let got = admitted(&gcra, &arrivals);
        for i in 0..got.len() {
            let mut cost = 0;
            for j in i..got.len() {
                cost += got[j].1;
                let bound = burst + (got[j].0 - got[i].0) / gcra.emission_ns;
                prop_assert!(cost <= bound, "{cost} admitted in [{}, {}], bound {bound}", got[i].0, got[j].0);
            }
        }
    }

    /// A source that never exceeds the rate is never denied.
    #[test]
    fn conforming_source_never_denied(
        rate in 1u64..10_000,
        burst in 1u64..20,
        extra_gaps in prop::collection::vec(0u64..5_000_000, 1..200),
    ) {
        let gcra = Gcra::new(rate, 1_000_000_000, burst).unwrap();
        let mut now = 5_000_000_000;
        let arrivals: Vec<_> = extra_gaps.iter().map(|extra| {
            now += gcra.emission_ns + extra;
            (now, 1)
        }).collect();
        prop_assert_eq!(admitted(&gcra, &arrivals).len(), arrivals.len());
    }

    /// A steady flood at several times the rate gets the full rate:
    /// B + floor(D / T) over a flood of length D, give or take the arrival
    /// that straddles the end. (With burst 1 there is no headroom to carry
    /// the part of T an arrival came late by, so a flood whose arrivals do
    /// not line up with T gets less than the rate; that is GCRA's contract.)
    #[test]
    fn steady_flood_gets_full_rate(
        rate in 1u64..5_000,
        burst in 2u64..100,
        factor in 2u64..10,
    ) {
        let gcra = Gcra::new(rate, 1_000_000_000, burst).unwrap();
        let step = (gcra.emission_ns / factor).max(1);
        let start = 3_000_000_000;
        // Long enough that the flood offers more than the burst and the rate
        // together: factor × D/T ≥ B + D/T when D/T ≥ B.
        let duration = gcra.emission_ns * (burst + 20);
        let arrivals: Vec<_> = (0..).map(|i| (start + i * step, 1)).take_while(|a| a.0 <= start + duration).collect();
        let got = admitted(&gcra, &arrivals).len() as u64;
        let ideal = burst + duration / gcra.emission_ns;
        prop_assert!(got <= ideal && got + 1 >= ideal, "admitted {got}, ideal {ideal}");
    }

    /// Any clock reading, state and cost, however extreme, gives the
    /// verdict of the rule computed in 128 bits: a request conforms exactly
    /// when `max(TAT, now) + c·T − now ≤ B·T` and that time fits in u64,
    /// and then moves TAT there. Times and costs are drawn near the state,
    /// the burst and the ends of u64, so both verdicts occur (a version
    /// that drew every cost from all of u64 denied every request and never
    /// reached its assertion).
    #[test]
    fn total_at_extremes(
        now in prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()],
        ahead in prop_oneof![Just(0u64), 0u64..2_000_000_000_000, any::<u64>()],
        behind: bool,
        cost in prop_oneof![Just(0u64), 0u64..2_000_000, any::<u64>()],
        rate in 1u64..1_000_000,
        burst in 1u64..1_000_000,
    ) {
        let gcra = Gcra::new(rate, 1_000_000_000, burst).unwrap();
        let tat = if behind { now.saturating_sub(ahead) } else { now.saturating_add(ahead) };
        let done_by = u128::from(tat.max(now)) + u128::from(cost) * u128::from(gcra.emission_ns);
        let conforms = done_by <= u128::from(u64::MAX)
            && done_by - u128::from(now) <= u128::from(gcra.capacity_ns);
        let expected = if conforms {
            Check::Allow { new_tat: done_by as u64 }
        } else {
            Check::Deny
        };
        prop_assert_eq!(gcra.check(tat, now, cost), expected);
    }
}

proptest! {
    /// The division-free remainder used to align windows equals `%`.
    #[test]
    fn remainder_equals_modulo(value: u64, divisor in 1u64..) {
        let r = limiter_common::window::remainder(value, divisor, u64::MAX / divisor);
        prop_assert_eq!(r, value % divisor);
    }
}
