//! The conformance corpus: arrival traces for every algorithm, built
//! deterministically (a fixed-seed xorshift), covering steady and bursty
//! floods, idle gaps, clocks that go backwards, huge costs and the ends of
//! the u64 clock.

use crate::{
    escalation::EscalationTrace,
    reference::{Algo, Arrival, Escalate, Limit, LimitChange, Meter, Spec, Trace},
};

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
        let meter = |rate, burst| Meter {
            rate,
            burst: if algo == Algo::Gcra { burst } else { 0 },
        };
        let limit = |period_ns, requests, bytes| Limit {
            period_ns,
            requests,
            bytes,
        };
        let spec = |limit, aggregate| Spec {
            algo,
            limit,
            aggregate,
            second: None,
            third: None,
            costly: None,
            soft: None,
            escalate: None,
            shadow: false,
        };
        let packets = |rate, period_ns, b| spec(limit(period_ns, Some(meter(rate, b)), None), None);
        let bytes = |rate, period_ns, b| spec(limit(period_ns, None, Some(meter(rate, b))), None);
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
        traces.push(backwards_then_recovery(
            name("clock-back-10s-then-recovery"),
            packets(10, SEC, 4),
            1_700_000_000 * SEC,
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
        traces.push(close_together(
            name("bytes"),
            bytes(8_000, SEC, 3_000),
            1_700_000_000 * SEC,
            19,
            2,
        ));
        traces.push(zero_costs(
            name("zero-costs"),
            bytes(3_000, SEC, 2_000),
            1_700_000_000 * SEC,
            37,
        ));
        traces.push(huge_costs(
            name("huge-costs"),
            bytes(10_000, SEC, 3_000),
            1_700_000_000 * SEC,
            23,
        ));
        traces.push(close_together(
            name("odd-period"),
            packets(7, 3 * SEC + 1, 3),
            1_700_000_000 * SEC,
            29,
            2,
        ));
        // Several meters on one request: a refusal by any charges none,
        // so a meter that admitted first is refunded.
        traces.push(close_together(
            name("packets-and-bytes"),
            spec(
                limit(SEC, Some(meter(20, 10)), Some(meter(8_000, 4_000))),
                None,
            ),
            1_700_000_000 * SEC,
            41,
            2,
        ));
        traces.push(bursty(
            name("key-and-aggregate"),
            spec(
                limit(SEC, Some(meter(10, 5)), None),
                Some(limit(SEC, Some(meter(14, 8)), None)),
            ),
            1_700_000_000 * SEC,
            43,
        ));
        // Limits lowered, then raised, live (windows keep their unit:
        // their counts are per window).
        let period = |p| if algo == Algo::Gcra { p } else { SEC };
        traces.push(changing(
            name("limit-lowered-then-raised"),
            packets(20, SEC, 20),
            &[packets(5, period(2 * SEC), 3), packets(40, period(SEC), 30)],
            1_700_000_000 * SEC,
            53,
        ));
        traces.push(changing(
            name("key-and-aggregate-changed"),
            spec(
                limit(SEC, Some(meter(10, 5)), Some(meter(8_000, 4_000))),
                Some(limit(SEC, Some(meter(14, 8)), None)),
            ),
            &[spec(
                limit(SEC, Some(meter(4, 6)), Some(meter(20_000, 3_000))),
                Some(limit(SEC, Some(meter(6, 2)), None)),
            )],
            1_700_000_000 * SEC,
            59,
        ));
        traces.push(close_together(
            name("four-meters"),
            spec(
                limit(SEC, Some(meter(30, 10)), Some(meter(12_000, 6_000))),
                Some(limit(
                    2 * SEC,
                    Some(meter(50, 15)),
                    Some(meter(40_000, 10_000)),
                )),
            ),
            1_700_000_000 * SEC,
            47,
            3,
        ));
        // Two limits on one key (`limits`), a request passing only if both
        // allow it: 10 a second and 30 in 20 s; for windows, which keep
        // one window start a key, 10 and 6 a second.
        let second = if algo == Algo::Gcra {
            limit(20 * SEC, Some(meter(30, 30)), None)
        } else {
            limit(SEC, Some(meter(6, 6)), None)
        };
        traces.push(close_together(
            name("two-limits"),
            Spec {
                second: Some(second),
                ..packets(10, SEC, 5)
            },
            1_700_000_000 * SEC,
            53,
            2,
        ));
        // Credits (`cost`): about a third of the arrivals in a class that
        // costs 3, against 10 a second (burst 5) and an aggregate of 14
        // a second, two keys.
        traces.push(close_together(
            name("credits"),
            Spec {
                costly: Some(3),
                ..spec(
                    limit(SEC, Some(meter(10, 5)), None),
                    Some(limit(SEC, Some(meter(14, 8)), None)),
                )
            },
            1_700_000_000 * SEC,
            71,
            2,
        ));
        // Three limits on one key (GCRA: a key's state holds three
        // meters): 10 requests and 6,000 bytes a second, and 30 requests
        // in 20 s, as `limits: [ { rate, bytes }, { rate } ]`.
        if algo == Algo::Gcra {
            traces.push(close_together(
                name("three-limits"),
                Spec {
                    third: Some(limit(20 * SEC, Some(meter(30, 30)), None)),
                    ..spec(
                        limit(SEC, Some(meter(10, 5)), Some(meter(6_000, 3_000))),
                        None,
                    )
                },
                1_700_000_000 * SEC,
                59,
                2,
            ));
            // Three: 10 requests a second, 6,000 bytes a second and
            // 8,000 bytes in 10 s (the third in bytes).
            traces.push(close_together(
                name("three-limits-bytes"),
                Spec {
                    third: Some(limit(10 * SEC, None, Some(meter(8_000, 8_000)))),
                    ..spec(
                        limit(SEC, Some(meter(10, 5)), Some(meter(6_000, 3_000))),
                        None,
                    )
                },
                1_700_000_000 * SEC,
                61,
                2,
            ));
            // The third limit lowered, then raised with another period:
            // its state is carried over as the others' are.
            // (On a packet and a byte limit, so the third is the third
            // word's, not the byte meter's second packet limit.)
            let with_third = |rate, period_ns, burst| Spec {
                third: Some(limit(period_ns, Some(meter(rate, burst)), None)),
                ..spec(
                    limit(SEC, Some(meter(10, 5)), Some(meter(6_000, 3_000))),
                    None,
                )
            };
            traces.push(changing(
                name("third-limit-changed"),
                with_third(40, 10 * SEC, 20),
                &[with_third(12, 10 * SEC, 6), with_third(60, 5 * SEC, 30)],
                1_700_000_000 * SEC,
                67,
            ));
            // Soft limits (GCRA only: a window key's state has no room
            // for the soft meter). What the other meters admit is charged
            // to the key's soft meter, its credits; what that would refuse
            // is admitted all the same and counted over it.
            let soft =
                |rate, period_ns, burst| Some(limit(period_ns, Some(meter(rate, burst)), None));
            // Credits: a third of the arrivals cost 3, against 30 in 3 s
            // (burst 5), soft 5 a second (burst 4), two keys. Paced by the
            // 3 s, each key sends about 5 a second, 8 credits: mostly
            // within the hard limit, and about the soft limit, which
            // charging soft 1 per arrival would be within.
            traces.push(close_together(
                name("soft-credits"),
                Spec {
                    costly: Some(3),
                    soft: soft(5, SEC, 4),
                    ..packets(30, 3 * SEC, 5)
                },
                1_700_000_000 * SEC,
                73,
                2,
            ));
            // Two limits on the key, 10 a second and 30 in 20 s, soft 20
            // in 5 s (burst 3): the soft meter is the key's third word.
            traces.push(close_together(
                name("soft-two-limits"),
                Spec {
                    second: Some(limit(20 * SEC, Some(meter(30, 30)), None)),
                    soft: soft(20, 5 * SEC, 3),
                    ..packets(10, SEC, 5)
                },
                1_700_000_000 * SEC,
                79,
                2,
            ));
            // The same with an aggregate (42 in 3 s, burst 8), which the
            // two keys together go over: what it refuses is charged
            // nothing soft either.
            traces.push(close_together(
                name("soft-credits-aggregate"),
                Spec {
                    costly: Some(3),
                    soft: soft(5, SEC, 4),
                    ..spec(
                        limit(3 * SEC, Some(meter(30, 5)), None),
                        Some(limit(3 * SEC, Some(meter(42, 8)), None)),
                    )
                },
                1_700_000_000 * SEC,
                83,
                2,
            ));
        }
    }
    traces
}

