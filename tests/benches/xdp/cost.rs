//! Per-packet cost through BPF_PROG_TEST_RUN: the same frame run a large
//! number of times by the kernel, which reports the mean time per run.
//! The floor is the least a per-source limiter must do: parse to the
//! source and one hash lookup.

use std::path::Path;

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{TestRun, TestRunOptions, Xdp},
};
use limiter::{engine::Engine, rules::RuleSet};

use crate::receivers;
use limiter_tests::generator;

const REPEAT: u32 = 5_000_000;

/// Mean ns per run of `prog` on `frame`, best of `rounds`.
fn time(prog: &Xdp, frame: &[u8], rounds: usize) -> Result<f64> {
    // The first run creates whatever state the frame's source gets.
    prog.test_run(TestRunOptions {
        data_in: Some(frame),
        ..TestRunOptions::default()
    })?;
    let mut best = f64::MAX;
    for _ in 0..rounds {
        let result = prog.test_run(TestRunOptions {
            data_in: Some(frame),
            repeat: REPEAT,
            ..TestRunOptions::default()
        })?;
        best = best.min(result.duration.as_nanos() as f64);
    }
    Ok(best)
}

pub struct Costs {
    pub floor_ns: f64,
    /// The floor and the clock read every exact meter needs: the least
    /// any exact limiter costs here.
    pub floor_clock_ns: f64,
    pub limiter_ns: f64,
}

/// The floor program, the floor with a clock read, and the limiter (500 rules, blocks loaded, the
/// source already tracked), on the same frame: measured in turns, the
/// best of each, so a slow spell of the VM does not favour either.
pub fn measure(frame: &[u8], rounds: usize) -> Result<Costs> {
    let mut costs = Costs {
        floor_ns: f64::MAX,
        floor_clock_ns: f64::MAX,
        limiter_ns: f64::MAX,
    };
    for _ in 0..rounds {
        costs.floor_ns = costs.floor_ns.min(helper_ns("floor", frame, 1)?);
        costs.floor_clock_ns = costs
            .floor_clock_ns
            .min(helper_ns("floor_clock", frame, 1)?);
        costs.limiter_ns =
            costs
                .limiter_ns
                .min(limiter_ns(limiter::kernel::object::OBJECT, frame, 1)?);
    }
    Ok(costs)
}

/// The stages of `limiter-ebpf/src/profile.rs`, in order.
pub const STAGES: [&str; 9] = [
    "read config, interface, counters",
    "parse",
    "hand over (record, tail call)",
    "match the rule (IPv4 table)",
    "load the rule and its counters",
    "look up the key (key table)",
    "check blocks (cached per key)",
    "read the clock",
    "meter (GCRA)",
];

/// A stage's name and the program's cost when cut right after it.
pub struct Stage {
    pub name: &'static str,
    pub ns: f64,
}

/// The program cut after each stage (objects `stage-N` in `dir`, built
/// by `cargo xtask bench`), then whole, on the same frame and rules as
/// `measure`; first the XDP_DROP program, the cost of running anything.
pub fn profile(dir: &Path, frame: &[u8], rounds: usize) -> Result<Vec<Stage>> {
    let mut stages = vec![Stage {
        name: "XDP_DROP (the run itself)",
        ns: helper_ns("drop_all", frame, rounds)?,
    }];
    for (i, name) in STAGES.iter().enumerate() {
        let path = dir.join(format!("stage-{}", i + 1));
        let object = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        stages.push(Stage {
            name,
            ns: limiter_ns(&object, frame, rounds)?,
        });
    }
    stages.push(Stage {
        name: "count (the whole program)",
        ns: limiter_ns(limiter::kernel::object::OBJECT, frame, rounds)?,
    });
    Ok(stages)
}

/// A program of the bench's helper object (`limiter-ebpf/src/flood.rs`).
fn helper_ns(name: &str, frame: &[u8], rounds: usize) -> Result<f64> {
    let mut ebpf = Ebpf::load(&generator::object()?)?;
    let prog: &mut Xdp = ebpf
        .program_mut(name)
        .context(name.to_owned())?
        .try_into()?;
    prog.load()?;
    time(prog, frame, rounds)
}

/// The limiter built as `object`, with the bench's 500 rules and blocks.
pub fn limiter_ns(object: &[u8], frame: &[u8], rounds: usize) -> Result<f64> {
    let pins = Path::new("/sys/fs/bpf/limiter-bench-cost");
    let _ = std::fs::remove_dir_all(pins);
    let rules = RuleSet::parse(
        &receivers::rule_file(receivers::CAPACITY, receivers::Limit::Peers),
        Path::new("bench.yaml"),
    )?;
    let ns = {
        let mut engine = Engine::open_object(object, pins, rules.max_keys)?;
        engine.apply(rules)?;
        for block in receivers::BLOCKS {
            engine.block(block.parse()?, None)?;
        }
        time(engine.datapath().program(), frame, rounds)?
    };
    let _ = std::fs::remove_dir_all(pins);
    Ok(ns)
}
