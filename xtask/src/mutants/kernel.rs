//! The `kernel` area: mutants of the XDP program. cargo-mutants lists them
//! (with their diffs) but cannot build or test them: `limiter-ebpf` is a
//! workspace of its own, built for the BPF target by the nightly. So each
//! is applied here to a copy of the tracked sources, built (the release
//! object and the test-clock object, side by side), and judged by the
//! BPF_PROG_TEST_RUN tests (`prog_test_run`, `key_table`, `drops`) and
//! the conformance replays, modules of the integration tests run from
//! their binary built once from the unmutated tree (`LIMITER_TEST_OBJECT`,
//! `LIMITER_TEST_CLOCK_OBJECT` name the mutant's objects). The first
//! module to fail catches the mutant; one whose build fails is unviable.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::{Options, Tally, areas::Area, output};
use crate::{cargo, nightly_cargo, root, step};

/// The modules of the integration tests that judge, each run on its own
/// (`module::`), fastest first (the first failure ends a mutant's run):
/// the program's own tests through BPF_PROG_TEST_RUN (the key table's
/// policy and the refusals by key among them), then the conformance
/// replays.
const JUDGES: [&str; 4] = ["prog_test_run", "key_table", "drops", "conformance"];

/// Mutants a default run takes, spread evenly over the area's list (about
/// 30 minutes here; `--full` takes them all).
const SAMPLE: usize = 90;

/// A mutant as cargo-mutants lists it.
struct Mutant {
    name: String,
    file: String,
    diff: String,
}

pub fn run(area: &Area, options: &Options) -> Result<Tally> {
    let dir = output(area.name);
    let mut mutants = list(area, options)?;
    // cargo-mutants lists a few twice (the same name and diff).
    let mut seen = BTreeSet::new();
    mutants.retain(|m| seen.insert((m.name.clone(), m.diff.clone())));
    let mut tally = Tally::default();
    let mut last = Tally::default();
    if options.iterate {
        let named = |m: &Mutant| format!("limiter-ebpf/{}", m.name);
        let names: BTreeSet<String> = mutants.iter().map(named).collect();
        last = super::read_tally(&dir)?;
        // (A list narrowed by `--re` says nothing of the others.)
        if options.re.is_none() {
            last.forget_unlisted(&names);
        }
        let again = last.again(&names);
        mutants.retain(|m| again.contains(&named(m)));
        println!("{} mutants the last run did not catch", mutants.len());
    } else if options.re.is_some() {
        // A run of a few mutants by name: the rest of the last outcome
        // stands.
        last = super::read_tally(&dir)?;
    } else if !options.full && mutants.len() > SAMPLE {
        let total = mutants.len();
        // Every (total / SAMPLE)-th, in steps as even as whole numbers allow.
        let picked: BTreeSet<usize> = (0..SAMPLE).map(|i| i * total / SAMPLE).collect();
        mutants = mutants
            .into_iter()
            .enumerate()
            .filter(|(i, _)| picked.contains(i))
            .map(|(_, m)| m)
            .collect();
        println!("{SAMPLE} of {total} mutants, spread evenly (--full: all)");
    }
    if options.list {
        for m in &mutants {
            println!("{}", m.name);
        }
        return Ok(Tally::default());
    }
    fs::create_dir_all(&dir)?;
    let tree = dir.join("tree");
    copy_tracked(&tree)?;
    step("building the judging test binary from the unmutated tree");
    let judges = crate::build::integration_tests(&[])?;
    let timeout = Duration::from_secs(options.timeout.unwrap_or(area.timeout));
    step("the unmutated program, built in the copy, must pass");
    let objects = build_objects(&tree)?.context("the unmutated program does not build")?;
    if let Some(failed) = judge(&judges, &objects, timeout)? {
        bail!("the unmutated program fails {failed}");
    }
    for (i, mutant) in mutants.iter().enumerate() {
        let started = Instant::now();
        let path = tree.join("limiter-ebpf").join(&mutant.file);
        let original = fs::read_to_string(&path)?;
        let mutated =
            apply(&original, &mutant.diff).with_context(|| format!("applying {}", mutant.name))?;
        fs::write(&path, mutated)?;
        let outcome = match build_objects(&tree) {
            Ok(Some(objects)) => match judge(&judges, &objects, timeout) {
                Ok(Some(by)) if by == "timeout" => ("timeout", by),
                Ok(Some(by)) => ("caught", by),
                Ok(None) => ("MISSED", String::new()),
                Err(e) => {
                    fs::write(&path, &original)?;
                    return Err(e);
                }
            },
            Ok(None) => ("unviable", String::new()),
            Err(e) => {
                fs::write(&path, &original)?;
                return Err(e);
            }
        };
        fs::write(&path, &original)?;
        let name = format!("limiter-ebpf/{}", mutant.name);
        println!(
            "{:>3}/{} {:<8} {:>5.1} s  {name}{}",
            i + 1,
            mutants.len(),
            outcome.0,
            started.elapsed().as_secs_f64(),
            if outcome.1.is_empty() {
                String::new()
            } else {
                format!("  (by {})", outcome.1)
            }
        );
        match outcome.0 {
            "caught" => tally.caught.insert(name),
            "timeout" => tally.timeout.insert(name),
            "unviable" => tally.unviable.insert(name),
            _ => tally.missed.insert(name),
        };
    }
    let tally = tally.after(last);
    super::write_tally(&dir, &tally)?;
    Ok(tally)
}

