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
    pub limiter_ns: f64,
}

/// The floor program and the limiter (500 rules, blocks loaded, the
/// source already tracked), on the same frame.
pub fn measure(frame: &[u8], rounds: usize) -> Result<Costs> {
    let mut floor = Ebpf::load(&generator::object()?)?;
    let prog: &mut Xdp = floor.program_mut("floor").context("floor")?.try_into()?;
    prog.load()?;
    let floor_ns = time(prog, frame, rounds)?;

    let pins = Path::new("/sys/fs/bpf/limiter-bench-cost");
    let _ = std::fs::remove_dir_all(pins);
    let rules = RuleSet::parse(
        &receivers::rule_file(receivers::CAPACITY, receivers::Limit::Peers),
        Path::new("bench.yaml"),
    )?;
    let limiter_ns = {
        let mut engine = Engine::open(pins, rules.max_keys)?;
        engine.apply(rules)?;
        for block in receivers::BLOCKS {
            engine.block(block.parse()?, None)?;
        }
        time(engine.datapath().program(), frame, rounds)?
    };
    let _ = std::fs::remove_dir_all(pins);
    Ok(Costs {
        floor_ns,
        limiter_ns,
    })
}
