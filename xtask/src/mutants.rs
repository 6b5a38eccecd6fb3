//! `cargo xtask mutants`: cargo-mutants over `limiter-common`, where every
//! verdict is computed, tested by what exercises it: its own unit and
//! property tests, the conformance corpus (the shared functions, and the
//! XDP program rebuilt from the mutated tree and replayed through
//! BPF_PROG_TEST_RUN) and the layer-7 tests. Surviving mutants must each be
//! explained in `tests/MUTANTS.md`; the run fails on one that is not.

use std::{collections::BTreeSet, fs, path::Path};

use anyhow::{Context, Result, bail};

use crate::{cargo, root, status, step};

#[derive(clap::Args)]
pub struct Options {
    /// Only mutants whose name matches this regular expression
    /// (e.g. `gcra.rs`, `Window::roll`).
    #[arg(long)]
    re: Option<String>,
    /// Seconds a mutant's tests may take before it counts as a timeout.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// List the mutants and exit.
    #[arg(long)]
    list: bool,
}

/// Where cargo-mutants writes `mutants.out/`.
const OUTPUT: &str = "target/mutants";

/// The tests run against each mutant. The proxy tests are left out: they
/// run the `limiter` binary, which cargo-mutants does not rebuild.
const TEST_ARGS: [&str; 12] = [
    "--lib",
    "--test",
    "gcra_properties",
    "--test",
    "conformance",
    "--test",
    "l7",
    "--",
    "--skip",
    "proxy",
    "--skip",
    "upstream",
];

pub fn run(options: &Options) -> Result<()> {
    let mut command = cargo();
    command
        .args(["mutants", "--package", "limiter-common"])
        .args(["--test-package", "limiter-common,limiter-tests"])
        // One build at a time: each uses both cores.
        .args(["--jobs", "1", "--copy-target=true"])
        .args(["--timeout", &options.timeout.to_string()])
        .args(["--output", OUTPUT])
        // The copy's own test-clock object, built from the mutated source.
        .env("LIMITER_TESTS_BUILD_KERNEL", "1")
        .env_remove("LIMITER_TEST_CLOCK_OBJECT");
    if let Some(re) = &options.re {
        command.args(["--re", re]);
    }
    if options.list {
        return status(command.arg("--list"));
    }
    command.arg("--").args(TEST_ARGS);
    step("cargo mutants over limiter-common (one mutant at a time; see target/mutants)");
    // Exit 2 means mutants were missed: judged against MUTANTS.md below.
    let shown = format!("{command:?}");
    let code = command
        .status()
        .with_context(|| format!("starting {shown}"))?
        .code();
    if !matches!(code, Some(0 | 2 | 3)) {
        bail!("{shown} failed ({code:?})");
    }
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
