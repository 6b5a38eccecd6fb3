//! How many partitions a node should hold, from what its traffic asks:
//! more at once when its aggregate refuses traffic (it holds less than its
//! traffic needs), and when it uses less than half of what it would have
//! with one fewer, all but enough for twice its use back at once (so
//! capacity follows traffic across nodes within a tick or two, and a node
//! at steady use neither takes nor gives back); its local budget from the
//! leases valid now.

use std::time::Duration;

use super::lease::Peers;

/// One rule's global budget, split into partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Packets (or requests) per unit of the rule, for the whole fleet.
    pub global_rate: u64,
    pub partitions: u32,
    /// Per unit, held by every node whatever Redis says.
    pub reserve_rate: u64,
}

impl Budget {
    /// The rate one partition is worth (the last partitions may be worth
    /// one less than the first: the global rate is never exceeded).
    pub fn partition_rate(&self) -> u64 {
        self.global_rate / u64::from(self.partitions.max(1))
    }

    /// The node's local rate with `valid` partitions whose leases are
    /// valid now: its reserve and its share.
    pub fn local_rate(&self, valid: u32) -> u64 {
        self.reserve_rate + u64::from(valid.min(self.partitions)) * self.partition_rate()
    }
}

/// What the node's traffic did over the last tick, per unit of the rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// Admitted by the rule's aggregate.
    pub admitted_rate: u64,
    /// Refused by the aggregate although each key's own budget allowed it:
    /// traffic the node would pass with a larger share.
    pub refused_rate: u64,
}

/// Use below this share of what one partition fewer would give returns
/// partitions.
const LOW_WATER: f64 = 0.5;

/// The partitions to hold next, holding `held`: enough for the refused
/// traffic at once, or, well under use, the fewest that leave twice the
/// use (which the next tick keeps: no flapping).
pub fn target(budget: &Budget, held: u32, demand: Demand) -> u32 {
    let per = budget.partition_rate().max(1);
    if demand.refused_rate > 0 {
        let more = demand.refused_rate.div_ceil(per);
        return u32::try_from(u64::from(held) + more)
            .unwrap_or(u32::MAX)
            .min(budget.partitions);
    }
    if held == 0 {
        return 0;
    }
    let without_one = budget.local_rate(held - 1) as f64;
    if (demand.admitted_rate as f64) >= without_one * LOW_WATER {
        return held;
    }
    let wanted = (demand.admitted_rate.saturating_mul(2))
        .saturating_sub(budget.reserve_rate)
        .div_ceil(per);
    u32::try_from(wanted).unwrap_or(u32::MAX).min(held - 1)
}

/// A count over `elapsed` as a rate per `period` (the rule's unit).
pub fn per_unit(count: u64, period: Duration, elapsed: Duration) -> u64 {
    let elapsed = elapsed.as_secs_f64().max(1e-3);
    (count as f64 * period.as_secs_f64() / elapsed) as u64
}

