//! An area's outcome: which mutants were caught, missed, timed out or
//! did not build; merged over runs and iterations, read from and written
//! to cargo-mutants' lists, and judged against tests/MUTANTS.md.

use std::{collections::BTreeSet, fs, path::Path};

use anyhow::{Context, Result};

use crate::root;

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

    pub(super) fn viable(&self) -> usize {
        self.caught.len() + self.missed.len() + self.timeout.len()
    }

    /// Caught of the viable, in percent (a timeout counts as caught: a
    /// mutant that makes the tests hang is noticed, by the timeout).
    pub(super) fn score(&self) -> f64 {
        if self.viable() == 0 {
            return 100.0;
        }
        100.0 * (self.caught.len() + self.timeout.len()) as f64 / self.viable() as f64
    }
}

/// The outcome lists cargo-mutants wrote in `out/mutants.out`.
pub(super) fn read_tally(out: &Path) -> Result<Tally> {
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
pub(super) fn unexplained(tally: &Tally) -> Result<Vec<String>> {
    let explained =
        fs::read_to_string(root().join("tests/MUTANTS.md")).context("reading tests/MUTANTS.md")?;
    Ok(tally
        .missed
        .iter()
        .filter(|name| !explained.contains(&without_position(name)))
        .cloned()
        .collect())
}

pub(super) fn read_names(path: &Path) -> Result<BTreeSet<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().map(str::to_owned).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeSet::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// `file.rs:12:5: replace ...` as `file.rs: replace ...`: the report names
/// mutants without line and column, which move with every edit.
pub(super) fn without_position(name: &str) -> String {
    let mut parts = name.splitn(4, ':');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(file), Some(_line), Some(_column), Some(rest)) => format!("{file}:{rest}"),
        _ => name.to_owned(),
    }
}