/// The escalation traces (GCRA, packets, `escalate: { after: 2s, block:
/// 4.5s }` with scope `key`, looks once a second): the same arrivals
/// with the escalation enforced, under the rule's dry run (`action:
/// shadow`) and under the global one.
pub fn escalation_corpus() -> Vec<EscalationTrace> {
    let start = 1_700_000_000 * SEC;
    let spec = Spec {
        algo: Algo::Gcra,
        limit: Limit {
            period_ns: SEC,
            requests: Some(Meter { rate: 10, burst: 5 }),
            bytes: None,
        },
        aggregate: None,
        second: None,
        third: None,
        costly: None,
        soft: None,
        escalate: Some(Escalate {
            after_ns: 2 * SEC,
            block_ns: 4 * SEC + SEC / 2,
        }),
        shadow: false,
    };
    let looks: Vec<u64> = (1..=24).map(|k| start + k * SEC).collect();
    let arrivals = escalating(start);
    let escalation = |name: &str, shadow, global_dry_run| EscalationTrace {
        trace: trace(
            format!("Gcra/{name}"),
            Spec { shadow, ..spec },
            arrivals.clone(),
        ),
        looks: looks.clone(),
        global_dry_run,
    };
    // A key that floods, is held, and is polite from then on (4 a second
    // against 10): held once, never again at its block's end (`after: 1s`,
    // a block of whole seconds, so a look falls on the block's end).
    let polite = Spec {
        escalate: Some(Escalate {
            after_ns: SEC,
            block_ns: 2 * SEC,
        }),
        ..spec
    };
    let mut polite_arrivals: Vec<Arrival> = (0..90)
        .map(|i| start + 1_000_003 + i * SEC / 30)
        .chain((0..60).map(|i| start + 3 * SEC + 3_000_007 + i * SEC / 4))
        .map(|t| Arrival {
            t,
            key: 0,
            cost: 1,
            costly: false,
        })
        .collect();
    polite_arrivals.sort_by_key(|a| a.t);
    vec![
        escalation("escalation", false, false),
        escalation("escalation-dry-run", true, false),
        escalation("escalation-global-dry-run", false, true),
        EscalationTrace {
            trace: trace(
                "Gcra/escalation-then-polite".into(),
                polite,
                polite_arrivals,
            ),
            looks: looks.clone(),
            global_dry_run: false,
        },
    ]
}

