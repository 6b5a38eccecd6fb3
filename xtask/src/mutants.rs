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
mod kernel;

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{cargo, root, step};
pub use areas::AreaName;
use areas::{Area, Judge};

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

/// How an area's run ended.
#[derive(Debug, Default)]
pub struct Tally {
    pub caught: BTreeSet<String>,
    pub missed: BTreeSet<String>,
    pub timeout: BTreeSet<String>,
    pub unviable: BTreeSet<String>,
}

impl Tally {
    /// This run's outcome on top of an earlier run's, which it re-ran in
    /// part: an earlier outcome stands unless this run ran that mutant
    /// again. A survivor counts as run again when a mutant of its
    /// description was (its line may have moved); a caught one only by its
    /// own name (another mutant of the same description, e.g. another
    /// `<< with >>` of the file, is not it).
    pub fn after(self, earlier: Tally) -> Tally {
        let ran: BTreeSet<&String> = [&self.caught, &self.missed, &self.timeout, &self.unviable]
            .into_iter()
            .flatten()
            .collect();
        let ran_descriptions: BTreeSet<String> = ran.iter().map(|n| without_position(n)).collect();
        let ran_again = |n: &String, survived: bool| {
            ran.contains(n) || (survived && ran_descriptions.contains(&without_position(n)))
        };
        let merged = |earlier: &BTreeSet<String>, now: &BTreeSet<String>, survived: bool| {
            earlier
                .iter()
                .filter(|n| !ran_again(n, survived))
                .chain(now)
                .cloned()
                .collect::<BTreeSet<String>>()
        };
        Tally {
            caught: merged(&earlier.caught, &self.caught, false),
            missed: merged(&earlier.missed, &self.missed, true),
            timeout: merged(&earlier.timeout, &self.timeout, true),
            unviable: merged(&earlier.unviable, &self.unviable, false),
        }
    }

    /// Forgets the mutants the code no longer has (`listed`: every mutant
    /// of the area now), by name without position: lines move.
    pub fn forget_unlisted(&mut self, listed: &BTreeSet<String>) {
        let listed: BTreeSet<String> = listed.iter().map(|n| without_position(n)).collect();
        for outcome in [
            &mut self.caught,
            &mut self.missed,
            &mut self.timeout,
            &mut self.unviable,
        ] {
            outcome.retain(|n| listed.contains(&without_position(n)));
        }
    }

    /// What an iteration runs of `listed`: a survivor still where it was,
    /// alone; one whose line moved, with every mutant of its description.
    pub fn again(&self, listed: &BTreeSet<String>) -> BTreeSet<String> {
        let survivors: Vec<&String> = self.missed.iter().chain(&self.timeout).collect();
        let moved: BTreeSet<String> = survivors
            .iter()
            .filter(|n| !listed.contains(**n))
            .map(|n| without_position(n))
            .collect();
        listed
            .iter()
            .filter(|n| survivors.contains(n) || moved.contains(&without_position(n)))
            .cloned()
            .collect()
    }

    fn viable(&self) -> usize {
        self.caught.len() + self.missed.len() + self.timeout.len()
    }

    /// Caught of the viable, in percent (a timeout counts as caught: a
    /// mutant that makes the tests hang is noticed, by the timeout).
    fn score(&self) -> f64 {
        if self.viable() == 0 {
            return 100.0;
        }
        100.0 * (self.caught.len() + self.timeout.len()) as f64 / self.viable() as f64
    }
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
                    crate::FAULTS,
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

/// An area's run: its own tests.
fn first_pass<'a>(area: &'a Area, options: &Options) -> Pass<'a> {
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
fn second_pass<'a>(area: &'a Area, options: &Options) -> Option<Pass<'a>> {
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
fn mutants_command(
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
fn over_area(area: &Area) -> Command {
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
fn listed(area: &Area) -> Result<BTreeSet<String>> {
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
struct Pass<'a> {
    test_packages: &'a [&'a str],
    tests: &'a [&'a str],
    jobs: u32,
    timeout: u64,
    /// The area's tests were run on the unmutated tree already.
    skip_baseline: bool,
    /// The tests build the XDP program from each mutated tree.
    build_kernel: bool,
}

