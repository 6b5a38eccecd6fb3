//! The mutation runner's own tests: options, names, iterations, scores.

use std::collections::BTreeMap;

use super::{
    Options, Tally, areas,
    command::{exact_names, first_pass, mutants_command, second_pass},
    tally::without_position,
};

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
            Some(first_pass(area, &options)),
            second_pass(area, &options),
        ];
        for pass in passes.iter().flatten() {
            for only in [None, Some(&only)] {
                let command = mutants_command(area, &options, pass, only);
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
        exact_names(&names),
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
