//! The cargo-mutants command of an area's pass: which packages, files,
//! tests and limits, each option once; the mutants an area has; running it.

use std::{collections::BTreeSet, process::Command};

use anyhow::{Context, Result, bail};

use super::{
    Options,
    areas::{Area, Judge},
    output,
};
use crate::{cargo, root};

/// An area's run: its own tests.
pub(super) fn first_pass<'a>(area: &'a Area, options: &Options) -> Pass<'a> {
    // cargo-mutants' baseline runs the mutated packages' tests only (its
    // `run_baseline` passes them, not `--test-package`'s), where another
    // package's test targets do not exist: such an area's unmutated tree
    // is tested here instead, and cargo-mutants skips its own.
    let own_baseline = area
        .test_packages
        .iter()
        .any(|package| !area.packages.contains(package));
    Pass {
        test_packages: area.test_packages,
        tests: area.tests,
        jobs: area.jobs,
        timeout: options.timeout.unwrap_or(area.timeout),
        skip_baseline: own_baseline,
        build_kernel: false,
    }
}

/// The survivors of an area judged twice, against its second judges.
pub(super) fn second_pass<'a>(area: &'a Area, options: &Options) -> Option<Pass<'a>> {
    let Judge::SecondPass {
        test_packages,
        tests,
    } = area.judge
    else {
        return None;
    };
    Some(Pass {
        test_packages,
        tests,
        jobs: 1,
        timeout: options.timeout.unwrap_or(180),
        // cargo-mutants' baseline runs the mutated package's tests only,
        // where these targets do not exist; pass 1 and `cargo xtask test`
        // ran them on the unmutated tree already.
        skip_baseline: true,
        build_kernel: true,
    })
}

/// One cargo-mutants run over an area: its sample, or (`only`) exactly
/// these names. (cargo-mutants' own `--iterate` retries every mutant not
/// yet caught, those a sample left out included.) Each option is given
/// once: cargo-mutants refuses a repeated `--baseline`.
pub(super) fn mutants_command(
    area: &Area,
    options: &Options,
    pass: &Pass,
    only: Option<&BTreeSet<String>>,
) -> Command {
    let Pass {
        test_packages,
        tests,
        jobs,
        timeout,
        skip_baseline,
        build_kernel,
    } = *pass;
    let mut command = over_area(area);
    for test_package in test_packages {
        command.args(["--test-package", test_package]);
    }
    command
        .args(["--jobs", &jobs.to_string(), "--copy-target=true"])
        .arg("--output")
        .arg(output(area.name));
    match only {
        Some(names) => {
            command.args(["--re", &exact_names(names)]);
        }
        None => {
            if let Some(re) = &options.re {
                command.args(["--re", re]);
            }
            if area.shards > 1 && !options.full {
                // Round robin: one in N over the whole list (cargo-mutants'
                // default takes the first Nth, a file or two).
                command
                    .arg(format!("--shard=0/{}", area.shards))
                    .arg("--sharding=round-robin");
            }
        }
    }
    command.args(["--timeout", &timeout.to_string()]);
    if skip_baseline {
        command.arg("--baseline=skip");
    }
    if build_kernel {
        // The copy's own test-clock object, built from the mutated source.
        command.env("LIMITER_TESTS_BUILD_KERNEL", "1");
    }
    with_binary_env(area, &mut command);
    // The test targets go to every cargo command, the build's too, so
    // that a mutant builds only the tests that judge it; the test
    // binaries' arguments to the test run only.
    let split = tests.iter().position(|a| *a == "--").unwrap_or(tests.len());
    for arg in &tests[..split] {
        command.arg(format!("--cargo-arg={arg}"));
    }
    // The test binaries' arguments as `--cargo-test-arg`s, not after a
    // `--`: options added to the command later stay cargo-mutants'.
    if split < tests.len() {
        command.arg("--cargo-test-arg=--");
        for arg in &tests[split + 1..] {
            command.arg(format!("--cargo-test-arg={arg}"));
        }
    }
    command
}

/// `cargo mutants` over the area's packages and files.
pub(super) fn over_area(area: &Area) -> Command {
    let mut command = cargo();
    command.arg("mutants");
    for package in area.packages {
        command.args(["--package", package]);
    }
    for file in area.files {
        command.args(["--file", file]);
    }
    command
}

/// Every mutant of the area as the code is now (no sample, no `--re`).
pub(super) fn listed(area: &Area) -> Result<BTreeSet<String>> {
    let out = crate::stdout_of(
        over_area(area).arg("--list").current_dir(root()),
        "cargo mutants --list",
    )?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .map(str::to_owned)
        .collect())
}

/// One cargo-mutants run's judges and limits.
#[derive(Clone, Copy)]
pub(super) struct Pass<'a> {
    pub(super) test_packages: &'a [&'a str],
    pub(super) tests: &'a [&'a str],
    pub(super) jobs: u32,
    pub(super) timeout: u64,
    /// The area's tests were run on the unmutated tree already.
    pub(super) skip_baseline: bool,
    /// The tests build the XDP program from each mutated tree.
    pub(super) build_kernel: bool,
}

/// A regular expression that matches exactly these mutant names (as
/// `--list` shows them), escaped as the `regex` crate's `escape` does.
pub(super) fn exact_names(names: &BTreeSet<String>) -> String {
    let escaped: Vec<String> = names
        .iter()
        .map(|name| {
            let mut out = String::with_capacity(name.len() + 8);
            for c in name.chars() {
                if "\\.+*?()|[]{}^$#&-~".contains(c) {
                    out.push('\\');
                }
                out.push(c);
            }
            out
        })
        .collect();
    format!("^({})$", escaped.join("|"))
}

/// The tests of a `binary` area run `limiter` built from the tree they
/// are in (the mutated copy), with the unmutated XDP object.
pub(super) fn with_binary_env(area: &Area, command: &mut Command) {
    if area.binary {
        command
            .env_remove("LIMITER_BIN")
            .env("LIMITER_TESTS_BUILD_BIN", "1")
            .env(
                "LIMITER_EBPF_OBJECT",
                root().join("limiter-ebpf/target/bpfel-unknown-none/release/limiter"),
            );
    }
}

/// Runs cargo-mutants; missed mutants (exit 2) and timeouts (3) are judged
/// afterwards, anything else is a failure.
pub(super) fn run_mutants(command: &mut Command) -> Result<()> {
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
