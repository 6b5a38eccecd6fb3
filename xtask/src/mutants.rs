//! `cargo xtask mutants`: cargo-mutants over `limiter-common`, where every
//! verdict is computed, tested by what exercises it, in two passes so it
//! fits two cores: first its own unit and property tests and the reference
//! model (seconds per mutant), then, for the mutants that survived, the
//! conformance corpus through the XDP program rebuilt from the mutated tree
//! (BPF_PROG_TEST_RUN) and the layer-7 tests (a minute per mutant).
//! Surviving mutants must each be explained in `tests/MUTANTS.md`; the run
//! fails on one that is not.

use std::{collections::BTreeSet, fs, path::Path};

use anyhow::{Context, Result, bail};

use crate::{cargo, root, status, step};

#[derive(clap::Args)]
pub struct Options {
    /// Only mutants whose name matches this regular expression
    /// (e.g. `gcra.rs`, `Window::roll`).
    #[arg(long)]
    re: Option<String>,
    /// Seconds a mutant's tests may take before it counts as a timeout
    /// (default: cargo-mutants' own, five times the unmutated tests' time).
    #[arg(long)]
    timeout: Option<u64>,
    /// List the mutants and exit.
    #[arg(long)]
    list: bool,
}

/// Where cargo-mutants writes `mutants.out/`.
const OUTPUT: &str = "target/mutants";

/// The second pass's tests: the corpus through the XDP program (rebuilt
/// from the mutated tree) and over HTTP. The proxy tests are left out:
/// they run the `limiter` binary, which cargo-mutants does not rebuild.
const KERNEL_AND_HTTP_TESTS: [&str; 10] = [
    "--test",
    "conformance",
    "--test",
    "l7",
    "--",
    "--skip",
    "proxy",
    "--skip",
    "upstream",
    "--test-threads=1",
];

pub fn run(options: &Options) -> Result<()> {
    let mutants = |test_packages: &str, jobs: &str| {
        let mut command = cargo();
        command
            .args(["mutants", "--package", "limiter-common"])
            .args(["--test-package", test_packages])
            .args(["--jobs", jobs, "--copy-target=true"])
            .args(["--output", OUTPUT]);
        if let Some(re) = &options.re {
            command.args(["--re", re]);
        }
        if let Some(seconds) = options.timeout {
            command.args(["--timeout", &seconds.to_string()]);
        }
        command
    };
    if options.list {
        return status(mutants("limiter-common", "1").arg("--list"));
    }
    step(
        "mutants, pass 1: limiter-common's own tests and the reference model \
         (limiter-conformance), two at a time",
    );
    run_mutants(&mut mutants("limiter-common,limiter-conformance", "2"))?;
    step(
        "mutants, pass 2: the survivors against the XDP program rebuilt from each \
         mutated tree and the layer-7 tests, one at a time",
    );
    let mut second = mutants("limiter-tests", "1");
    // cargo-mutants' baseline runs the mutated package's tests only, where
    // these targets do not exist; pass 1 and `cargo xtask test` ran them
    // on the unmutated tree already.
    second.args(["--iterate", "--baseline=skip"]);
    if options.timeout.is_none() {
        second.args(["--timeout", "180"]);
    }
    second
        // The copy's own test-clock object, built from the mutated source.
        .env("LIMITER_TESTS_BUILD_KERNEL", "1")
        .arg("--")
        .args(KERNEL_AND_HTTP_TESTS);
    run_mutants(&mut second)?;
    judge()
}

/// Runs cargo-mutants; missed mutants (exit 2) and timeouts (3) are judged
/// against MUTANTS.md afterwards, anything else is a failure.
fn run_mutants(command: &mut std::process::Command) -> Result<()> {
    let shown = format!("{command:?}");
    let code = command
        .status()
        .with_context(|| format!("starting {shown}"))?
        .code();
    if !matches!(code, Some(0 | 2 | 3)) {
        bail!("{shown} failed ({code:?})");
    }
    Ok(())
}

/// Every surviving mutant must be explained in tests/MUTANTS.md.
fn judge() -> Result<()> {
    let out = root().join(OUTPUT).join("mutants.out");
    let survivors = read_names(&out.join("missed.txt"))?
        .into_iter()
        .chain(read_names(&out.join("timeout.txt"))?)
        .collect::<BTreeSet<_>>();
    let explained =
        fs::read_to_string(root().join("tests/MUTANTS.md")).context("reading tests/MUTANTS.md")?;
    let unexplained: Vec<&String> = survivors
        .iter()
        .filter(|name| !explained.contains(&without_position(name)))
        .collect();
    println!(
        "\n{} mutants survived, {} of them not explained in tests/MUTANTS.md",
        survivors.len(),
        unexplained.len()
    );
    for name in &unexplained {
        println!("  {name}");
    }
    if !unexplained.is_empty() {
        bail!("add a test that kills each mutant above, or explain it in tests/MUTANTS.md");
    }
    Ok(())
}

fn read_names(path: &Path) -> Result<Vec<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// `file.rs:12:5: replace ...` as `file.rs: replace ...`: the report names
/// mutants without line and column, which move with every edit.
fn without_position(name: &str) -> String {
    let mut parts = name.splitn(4, ':');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(file), Some(_line), Some(_column), Some(rest)) => format!("{file}:{rest}"),
        _ => name.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::without_position;

    #[test]
    fn names_lose_their_position() {
        assert_eq!(
            without_position("limiter-common/src/gcra.rs:95:9: replace + with - in Gcra::check"),
            "limiter-common/src/gcra.rs: replace + with - in Gcra::check"
        );
    }
}