/// The area's mutants, from `cargo mutants --list --json --diff`.
fn list(area: &Area, options: &Options) -> Result<Vec<Mutant>> {
    let mut command = cargo();
    command
        .current_dir(root().join("limiter-ebpf"))
        .args(["mutants", "--list", "--json", "--diff"]);
    for file in area.files {
        command.args(["--file", file]);
    }
    if let Some(re) = &options.re {
        command.args(["--re", re]);
    }
    let out = crate::stdout_of(&mut command, "cargo mutants --list")?;
    let listed: Vec<Value> = serde_json::from_slice(&out).context("cargo mutants --list --json")?;
    listed
        .iter()
        .map(|m| {
            let field = |name: &str| {
                m[name]
                    .as_str()
                    .map(str::to_owned)
                    .with_context(|| format!("a listed mutant without {name}: {m}"))
            };
            Ok(Mutant {
                name: field("name")?,
                file: field("file")?,
                diff: field("diff")?,
            })
        })
        .collect()
}

/// Applies a unified diff of one file to its text.
fn apply(original: &str, diff: &str) -> Result<String> {
    let lines: Vec<&str> = original.split_inclusive('\n').collect();
    let mut out = String::with_capacity(original.len() + 64);
    let mut next = 0; // the next original line not yet copied
    let mut hunks = diff.lines().skip_while(|l| !l.starts_with("@@")).peekable();
    while let Some(header) = hunks.next() {
        let start: usize = header
            .strip_prefix("@@ -")
            .and_then(|rest| rest.split([',', ' ']).next())
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("a hunk header: {header}"))?;
        let start = start.saturating_sub(1);
        if start < next || start > lines.len() {
            bail!("a hunk out of order: {header}");
        }
        out.extend(lines[next..start].iter().copied());
        next = start;
        while let Some(line) = hunks.next_if(|l| !l.starts_with("@@")) {
            let (kind, text) = line.split_at(line.len().min(1));
            match kind {
                " " | "-" => {
                    let have = lines.get(next).map(|l| l.trim_end_matches('\n'));
                    if have != Some(text) {
                        bail!("the diff does not match line {}: {text:?}", next + 1);
                    }
                    if kind == " " {
                        out.push_str(lines[next]);
                    }
                    next += 1;
                }
                "+" => {
                    out.push_str(text);
                    out.push('\n');
                }
                "\\" | "" => {}
                _ => bail!("a diff line: {line:?}"),
            }
        }
    }
    out.extend(lines[next..].iter().copied());
    Ok(out)
}

/// The tracked sources of the workspace, copied fresh to `tree` (its build
/// outputs kept, so each run after the first builds incrementally).
fn copy_tracked(tree: &Path) -> Result<()> {
    let out = Command::new("git")
        .current_dir(root())
        .args(["ls-files", "-z"])
        .output()
        .context("git ls-files")?;
    if !out.status.success() {
        bail!("git ls-files failed");
    }
    for file in out.stdout.split(|&b| b == 0).filter(|f| !f.is_empty()) {
        let file = Path::new(std::str::from_utf8(file)?);
        let from = root().join(file);
        if !from.is_file() {
            continue;
        }
        let to = tree.join(file);
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
    }
    Ok(())
}

/// The release and the test-clock objects, built side by side from the
/// copy; `None` when the program does not build (or the verifier-minded
/// compiler refuses it).
struct Objects {
    release: PathBuf,
    test_clock: PathBuf,
}

fn build_objects(tree: &Path) -> Result<Option<Objects>> {
    let ebpf = tree.join("limiter-ebpf");
    let build = |target: &str, features: &[&str]| -> Result<Child> {
        nightly_cargo()
            .current_dir(&ebpf)
            .args(["build", "--release", "--quiet", "--target-dir", target])
            .args(features)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("running cargo +nightly build")
    };
    let mut release = build("target/mutant", &[])?;
    let mut test_clock = build("target/mutant-clock", &["--features", "test-clock"])?;
    let built = release.wait()?.success() & test_clock.wait()?.success();
    let object = |target: &str| ebpf.join(target).join("bpfel-unknown-none/release/limiter");
    Ok(built.then(|| Objects {
        release: object("target/mutant"),
        test_clock: object("target/mutant-clock"),
    }))
}

/// Runs the judges on the objects: the first that fails (or `timeout`),
/// or `None` when every one passes.
fn judge(binary: &Path, objects: &Objects, timeout: Duration) -> Result<Option<String>> {
    for name in JUDGES {
        let mut child = Command::new(binary)
            .current_dir(root().join("tests"))
            .arg(format!("{name}::"))
            .arg("--test-threads=1")
            .env("LIMITER_TEST_OBJECT", &objects.release)
            .env("LIMITER_TEST_CLOCK_OBJECT", &objects.test_clock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("running {}", binary.display()))?;
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        match status {
            None => return Ok(Some("timeout".into())),
            Some(status) if !status.success() => return Ok(Some(name.to_owned())),
            Some(_) => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::apply;

    #[test]
    fn a_diff_is_applied_to_its_file() {
        let original = "a\nb\nc\nd\ne\n";
        let diff = "--- src/x.rs\n+++ replace\n@@ -2,3 +2,3 @@\n b\n-c\n+C /* ~ */\n d\n";
        assert_eq!(apply(original, diff).unwrap(), "a\nb\nC /* ~ */\nd\ne\n");
        let wrong = "--- src/x.rs\n+++ r\n@@ -2,2 +2,2 @@\n x\n-c\n+C\n";
        assert!(apply(original, wrong).is_err());
    }
}
