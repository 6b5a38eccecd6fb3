//! The kernel matrix of `cargo xtask test`: the kernel-facing tests run
//! again inside qemu guests booted from Debian's own kernels (`vm`), so
//! the program is verified and enforces on the kernels operators run,
//! not only on this machine's. A kernel older than the minimum gets its
//! one-line refusal checked instead.
//!
//! Under TCG a guest verifies about a hundred times slower than the host,
//! so each guest runs a chosen set: every build's verifier budget, the
//! BPF_PROG_TEST_RUN tests of each header layout, the conformance replay,
//! the rare events' report through aya-log, an IPv6 flood on a veth pair counted at the receiver (native XDP), and
//! `limiter daemon` killed with -9 under an IPv4 flood and restarted from
//! its pins.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{
    root, step,
    vm::{self, Guest, GuestCommand},
};

/// Kernels the tests must pass on (Debian 12's and 13's).
const PASSING: [&str; 2] = ["6.1", "6.12"];
/// A kernel below the minimum (Debian 11's), which must be refused in
/// one line naming what it lacks.
const TOO_OLD: &str = "5.10";

/// The tests each guest runs: (module of the integration tests, the
/// tests' paths in it, all of the module's when none).
const TESTS: [(&str, &[&str]); 7] = [
    ("verifier_budget", &[]),
    (
        "prog_test_run",
        &[
            "parsing::ipv4_rules_by_protocol_port_and_prefix",
            "parsing::ipv6_extension_headers",
            "fragmentation::later_fragments_follow_their_first",
            "fragmentation::orphan_fragments_go_to_the_strictest_rule_or_are_dropped",
        ],
    ),
    ("conformance", &["the_xdp_program_matches_the_reference"]),
    // The report program's aya-log records, drained and rate limited.
    (
        "reports",
        &["a_full_key_table_is_reported_once_a_second_with_what_was_left_out"],
    ),
    // Refusal counts held per CPU, moved by the report program.
    ("drops", &[]),
    // Three sources at 1,000 pps (the 26 of the host's flood test are
    // more than an emulated sender keeps up with).
    ("traffic", &["addresses_of_one_64_share_one_budget"]),
    (
        "daemon",
        &["lifecycle::kill_9_and_restart_under_flood_admit_no_second_burst"],
    ),
];

/// Each module's time limit in a guest.
const TEST_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs the matrix with the `limiter` binary given and the no-trace
/// build of the program (the test-clock build is found where the tests
/// look for it).
pub fn run(limiter: &Path, no_trace: &Path) -> Result<()> {
    let binary = crate::build::integration_tests(&[("LIMITER_TESTS_BUILD_KERNEL", "1")])?;
    let test_clock =
        root().join("limiter-ebpf/target/test-clock/bpfel-unknown-none/release/limiter");
    let mut files = vec![
        limiter.to_owned(),
        no_trace.to_owned(),
        test_clock,
        root().join("examples"),
    ];
    files.push(binary.clone());
    let env = vec![
        ("LIMITER_BIN".to_owned(), limiter.display().to_string()),
        (
            "LIMITER_NO_TRACE_OBJECT".to_owned(),
            no_trace.display().to_string(),
        ),
        ("RUST_BACKTRACE".to_owned(), "1".to_owned()),
        // A start includes the verifier, about a hundred times slower
        // under TCG than on the host (the daemon test floods for a third
        // of it, so that its restart happens during the flood).
        ("LIMITER_TEST_START_SECS".to_owned(), "240".to_owned()),
    ];
    let mut failed = Vec::new();
    // Modules' runs (and the old kernel's check) that passed and failed,
    // for the closing line.
    let (mut passed_runs, mut failed_runs) = (0, 0);
    for name in PASSING {
        let kernel = vm::kernel(name)?;
        step(&format!(
            "kernel matrix: Debian {}'s Linux {name} in qemu (the kernel tests, verified there)",
            kernel.debian
        ));
        let commands = TESTS
            .iter()
            .map(|(module, names)| {
                let mut argv = vec![binary.display().to_string()];
                argv.extend(filters(module, names));
                argv.extend(["--test-threads=1", "--nocapture"].map(str::to_owned));
                let mut command = GuestCommand::new(*module, argv, TEST_TIMEOUT);
                // As cargo runs a test binary: in its package's directory.
                command.cwd = Some(root().join("tests"));
                command
            })
            .collect();
        let guest = Guest {
            files: files.clone(),
            env: env.clone(),
            commands,
            // The flood and the daemon test use both CPUs.
            memory_mib: 3072,
            ..Guest::default()
        };
        let started = Instant::now();
        let run = vm::run(kernel, &guest)?;
        report(name, &run, started.elapsed());
        let ok = run.outcomes.iter().filter(|(_, o)| o.success()).count();
        passed_runs += ok;
        failed_runs += TESTS.len() - ok;
        if !run.success() {
            failed.push(name);
        }
    }
    step(&format!(
        "kernel matrix: Debian 11's Linux {TOO_OLD} is refused in one line"
    ));
    match too_old_is_refused(limiter) {
        Ok(()) => passed_runs += 1,
        Err(e) => {
            println!("xtask: {e:#}");
            failed.push(TOO_OLD);
            failed_runs += 1;
        }
    }
    println!("matrix: {passed_runs} passed, {failed_runs} failed");
    if !failed.is_empty() {
        bail!("the kernel matrix failed on Linux {}", failed.join(", "));
    }
    Ok(())
}