/// Three keys against 10 a second (burst 5), for 24 s from `start`:
/// key 0 floods at 30 a second for 12 s, then sends 4 a second; key 1
/// sends 5 a second throughout (never over its limit); key 2 sends bursts
/// of 8 (5 admitted from an empty bucket, 3 refused), now a second apart
/// and now two, so that it is over at some looks in a row and not at the
/// next, then at enough in a row, and a last burst 0.2 s after a block
/// that began at 15 s would end (its bucket, exactly full then, has
/// drained 2 packets' worth).
fn escalating(start: u64) -> Vec<Arrival> {
    let arrival = |t, key| Arrival {
        t,
        key,
        cost: 1,
        costly: false,
    };
    let mut arrivals = Vec::new();
    let every = |from: u64, step: u64, until: u64| {
        (0..)
            .map(move |i| from + i * step)
            .take_while(move |&t| t < until)
    };
    // Odd offsets: no arrival at the instant of a look.
    arrivals.extend(every(start + 1_000_003, SEC / 30, start + 12 * SEC).map(|t| arrival(t, 0)));
    arrivals.extend(
        every(start + 12 * SEC + 3_000_007, SEC / 4, start + 24 * SEC).map(|t| arrival(t, 0)),
    );
    arrivals.extend(every(start + 50_000_011, SEC / 5, start + 24 * SEC).map(|t| arrival(t, 1)));
    let bursts = [2, 3, 5, 7, 8, 12, 13, 14, 15, 16, 17].map(|s| start + s * SEC + SEC / 2);
    for t in bursts.into_iter().chain([start + 19 * SEC + 7 * SEC / 10]) {
        arrivals.extend((0..8).map(|_| arrival(t, 2)));
    }
    arrivals.sort_by_key(|a| a.t);
    arrivals
}