/// While other nodes want more than they hold too, a node that wants
/// more keeps at most an equal share of what the satisfied nodes leave
/// (rounded up), and gives the surplus back, for them. A node whose
/// traffic fits in what it holds keeps it.
pub fn fair_cap(budget: &Budget, hungry: bool, peers: Peers) -> Option<u32> {
    (hungry && peers.hungry > 1).then(|| {
        budget
            .partitions
            .saturating_sub(peers.satisfied_held)
            .div_ceil(peers.hungry)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Budget = Budget {
        global_rate: 50_000,
        partitions: 50,
        reserve_rate: 500,
    };

    /// A rule's unit need not be a second: 300 in 2 s is 9,000 a minute.
    #[test]
    fn a_count_becomes_a_rate_per_the_rules_unit() {
        let s = Duration::from_secs;
        assert_eq!(per_unit(300, s(60), s(2)), 9_000);
        assert_eq!(per_unit(300, s(1), s(2)), 150);
        assert_eq!(
            per_unit(5, s(1), Duration::ZERO),
            5_000,
            "at least a millisecond"
        );
    }

    #[test]
    fn the_share_never_exceeds_the_global_rate_and_the_reserve() {
        assert_eq!(BUDGET.partition_rate(), 1_000);
        assert_eq!(BUDGET.local_rate(0), 500);
        assert_eq!(BUDGET.local_rate(50), 50_500);
        assert_eq!(BUDGET.local_rate(80), 50_500, "more leases than partitions");
        let odd = Budget {
            global_rate: 1_000,
            partitions: 3,
            reserve_rate: 0,
        };
        assert!(u64::from(odd.partitions) * odd.partition_rate() <= odd.global_rate);
    }

    #[test]
    fn refused_traffic_takes_what_it_needs_at_once() {
        let demand = Demand {
            admitted_rate: 4_500,
            refused_rate: 2_500,
        };
        assert_eq!(target(&BUDGET, 4, demand), 7);
        assert_eq!(
            target(&BUDGET, 49, demand),
            50,
            "never beyond the partitions"
        );
    }

    #[test]
    fn little_use_gives_back_the_surplus_and_steady_use_keeps() {
        let idle = Demand::default();
        assert_eq!(target(&BUDGET, 10, idle), 0);
        assert_eq!(target(&BUDGET, 0, idle), 0);
        // 2,000 used: keeps 4 (500 + 4,000 ≥ twice 2,000), and keeps them.
        let some = Demand {
            admitted_rate: 2_000,
            refused_rate: 0,
        };
        assert_eq!(target(&BUDGET, 30, some), 4);
        assert_eq!(target(&BUDGET, 4, some), 4);
        // Using 9,000 of 10,500: keeps its 10.
        let busy = Demand {
            admitted_rate: 9_000,
            refused_rate: 0,
        };
        assert_eq!(target(&BUDGET, 10, busy), 10);
        // Just below half of what 9 would give (9,500 / 2): keeps what
        // leaves twice the use (9,400 - 500 = 8.9 partitions: 9).
        let light = Demand {
            admitted_rate: 4_700,
            refused_rate: 0,
        };
        assert_eq!(target(&BUDGET, 10, light), 9);
        assert_eq!(target(&BUDGET, 9, light), 9, "and keeps it");
    }

    /// A demand that moves from one node to another: the first gives its
    /// partitions back over a few ticks while the second takes what it
    /// needs at once, and together they never hold more than exist.
    #[test]
    fn capacity_follows_the_traffic() {
        let (mut a, mut b) = (40u32, 0u32);
        // Within two ticks.
        for _ in 0..2 {
            a = target(&BUDGET, a, Demand::default());
            // What a does not hold (b's own included) is all b can lease.
            let free = BUDGET.partitions - a;
            let wanted = target(
                &BUDGET,
                b,
                Demand {
                    admitted_rate: BUDGET.local_rate(b),
                    refused_rate: 40_000u64.saturating_sub(BUDGET.local_rate(b)),
                },
            );
            b = wanted.min(free);
            assert!(a + b <= BUDGET.partitions);
        }
        assert_eq!(a, 0);
        assert!(BUDGET.local_rate(b) >= 40_000, "b holds {b}");
    }

    /// Three nodes flooded beyond the budget, one of which took everything
    /// first: within a tick each holds an equal share; a satisfied node
    /// keeps what it uses and the hungry share the rest.
    #[test]
    fn contended_nodes_converge_to_equal_shares() {
        let hungry = Demand {
            admitted_rate: 1_000,
            refused_rate: 60_000,
        };
        let run = |mut held: [u32; 3], wants: [bool; 3]| {
            for _ in 0..3 {
                for me in 0..3 {
                    let peers = Peers {
                        hungry: wants.iter().filter(|w| **w).count() as u32,
                        satisfied_held: (0..3).filter(|&o| !wants[o]).map(|o| held[o]).sum(),
                        memory: std::time::Duration::MAX,
                        malformed: 0,
                        foreign: 0,
                    };
                    let demand = if wants[me] {
                        hungry
                    } else {
                        Demand {
                            admitted_rate: BUDGET.local_rate(held[me]),
                            refused_rate: 0,
                        }
                    };
                    let mut t = target(&BUDGET, held[me], demand);
                    if let Some(cap) = fair_cap(&BUDGET, wants[me], peers) {
                        t = t.min(cap);
                    }
                    let free = BUDGET.partitions - held.iter().sum::<u32>();
                    held[me] = if t > held[me] {
                        held[me] + (t - held[me]).min(free)
                    } else {
                        t
                    };
                    assert!(held.iter().sum::<u32>() <= BUDGET.partitions);
                }
            }
            held
        };
        assert_eq!(run([50, 0, 0], [true; 3]), [17, 17, 16]);
        assert_eq!(run([30, 0, 0], [false, true, true]), [30, 10, 10]);
        assert_eq!(
            fair_cap(
                &BUDGET,
                true,
                Peers {
                    hungry: 1,
                    satisfied_held: 0,
                    memory: std::time::Duration::MAX,
                    malformed: 0,
                    foreign: 0,
                }
            ),
            None,
            "nobody else wants more"
        );
        assert_eq!(
            fair_cap(
                &BUDGET,
                false,
                Peers {
                    hungry: 3,
                    satisfied_held: 0,
                    memory: std::time::Duration::MAX,
                    malformed: 0,
                    foreign: 0,
                }
            ),
            None
        );
    }
}
