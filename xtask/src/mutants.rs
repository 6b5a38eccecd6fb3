//! `cargo xtask mutants --area NAME`: mutation testing by area, each
//! judged by the tests that exercise it and sized to run in at most 30
//! minutes on two cores (`--area all`: one after another).
//!
//! - `common`: `limiter-common`, where every verdict is computed, in two
//!   passes: its own unit and property tests and the reference model
//!   (seconds per mutant), then the survivors against the conformance
//!   corpus through the XDP program rebuilt from the mutated tree
//!   (BPF_PROG_TEST_RUN) and the layer-7 tests.
//! - `fleet`, `relay`, `escalation`, `trace`, `validation`: modules of
//!   `limiter-userspace` (and `limiter-common`'s escalation), through
//!   cargo-mutants; where the judging tests run the `limiter` binary, they
//!   build it from the mutated tree (`LIMITER_TESTS_BUILD_BIN`).
//! - `kernel`: `limiter-ebpf`, which cargo-mutants cannot build (a
//!   workspace of its own, for the BPF target): its mutants are listed by
//!   cargo-mutants and applied here, one at a time, to a copy of the
//!   program's sources; each is built (the release and the test-clock
//!   object) and judged by the BPF_PROG_TEST_RUN tests and the
//!   conformance replays, run from test binaries built once.
//!
//! Every area must catch at least 90% of its viable mutants, and each
//! survivor must be explained in `tests/MUTANTS.md`; the run fails
//! otherwise.

mod areas;
mod command;
mod kernel;
mod tally;

use std::{collections::BTreeSet, path::PathBuf};

use anyhow::{Context, Result, bail};

use crate::{cargo, root, step};
pub use areas::AreaName;
use areas::{Area, Judge};
use command::{
    Pass, first_pass, listed, mutants_command, run_mutants, second_pass, with_binary_env,
};
pub use tally::{Tally, write_tally};
use tally::{read_tally, unexplained};

#[derive(clap::Args)]
pub struct Options {
    /// The area to mutate, or `all` (every area, one after another).
    #[arg(long, value_enum, default_value = "common")]
    area: AreaName,
    /// Only mutants whose name matches this regular expression
    /// (e.g. `gcra.rs`, `Window::roll`); the outcome is merged into the
    /// area's last one.
    #[arg(long)]
    re: Option<String>,
    /// Seconds a mutant's tests may take before it counts as a timeout
    /// (default: the area's own).
    #[arg(long)]
    timeout: Option<u64>,
    /// List the mutants and exit.
    #[arg(long)]
    list: bool,
    /// Every mutant of the area, where its default run takes a sample
    /// that fits 30 minutes.
    #[arg(long)]
    full: bool,
    /// Only the mutants the area's last run did not catch (after adding
    /// the tests that should): what they are caught by now is added to
    /// that run's outcome.
    #[arg(long)]
    iterate: bool,
}

/// Where each area's cargo-mutants output goes: `target/mutants/<area>`.
fn output(area: &str) -> PathBuf {
    root().join("target/mutants").join(area)
}

pub fn run(options: &Options) -> Result<()> {
    let areas = areas::chosen(options.area);
    let mut failed = Vec::new();
    let mut report = Vec::new();
    for area in &areas {
        step(&format!("mutants: area {} ({})", area.name, area.what));
        let tally = match area.judge {
            Judge::Kernel => kernel::run(area, options)?,
            _ => run_cargo_mutants(area, options)?,
        };
        if options.list {
            continue;
        }
        let unexplained = unexplained(&tally)?;
        println!(
            "\narea {}: {} mutants, {} viable, {} caught ({} as timeouts), {} missed, {} unviable: {:.1}% caught; {} unexplained",
            area.name,
            tally.viable() + tally.unviable.len(),
            tally.viable(),
            tally.caught.len() + tally.timeout.len(),
            tally.timeout.len(),
            tally.missed.len(),
            tally.unviable.len(),
            tally.score(),
            unexplained.len()
        );
        for name in &unexplained {
            println!("  not explained in tests/MUTANTS.md: {name}");
        }
        if tally.score() < 90.0 || !unexplained.is_empty() {
            failed.push(area.name);
        }
        report.push((area.name, tally));
    }
    if report.len() > 1 {
        println!("\n| area | viable | caught | missed | score |\n| --- | --- | --- | --- | --- |");
        for (name, tally) in &report {
            println!(
                "| {name} | {} | {} | {} | {:.1}% |",
                tally.viable(),
                tally.caught.len() + tally.timeout.len(),
                tally.missed.len(),
                tally.score()
            );
        }
    }
    if !failed.is_empty() {
        bail!(
            "areas {failed:?}: under 90% caught, or survivors not explained: add a test that \
             kills each, or explain it in tests/MUTANTS.md"
        );
    }
    Ok(())
}