/// Whether every cost of the trace fits in a frame (or is a packet).
pub fn replayable_as_frames(trace: &Trace) -> bool {
    // The sliding log is layer 7 only.
    let frames = trace
        .arrivals
        .iter()
        .all(|a| (MIN_FRAME..=MAX_FRAME).contains(&a.cost));
    trace.spec.algo != Algo::SlidingLog && (!trace.spec.charges_bytes() || frames)
}

/// The rate and period the arrivals of a trace are paced by: the key's
/// first meter's.
fn pace(spec: &Spec) -> (u64, u64) {
    let meter = spec
        .limit
        .requests
        .or(spec.limit.bytes)
        .expect("a trace's rule has a meter");
    (meter.rate, spec.limit.period_ns)
}

fn cost(spec: &Spec, rng: &mut Rng) -> u64 {
    if spec.charges_bytes() {
        MIN_FRAME + rng.below(MAX_FRAME - MIN_FRAME + 1)
    } else {
        1
    }
}

fn trace(name: String, spec: Spec, arrivals: Vec<Arrival>) -> Trace {
    Trace {
        name,
        spec,
        arrivals,
        changes: Vec::new(),
    }
}

/// [`bursty`] arrivals under `spec`, its limits replaced by each of
/// `then` in turn at even intervals (between two bursts, so some keys are
/// in debt and some are not; the aggregate too).
fn changing(name: String, spec: Spec, then: &[Spec], start: u64, seed: u64) -> Trace {
    let mut trace = bursty(name, spec, start, seed);
    let n = trace.arrivals.len();
    for (k, spec) in then.iter().enumerate() {
        let at = n * (k + 1) / (then.len() + 1);
        // Between the arrival before and this one.
        let t = trace.arrivals[at - 1].t / 2 + trace.arrivals[at].t / 2;
        trace.changes.push(LimitChange { at, t, spec: *spec });
    }
    trace
}

fn steady(name: String, spec: Spec, start: u64) -> Trace {
    let (rate, period) = pace(&spec);
    let step = period / rate / 3;
    let arrivals = (0..120)
        .map(|i| Arrival {
            t: start.saturating_add(i * step),
            key: 0,
            cost: 1,
            costly: false,
        })
        .collect();
    trace(name, spec, arrivals)
}

fn bursty(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let (rate, period) = pace(&spec);
    let mut rng = Rng(seed);
    let mut arrivals = Vec::new();
    let mut t = start;
    for _ in 0..8 {
        // Each of two keys sends one and a half times its limit at once.
        for i in 0..rate.min(40) * 3 {
            arrivals.push(Arrival {
                t,
                key: (i % 2) as u8,
                cost: cost(&spec, &mut rng),
                costly: spec.costly.is_some() && rng.below(3) == 0,
            });
        }
        t += period / 2 + rng.below(period);
    }
    trace(name, spec, arrivals)
}

