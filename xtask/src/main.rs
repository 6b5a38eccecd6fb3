//! `cargo xtask`: set-up, build, demo and tests.
//!
//! - `cargo xtask`          installs what is missing, builds, runs the lab demo
//! - `cargo xtask test`     installs what is missing, builds, runs every test
//! - `cargo xtask matrix`   the kernel tests in qemu on Debian's kernels
//! - `cargo xtask build`    builds the XDP object and the `limiter` binary
//! - `cargo xtask setup`    only installs what is missing
//! - `cargo xtask bench`    benchmarks, with peers in the same run
//! - `cargo xtask mutants`  mutation testing by area (on demand)
//! - `cargo xtask vm`       runs a command in Debian's kernels under qemu

mod build;
mod matrix;
mod mutants;
mod setup;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use build::{build, build_baseline, build_profile_stages, build_without_trace};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Build, set-up, demo and test orchestration for the limiter")]
struct Cli {
    #[command(subcommand)]
    command: Option<Task>,
}

#[derive(Subcommand)]
enum Task {
    /// Install the nightly rust-src, bpf-linker and the Debian packages needed.
    Setup,
    /// Build the XDP object and the `limiter` binary with it embedded.
    Build {
        /// Build userspace in release mode (target/release/limiter).
        #[arg(long)]
        release: bool,
    },
    /// Set up, build, and run the lab demo (the default task; needs root).
    Demo {
        /// Extra arguments for `limiter lab`, e.g. `-- --duration 20s`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Benchmarks, peers in the same run: the XDP datapath against XDP_DROP,
    /// iptables hashlimit and nftables (BENCHMARKS.md), the layer-7
    /// limiter against governor.
    Bench {
        /// About two minutes: the sections of the goals (cost, ceilings,
        /// flood, scale) with shorter floods, one round, fewer sizes.
        #[arg(long)]
        quick: bool,
        /// A git revision to build the XDP program from as well, for the
        /// `baseline` section: this build against it, per packet and end
        /// to end (what a change to the datapath costs).
        #[arg(long, value_name = "REV")]
        baseline: Option<String>,
        /// Sections to run: proxy (limiter proxy against nginx limit_req),
        /// and the XDP ones (cost, profile, flood, scale, memory,
        /// accuracy, trace, dashboard; baseline with --baseline); all but
        /// baseline by default.
        sections: Vec<String>,
    },
    /// Mutation testing by area (`--area common|fleet|relay|escalation|
    /// trace|validation|kernel|all`), each against the tests that exercise
    /// it, in at most 30 minutes on two cores; an area fails under 90%
    /// caught or with a survivor tests/MUTANTS.md does not explain. Not
    /// part of `test`.
    Mutants(mutants::Options),
    /// The long fuzz runs: a million mutated frames through the XDP program
    /// against the reference parser, and 20,000 cases of each input fuzzer
    /// (rule file, daemon configuration, envoy import, control protocol),
    /// and 100,000 request spellings through `limiter proxy` against
    /// nginx. `cargo xtask test` runs all three, shorter.
    Fuzz {
        /// Frames through the program.
        #[arg(long, default_value_t = 1_000_000)]
        frames: u64,
        /// Cases of each input fuzzer.
        #[arg(long, default_value_t = 20_000)]
        cases: u64,
    },
    /// Runs a command inside Debian's own kernels (11's 5.10, 12's 6.1,
    /// 13's 6.12) under qemu, e.g. `--kernel all --file PATH -- PATH ARGS`.
    Vm(vm::Options),
    /// Only the kernel matrix of `test`: the kernel tests in qemu on
    /// Debian 12's and 13's kernels, and Debian 11's refused.
    Matrix,
    /// Set up, build, lint, and run every test (the root-only ones
    /// included), then the kernel tests again in qemu on Debian 12's and
    /// 13's kernels (the matrix), and Debian 11's refused.
    Test {
        /// Only run integration tests whose name (`module::test`) contains
        /// this (and skip the matrix).
        filter: Option<String>,
        /// Skip the kernel matrix.
        #[arg(long)]
        no_matrix: bool,
    },
}

fn main() {
    if let Err(e) = run() {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    match Cli::parse()
        .command
        .unwrap_or(Task::Demo { args: Vec::new() })
    {
        Task::Setup => setup::all(),
        Task::Build { release } => {
            setup::toolchain()?;
            build(release).map(drop)
        }
        Task::Demo { args } => {
            require_root("the demo attaches XDP programs and creates network namespaces")?;
            setup::all()?;
            let limiter = build(true)?;
            step("running the lab demo: `limiter lab`");
            let mut command = Command::new(limiter);
            command.arg("lab").args(args);
            status(&mut command)
        }
        Task::Test { filter, no_matrix } => test(filter, no_matrix),
        Task::Matrix => {
            require_root("the guests' tests attach XDP programs")?;
            setup::all()?;
            let limiter = build(false)?;
            let no_trace = build_without_trace()?;
            matrix::run(&limiter, &no_trace)
        }
        Task::Vm(options) => vm::cli(&options),
        Task::Fuzz { frames, cases } => fuzz(frames, cases),
        Task::Mutants(options) => {
            require_root("the conformance replay loads the XDP program")?;
            setup::all()?;
            setup::cargo_mutants()?;
            build(false)?;
            mutants::run(&options)
        }
        Task::Bench {
            quick,
            baseline,
            sections,
        } => {
            require_root("the XDP benchmark attaches programs in network namespaces")?;
            if baseline.is_some() != sections.iter().any(|s| s == "baseline") {
                bail!("the baseline section and --baseline REV go together");
            }
            setup::all()?;
            let named = sections.iter().any(|s| s == "proxy");
            // In a full run, or when named (`--quick` alone is the XDP subset).
            let proxy = named || (sections.is_empty() && !quick);
            let sections: Vec<String> = sections.into_iter().filter(|s| s != "proxy").collect();
            if proxy {
                // The proxy as an operator runs it: a release build.
                let limiter = build(true)?;
                step("benchmark: limiter proxy against nginx limit_req (wrk)");
                status(
                    cargo()
                        .args([
                            "bench",
                            "--package",
                            "limiter-tests",
                            "--bench",
                            "proxy",
                            "--",
                        ])
                        .args(quick.then_some("--quick"))
                        .env("LIMITER_BIN", &limiter),
                )?;
                if named && sections.is_empty() {
                    return Ok(());
                }
            }
            // Eight builds of the program: only for a run with the profile.
            // (`--quick` alone runs neither the profile nor the trace section.)
            let every = sections.is_empty() && !quick;
            let profile = every || sections.iter().any(|s| s == "profile");
            let stages = profile.then(build_profile_stages).transpose()?;
            let trace = every || sections.iter().any(|s| s == "trace");
            let untraced = trace.then(build_without_trace).transpose()?;
            let baseline_object = baseline.as_deref().map(build_baseline).transpose()?;
            // The daemon's start, as an operator runs it: a release build.
            let start = every || sections.iter().any(|s| s == "start");
            let release = start.then(|| build(true)).transpose()?;
            build(false)?;
            step("benchmark: the XDP datapath against XDP_DROP, iptables hashlimit and nftables");
            let object = root().join("limiter-ebpf/target/bpfel-unknown-none/release/limiter");
            let mut xdp = cargo();
            xdp.args([
                "bench",
                "--package",
                "limiter-tests",
                "--bench",
                "xdp",
                "--",
            ])
            .args(quick.then_some("--quick"))
            .args(&sections)
            .env("LIMITER_EBPF_OBJECT", &object);
            if let Some(stages) = &stages {
                xdp.env("LIMITER_PROFILE_OBJECTS", stages);
            }
            if let Some(untraced) = &untraced {
                xdp.env("LIMITER_NO_TRACE_OBJECT", untraced);
            }
            if let Some(release) = &release {
                xdp.env("LIMITER_BIN", release);
            }
            if let (Some((object, commit)), Some(revision)) = (&baseline_object, &baseline) {
                let short = &commit[..commit.len().min(12)];
                xdp.env("LIMITER_BASELINE_OBJECT", object)
                    .env("LIMITER_BASELINE_REV", format!("{revision} ({short})"));
            }
            status(&mut xdp)?;
            if quick || !sections.is_empty() {
                return Ok(());
            }
            step("benchmark: the layer-7 decision path against governor (criterion)");
            status(
                cargo()
                    .args(["bench", "--package", "limiter-tests", "--bench", "l7"])
                    .env("LIMITER_EBPF_OBJECT", &object),
            )
        }
    }
}

fn fuzz(frames: u64, cases: u64) -> Result<()> {
    require_root("the datapath fuzzer runs the XDP program through BPF_PROG_TEST_RUN")?;
    setup::all()?;
    let limiter = build(false)?;
    step(&format!("fuzzing the inputs: {cases} cases each"));
    status(
        cargo()
            .args([
                "test",
                "--package",
                "limiter-userspace",
                "--test",
                "fuzz_inputs",
            ])
            .env("PROPTEST_CASES", cases.to_string()),
    )?;
    step(&format!(
        "fuzzing the datapath: {frames} frames (about 1 ms each), printed as they pass"
    ));
    status(&mut long_test(
        "fuzz_datapath",
        &limiter,
        ("LIMITER_FUZZ_FRAMES", frames),
    ))?;
    step(&format!(
        "layer 7 against nginx: {DIFFERENTIAL_REQUESTS} request spellings, what the proxy judged against what nginx routed"
    ));
    status(&mut long_test(
        "l7_differential",
        &limiter,
        ("LIMITER_DIFFERENTIAL_REQUESTS", DIFFERENTIAL_REQUESTS),
    ))
}

/// One module of the integration tests (`module::`) in `cargo xtask
/// fuzz`, its output shown as it runs, with the `limiter` binary given
/// and its size set by `size` (variable, value).
fn long_test(module: &str, limiter: &Path, size: (&str, u64)) -> Command {
    let mut command = cargo();
    command
        .args([
            "test",
            "--package",
            "limiter-tests",
            "--test",
            build::INTEGRATION,
        ])
        .args(["--", &format!("{module}::"), "--nocapture"])
        .env("LIMITER_BIN", limiter)
        .env("LIMITER_TESTS_BUILD_KERNEL", "1")
        .env(size.0, size.1.to_string());
    command
}

/// Request spellings `cargo xtask fuzz` sends through the proxy to nginx
/// (`cargo xtask test` sends the test's default, 2,000): about a minute.
const DIFFERENTIAL_REQUESTS: u64 = 100_000;

fn test(filter: Option<String>, no_matrix: bool) -> Result<()> {
    require_root("the integration tests attach XDP programs to veth pairs in namespaces")?;
    setup::all()?;
    build_once_if_clean();
    warn_if_disk_short(TEST_BUILD_BYTES);
    build(false)?;
    step("lint: cargo fmt --check, cargo clippy -D warnings");
    status(cargo().args(["fmt", "--all", "--check"]))?;
    status(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    status(cargo().current_dir(root().join("limiter-ebpf")).args([
        "+nightly",
        "clippy",
        "--release",
        "--",
        "-D",
        "warnings",
    ]))?;
    step("unit and property tests");
    // Without the crash points, as a release build: a unit test checks
    // that no variable then kills the process.
    status(cargo().args(["test", "--workspace", "--exclude", "limiter-tests"]))?;
    // Building the package's tests left a `limiter` without them where
    // the debug build was: built again (a link, the rest is cached).
    let limiter = build(false)?;
    // Every build the project ships is checked against the verifier's
    // budget (tests/tests/integration/verifier_budget.rs).
    let no_trace = build_without_trace()?;
    step("integration tests: the real XDP program on veth pairs in network namespaces");
    let matrix = filter.is_none() && !no_matrix;
    let mut command = cargo();
    command
        .args([
            "test",
            "--package",
            "limiter-tests",
            "--test",
            build::INTEGRATION,
        ])
        .arg("--")
        .args(filter)
        .args(["--test-threads=1"])
        .env("LIMITER_BIN", &limiter)
        .env("LIMITER_NO_TRACE_OBJECT", &no_trace)
        // limiter-tests' build script builds the test-clock object (the
        // program reading its clock from a map) from this very tree.
        .env("LIMITER_TESTS_BUILD_KERNEL", "1");
    status(&mut command)?;
    if matrix {
        matrix::run(&limiter, &no_trace)?;
    }
    Ok(())
}

/// What `cargo xtask test` from a clean checkout leaves in `target/` and
/// `limiter-ebpf/target/`, rounded up (measured 2026-12-01: 3.1 GB
/// without incremental caches, 5.0 GB with them).
const TEST_BUILD_BYTES: u64 = 4 << 30;

/// A checkout without incremental caches of the limiter's crates (a
/// clean one, as CI's: only xtask's own, as `cargo xtask` built it) is
/// built once, not edited and rebuilt: its caches would be 2 GB written
/// for nothing. One that has them (a developer's) keeps them.
fn build_once_if_clean() {
    let cached = std::fs::read_dir(root().join("target/debug/incremental"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| entry.file_name().to_string_lossy().starts_with("limiter"));
    if cached || std::env::var_os("CARGO_INCREMENTAL").is_some() {
        return;
    }
    println!("xtask: no incremental caches in target/: building without them");
    // SAFETY: xtask has one thread, and no other reads the environment.
    unsafe { std::env::set_var("CARGO_INCREMENTAL", "0") };
}

/// Says so before a build that may not fit: a full disk shows up as a
/// linker's bus error or an LLVM "IO failure" halfway through the build.
fn warn_if_disk_short(need: u64) {
    let root = root();
    let free = Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(&root)
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.lines().nth(1)?.trim().parse::<u64>().ok());
    if let Some(free) = free.filter(|&free| free < need) {
        let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
        println!(
            "xtask: warning: {:.1} GiB free under {}; a build from a clean checkout takes about {:.0} GiB",
            gib(free),
            root.display(),
            gib(need)
        );
    }
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

/// `cargo` for the workspace (stable), from the workspace root.
pub fn cargo() -> Command {
    let mut command = Command::new("cargo");
    command.current_dir(root());
    command
}

/// `cargo +nightly`, without the variables the outer (stable) cargo set,
/// which would otherwise pin the stable toolchain.
fn nightly_cargo() -> Command {
    let mut command = Command::new("cargo");
    for var in [
        "RUSTC",
        "RUSTDOC",
        "RUSTUP_TOOLCHAIN",
        "CARGO",
        "RUSTC_WRAPPER",
        "CARGO_TARGET_DIR",
    ] {
        command.env_remove(var);
    }
    command.arg("+nightly");
    command
}

pub fn step(what: &str) {
    println!("\n==> {what}");
}

pub fn status(command: &mut Command) -> Result<()> {
    let shown = format!("{command:?}");
    let status = command
        .status()
        .with_context(|| format!("starting {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

/// What `command` prints, once it has succeeded; `what` it was doing
/// names the failure, with what it said on stderr.
pub fn stdout_of(command: &mut Command, what: &str) -> Result<Vec<u8>> {
    let out = command.output().with_context(|| what.to_owned())?;
    if !out.status.success() {
        bail!("{what} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

pub fn require_root(why: &str) -> Result<()> {
    // The same test as `id -u`, without a libc dependency.
    let uid = std::fs::read_to_string("/proc/self/status")?
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .unwrap_or_default();
    if uid != "0" {
        bail!("this needs root: {why}. Run it as root (e.g. `sudo -E cargo xtask ...`).");
    }
    Ok(())
}