/// `limiter run` on the oldest kernel: one line on stderr naming what the
/// kernel lacks, no verifier log, a non-zero exit.
fn too_old_is_refused(limiter: &Path) -> Result<()> {
    let kernel = vm::kernel(TOO_OLD)?;
    let rules = root().join("examples/rules.yaml");
    let argv = vec![
        limiter.display().to_string(),
        "run".to_owned(),
        "--iface".to_owned(),
        "lo".to_owned(),
        "--config".to_owned(),
        rules.display().to_string(),
    ];
    let guest = Guest {
        files: vec![limiter.to_owned(), rules],
        commands: vec![GuestCommand::new("refused", argv, Duration::from_secs(120))],
        ..Guest::default()
    };
    let started = Instant::now();
    let run = vm::run(kernel, &guest)?;
    let (_, outcome) = run.outcomes.first().context("the 5.10 guest ran nothing")?;
    let said: Vec<&String> = outcome
        .output
        .iter()
        .filter(|line| line.starts_with("error:"))
        .collect();
    println!(
        "xtask: Linux {} ({}): {:?} in {:.1} s: {}",
        TOO_OLD,
        run.release.as_deref().unwrap_or("?"),
        outcome.status,
        started.elapsed().as_secs_f64(),
        said.first().map_or("no error line", |l| l.as_str())
    );
    let one_line = said.len() == 1
        && said[0].contains("is too old for the limiter: it lacks")
        && !outcome.output.iter().any(|l| l.contains("verifier"));
    if outcome.success() || !one_line {
        bail!(
            "Linux {TOO_OLD} was not refused in one line naming what it lacks; it printed:\n{}",
            outcome.output.join("\n")
        );
    }
    Ok(())
}

/// One guest's outcome, a line per module of tests; the output of the ones
/// that failed.
fn report(name: &str, run: &vm::Run, took: Duration) {
    println!(
        "xtask: Linux {name} ({}), booted in {:.1} s, {:?} after {:.0} s",
        run.release.as_deref().unwrap_or("did not boot"),
        run.boot.map_or(0.0, |b| b.as_secs_f64()),
        run.end,
        took.as_secs_f64()
    );
    for (test, outcome) in &run.outcomes {
        println!(
            "xtask:   {test:<16} {:?} in {:.0} s",
            outcome.status,
            outcome.elapsed.as_secs_f64()
        );
        // The verifier's figures, for BENCHMARKS.md.
        for line in &outcome.output {
            if let Some(at) = line.find("verified: kernel") {
                println!("xtask:     {}", &line[at..]);
            }
        }
        if !outcome.success() {
            if outcome.dropped_lines > 0 {
                println!("xtask:     | ({} earlier lines)", outcome.dropped_lines);
            }
            for line in &outcome.output {
                println!("xtask:     | {line}");
            }
        }
    }
    if !run.success() {
        for line in &run.console_tail {
            println!("xtask:   console | {line}");
        }
    }
}

/// The test binary's arguments that run `names` of `module` (by their
/// exact names), or all of its tests (its path's prefix, `module::`).
fn filters(module: &str, names: &[&str]) -> Vec<String> {
    if names.is_empty() {
        return vec![format!("{module}::")];
    }
    let mut argv: Vec<String> = names.iter().map(|n| format!("{module}::{n}")).collect();
    argv.push("--exact".to_owned());
    argv
}

#[cfg(test)]
mod tests {
    /// A module's named tests run by their exact paths; a module named
    /// alone runs whole, by its prefix.
    #[test]
    fn a_module_runs_its_named_tests_or_all() {
        assert_eq!(super::filters("drops", &[]), ["drops::"]);
        assert_eq!(
            super::filters("daemon", &["lifecycle::kill", "x"]),
            ["daemon::lifecycle::kill", "daemon::x", "--exact"]
        );
    }
}
