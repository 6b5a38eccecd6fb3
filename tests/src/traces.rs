//! The conformance corpus: arrival traces for every algorithm, built
//! deterministically (a fixed-seed xorshift), covering steady and bursty
//! floods, idle gaps, clocks that go backwards, huge costs and the ends of
//! the u64 clock.

use crate::reference::{Algo, Arrival, Spec, Trace};

const SEC: u64 = 1_000_000_000;

/// Costs of byte traces that XDP can also replay: whole frame lengths.
pub const MIN_FRAME: u64 = 60;
pub const MAX_FRAME: u64 = 1514;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The whole corpus. `frames_only` leaves out what a frame cannot carry
/// (costs outside 60..=1514 bytes) for the XDP replay.
pub fn corpus() -> Vec<Trace> {
    let mut traces = Vec::new();
    for algo in [
        Algo::Gcra,
        Algo::FixedWindow,
        Algo::SlidingWindow,
        Algo::SlidingLog,
    ] {
        let burst = |b| if algo == Algo::Gcra { b } else { 0 };
        let packets = |rate, period_ns, b| Spec {
            algo,
            rate,
            period_ns,
            burst: burst(b),
            bytes: false,
        };
        let bytes = |rate, period_ns, b| Spec {
            algo,
            rate,
            period_ns,
            burst: burst(b),
            bytes: true,
        };
        let name = |what: &str| format!("{algo:?}/{what}");
        traces.push(steady(
            name("steady"),
            packets(10, SEC, 5),
            1_700_000_000 * SEC,
        ));
        traces.push(bursty(
            name("bursty"),
            packets(20, SEC, 20),
            1_700_000_000 * SEC,
            7,
        ));
        traces.push(idle_gaps(
            name("idle-gaps"),
            packets(5, 2 * SEC, 3),
            1_700_000_000 * SEC,
            11,
        ));
        traces.push(backwards(
            name("clock-backwards"),
            packets(10, SEC, 4),
            1_700_000_000 * SEC,
            13,
        ));
        traces.push(steady(name("from-zero"), packets(3, SEC, 2), 0));
        traces.push(steady(
            name("near-u64-max"),
            packets(10, SEC, 5),
            u64::MAX - 3 * SEC,
        ));
        traces.push(bursty(
            name("near-2^62"),
            packets(50, 60 * SEC, 30),
            1 << 62,
            17,
        ));
        traces.push(frame_costs(
            name("bytes"),
            bytes(8_000, SEC, 3_000),
            1_700_000_000 * SEC,
            19,
        ));
        traces.push(huge_costs(
            name("huge-costs"),
            bytes(10_000, SEC, 3_000),
            1_700_000_000 * SEC,
            23,
        ));
        traces.push(odd_period(
            name("odd-period"),
            packets(7, 3 * SEC + 1, 3),
            1_700_000_000 * SEC,
            29,
        ));
    }
    traces
}

/// Whether every cost of the trace fits in a frame (or is a packet).
pub fn replayable_as_frames(trace: &Trace) -> bool {
    // The sliding log is layer 7 only.
    let frames = trace
        .arrivals
        .iter()
        .all(|a| (MIN_FRAME..=MAX_FRAME).contains(&a.cost));
    trace.spec.algo != Algo::SlidingLog && (!trace.spec.bytes || frames)
}

fn cost(spec: &Spec, rng: &mut Rng) -> u64 {
    if spec.bytes {
        MIN_FRAME + rng.below(MAX_FRAME - MIN_FRAME + 1)
    } else {
        1
    }
}

fn steady(name: String, spec: Spec, start: u64) -> Trace {
    let step = spec.period_ns / spec.rate / 3;
    let arrivals = (0..120)
        .map(|i| Arrival {
            t: start.saturating_add(i * step),
            key: 0,
            cost: 1,
        })
        .collect();
    Trace {
        name,
        spec,
        arrivals,
    }
}

fn bursty(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut arrivals = Vec::new();
    let mut t = start;
    for _ in 0..8 {
        // Each of two keys sends one and a half times its limit at once.
        for i in 0..spec.rate.min(40) * 3 {
            arrivals.push(Arrival {
                t,
                key: (i % 2) as u8,
                cost: cost(&spec, &mut rng),
            });
        }
        t += spec.period_ns / 2 + rng.below(spec.period_ns);
    }
    Trace {
        name,
        spec,
        arrivals,
    }
}

fn idle_gaps(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            // Mostly close together, sometimes idle for several windows.
            t += if rng.below(10) == 0 {
                rng.below(5 * spec.period_ns)
            } else {
                rng.below(spec.period_ns / 4)
            };
            Arrival {
                t,
                key: rng.below(2) as u8,
                cost: cost(&spec, &mut rng),
            }
        })
        .collect();
    Trace {
        name,
        spec,
        arrivals,
    }
}

fn backwards(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            if rng.below(4) == 0 {
                t -= rng.below(3 * spec.period_ns);
            } else {
                t += rng.below(spec.period_ns / 5);
            }
            Arrival { t, key: 0, cost: 1 }
        })
        .collect();
    Trace {
        name,
        spec,
        arrivals,
    }
}

fn frame_costs(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            t += rng.below(spec.period_ns / 20);
            Arrival {
                t,
                key: rng.below(2) as u8,
                cost: cost(&spec, &mut rng),
            }
        })
        .collect();
    Trace {
        name,
        spec,
        arrivals,
    }
}

fn huge_costs(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut t = start;
    let edges = [
        spec.rate,
        spec.rate + 1,
        spec.burst,
        spec.burst + 1,
        u64::MAX / 2,
        u64::MAX,
        0,
    ];
    let arrivals = (0..120)
        .map(|i| {
            t += rng.below(spec.period_ns / 10);
            let cost = if i % 3 == 0 {
                edges[rng.below(edges.len() as u64) as usize]
            } else {
                1 + rng.below(spec.rate)
            };
            Arrival { t, key: 0, cost }
        })
        .collect();
    Trace {
        name,
        spec,
        arrivals,
    }
}

fn odd_period(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            t += rng.below(spec.period_ns / 20);
            Arrival {
                t,
                key: rng.below(2) as u8,
                cost: 1,
            }
        })
        .collect();
    Trace {
        name,
        spec,
        arrivals,
    }
}