fn idle_gaps(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let (_, period) = pace(&spec);
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            // Mostly close together, sometimes idle for several windows.
            t += if rng.below(10) == 0 {
                rng.below(5 * period)
            } else {
                rng.below(period / 4)
            };
            Arrival {
                t,
                key: rng.below(2) as u8,
                cost: cost(&spec, &mut rng),
                costly: spec.costly.is_some() && rng.below(3) == 0,
            }
        })
        .collect();
    trace(name, spec, arrivals)
}

fn backwards(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let (_, period) = pace(&spec);
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            if rng.below(4) == 0 {
                t -= rng.below(3 * period);
            } else {
                t += rng.below(period / 5);
            }
            Arrival {
                t,
                key: 0,
                cost: 1,
                costly: false,
            }
        })
        .collect();
    trace(name, spec, arrivals)
}

/// A key exhausts its budget, then the clock jumps back ten periods and
/// walks forward in small steps past where it was: the verdicts pin down
/// exactly when the key is admitted again (a clamp that refilled the
/// bucket at the jump, or one that never let the key recover, both show).
fn backwards_then_recovery(name: String, spec: Spec, start: u64) -> Trace {
    let (rate, period) = pace(&spec);
    let mut arrivals: Vec<Arrival> = (0..3 * rate)
        .map(|_| Arrival {
            t: start,
            key: 0,
            cost: 1,
            costly: false,
        })
        .collect();
    let step = period / rate / 4;
    let mut t = start - 10 * period;
    while t < start + 3 * period {
        arrivals.push(Arrival {
            t,
            key: 0,
            cost: 1,
            costly: false,
        });
        t += if t < start - period { period / 2 } else { step };
    }
    trace(name, spec, arrivals)
}

/// Arrivals from `keys` keys a twentieth of a period apart at most, each
/// costing a whole frame (byte limits) or 1.
fn close_together(name: String, spec: Spec, start: u64, seed: u64, keys: u64) -> Trace {
    let (_, period) = pace(&spec);
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            t += rng.below(period / 20);
            Arrival {
                t,
                key: rng.below(keys) as u8,
                cost: cost(&spec, &mut rng),
                costly: spec.costly.is_some() && rng.below(3) == 0,
            }
        })
        .collect();
    trace(name, spec, arrivals)
}

/// Requests that cost nothing, mixed with ones that do: free requests
/// conform even when the budget is spent, and change nothing.
fn zero_costs(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let (rate, period) = pace(&spec);
    let mut rng = Rng(seed);
    let mut t = start;
    let arrivals = (0..150)
        .map(|_| {
            t += rng.below(period / 30);
            let cost = if rng.below(3) == 0 {
                0
            } else {
                1 + rng.below(rate / 4)
            };
            Arrival {
                t,
                key: rng.below(2) as u8,
                cost,
                costly: false,
            }
        })
        .collect();
    trace(name, spec, arrivals)
}

fn huge_costs(name: String, spec: Spec, start: u64, seed: u64) -> Trace {
    let (rate, period) = pace(&spec);
    let burst = spec.limit.bytes.map_or(0, |m| m.burst);
    let mut rng = Rng(seed);
    let mut t = start;
    let edges = [rate, rate + 1, burst, burst + 1, u64::MAX / 2, u64::MAX, 0];
    let arrivals = (0..120)
        .map(|i| {
            t += rng.below(period / 10);
            let cost = if i % 3 == 0 {
                edges[rng.below(edges.len() as u64) as usize]
            } else {
                1 + rng.below(rate)
            };
            Arrival {
                t,
                key: 0,
                cost,
                costly: false,
            }
        })
        .collect();
    trace(name, spec, arrivals)
}