/// cargo-mutants over an area of the workspace: one pass, or the two of
/// `common`.
fn run_cargo_mutants(area: &Area, options: &Options) -> Result<Tally> {
    let out = output(area.name);
    let first = first_pass(area, options);
    if options.list {
        let list = Pass {
            tests: &[],
            ..first
        };
        crate::status(mutants_command(area, options, &list, None).arg("--list"))?;
        return Ok(Tally::default());
    }
    // An iteration runs again what the last run did not catch; the rest
    // of its outcome stands. (Decided before any build or baseline: an
    // area with nothing to run again needs neither.)
    let (last, again) = if options.iterate {
        let mut last = read_tally(&out)?;
        let listed = listed(area)?;
        // (A run narrowed by `--re` ran part of the list: the rest stands.)
        if options.re.is_none() {
            last.forget_unlisted(&listed);
        }
        let again = last.again(&listed);
        (last, again)
    } else if options.re.is_some() {
        // A run of a few mutants by name: the rest of the last outcome
        // stands.
        (read_tally(&out)?, BTreeSet::new())
    } else {
        (Tally::default(), BTreeSet::new())
    };
    if options.iterate && again.is_empty() {
        println!("the last run of area {} caught every mutant", area.name);
        write_tally(&out, &last)?;
        return Ok(last);
    }
    if area.binary {
        // Built once here, so each mutated copy (which takes `target/`
        // along) rebuilds it incrementally.
        step("building the limiter binary the tests build from each mutated tree");
        crate::status(
            cargo()
                .args([
                    "build",
                    "--package",
                    "limiter-userspace",
                    "--bin",
                    "limiter",
                    "--features",
                    crate::build::FAULTS,
                ])
                .arg("--target-dir")
                .arg(root().join(areas::TESTS_BIN_TARGET))
                .env(
                    "LIMITER_EBPF_OBJECT",
                    root().join("limiter-ebpf/target/bpfel-unknown-none/release/limiter"),
                ),
        )?;
    }
    if first.skip_baseline {
        step(&format!(
            "mutants: area {}: its tests on the unmutated tree must pass",
            area.name
        ));
        let mut baseline = cargo();
        baseline.arg("test");
        for package in area.test_packages {
            baseline.args(["--package", package]);
        }
        with_binary_env(area, &mut baseline);
        crate::status(baseline.args(area.tests))
            .context("the area's tests fail on the unmutated tree: no mutant can be judged")?;
    }
    run_mutants(&mut mutants_command(
        area,
        options,
        &first,
        options.iterate.then_some(&again),
    ))?;
    let mut tally = read_tally(&out)?.after(last);
    if let Some(second) = second_pass(area, options)
        && !tally.missed.is_empty()
    {
        step(&format!(
            "mutants: area {}, pass 2: the survivors against the XDP program rebuilt from \
             each mutated tree and the layer-7 tests, one at a time",
            area.name
        ));
        let survivors = tally.missed.clone();
        run_mutants(&mut mutants_command(
            area,
            options,
            &second,
            Some(&survivors),
        ))?;
        tally = read_tally(&out)?.after(tally);
    }
    // cargo-mutants' lists hold its last run's mutants only: the whole
    // outcome, for the next iteration.
    write_tally(&out, &tally)?;
    Ok(tally)
}

#[cfg(test)]
mod tests;