/// A regular expression that matches exactly these mutant names (as
/// `--list` shows them), escaped as the `regex` crate's `escape` does.
fn exact_names(names: &BTreeSet<String>) -> String {
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
fn with_binary_env(area: &Area, command: &mut Command) {
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
fn run_mutants(command: &mut Command) -> Result<()> {
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

/// The outcome lists cargo-mutants wrote in `out/mutants.out`.
fn read_tally(out: &Path) -> Result<Tally> {
    let out = out.join("mutants.out");
    Ok(Tally {
        caught: read_names(&out.join("caught.txt"))?,
        missed: read_names(&out.join("missed.txt"))?,
        timeout: read_names(&out.join("timeout.txt"))?,
        unviable: read_names(&out.join("unviable.txt"))?,
    })
}

/// Writes the outcome lists (as cargo-mutants names them) to `out/mutants.out`.
pub fn write_tally(out: &Path, tally: &Tally) -> Result<()> {
    let dir = out.join("mutants.out");
    fs::create_dir_all(&dir)?;
    for (what, names) in [
        ("caught", &tally.caught),
        ("missed", &tally.missed),
        ("timeout", &tally.timeout),
        ("unviable", &tally.unviable),
    ] {
        let text: String = names.iter().map(|n| format!("{n}\n")).collect();
        fs::write(dir.join(format!("{what}.txt")), text)?;
    }
    Ok(())
}

/// The survivors tests/MUTANTS.md does not explain.
fn unexplained(tally: &Tally) -> Result<Vec<String>> {
    let explained =
        fs::read_to_string(root().join("tests/MUTANTS.md")).context("reading tests/MUTANTS.md")?;
    Ok(tally
        .missed
        .iter()
        .filter(|name| !explained.contains(&without_position(name)))
        .cloned()
        .collect())
}

fn read_names(path: &Path) -> Result<BTreeSet<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeSet::new()),
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
    use std::collections::BTreeMap;

    use super::{Options, Tally, areas, without_position};

    /// cargo-mutants refuses an option given twice (`--baseline`): every
    /// run of every area, its sample, its iteration and its second pass,
    /// names each option once, and hands the test binaries nothing of its own.
    #[test]
    fn every_run_names_each_option_once() {
        let repeatable = [
            "--package",
            "--file",
            "--test-package",
            "--cargo-arg",
            "--cargo-test-arg",
        ];
        let options = Options {
            area: areas::AreaName::All,
            re: Some("gcra".into()),
            timeout: None,
            list: false,
            full: false,
            iterate: false,
        };
        let only = ["a.rs:1:1: replace + with -".to_owned()].into();
        let mut runs = 0;
        for area in areas::chosen(areas::AreaName::All) {
            let passes = [
                Some(super::first_pass(area, &options)),
                super::second_pass(area, &options),
            ];
            for pass in passes.iter().flatten() {
                for only in [None, Some(&only)] {
                    let command = super::mutants_command(area, &options, pass, only);
                    let mut seen = BTreeMap::<String, u32>::new();
                    for arg in command.get_args() {
                        let arg = arg.to_string_lossy();
                        assert_ne!(arg, "--", "{}: {command:?}", area.name);
                        if let Some(name) = arg.strip_prefix("--") {
                            let name = format!("--{}", name.split('=').next().unwrap_or(name));
                            *seen.entry(name).or_default() += 1;
                        }
                    }
                    for (name, n) in seen {
                        assert!(
                            n == 1 || repeatable.contains(&name.as_str()),
                            "{}: {name} {n} times in {command:?}",
                            area.name
                        );
                    }
                    runs += 1;
                }
            }
        }
        // Six cargo-mutants areas (kernel's driver lists through it too),
        // common twice.
        assert!(runs >= 14, "{runs} runs");
    }

    #[test]
    fn exact_names_escape_what_a_regex_would_read() {
        let names = ["a.rs:1:2: replace * with + in <impl X for F>::f".to_owned()].into();
        assert_eq!(
            super::exact_names(&names),
            r"^(a\.rs:1:2: replace \* with \+ in <impl X for F>::f)$"
        );
    }

    #[test]
    fn names_lose_their_position() {
        assert_eq!(
            without_position("limiter-common/src/gcra.rs:95:9: replace + with - in Gcra::check"),
            "limiter-common/src/gcra.rs: replace + with - in Gcra::check"
        );
    }

    /// An iteration forgets what the code no longer has (the trace
    /// area kept a survivor whose field was removed), runs a survivor
    /// still at its line alone, and one whose line moved with every
    /// mutant of its description.
    #[test]
    fn an_iteration_runs_the_survivors_the_code_still_has() {
        let set = |names: &[&str]| -> std::collections::BTreeSet<String> {
            names.iter().map(|n| n.to_string()).collect()
        };
        let mut last = Tally {
            caught: set(&["a.rs:1:1: one", "a.rs:8:1: gone too"]),
            missed: set(&["a.rs:2:1: two", "a.rs:3:1: three", "a.rs:4:1: gone"]),
            ..Tally::default()
        };
        let listed = set(&[
            "a.rs:1:1: one",
            "a.rs:2:1: two",
            "a.rs:5:1: two",
            "a.rs:6:1: three",
            "a.rs:7:1: three",
            "a.rs:9:1: four",
        ]);
        last.forget_unlisted(&listed);
        assert_eq!(last.caught, set(&["a.rs:1:1: one"]));
        assert_eq!(last.missed, set(&["a.rs:2:1: two", "a.rs:3:1: three"]));
        assert_eq!(
            last.again(&listed),
            set(&["a.rs:2:1: two", "a.rs:6:1: three", "a.rs:7:1: three"])
        );
    }

    #[test]
    fn an_iteration_supersedes_what_it_ran_again() {
        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        let earlier = Tally {
            caught: set(&["a.rs:1:1: one", "a.rs:2:1: two", "a.rs:9:1: four"]),
            missed: set(&["a.rs:3:1: three", "a.rs:4:1: four"]),
            ..Tally::default()
        };
        // Lines moved: three is caught now, four still missed.
        let now = Tally {
            caught: set(&["a.rs:5:1: three"]),
            missed: set(&["a.rs:6:1: four"]),
            ..Tally::default()
        };
        let merged = now.after(earlier);
        // The caught `four` at line 9 is another mutant of that
        // description, not run again: it stands.
        assert_eq!(
            merged.caught,
            set(&[
                "a.rs:1:1: one",
                "a.rs:2:1: two",
                "a.rs:5:1: three",
                "a.rs:9:1: four"
            ])
        );
        assert_eq!(merged.missed, set(&["a.rs:6:1: four"]));
    }

    #[test]
    fn the_score_is_caught_of_viable() {
        let names = |n: usize, what: &str| (0..n).map(|i| format!("{what}{i}")).collect();
        let tally = Tally {
            caught: names(8, "c"),
            missed: names(1, "m"),
            timeout: names(1, "t"),
            unviable: names(5, "u"),
        };
        assert_eq!(tally.viable(), 10);
        assert!((tally.score() - 90.0).abs() < 1e-9);
        assert!((Tally::default().score() - 100.0).abs() < 1e-9);
    }
}
