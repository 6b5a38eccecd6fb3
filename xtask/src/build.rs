//! What `cargo xtask` builds: the XDP object and the `limiter` binary
//! (debug with the fault tests' crash points, or release), and the
//! program's variants the tests and benchmarks load (cut after each stage,
//! without tracing, an older revision's).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{cargo, nightly_cargo, root, status, step};

/// `limiter-userspace`'s feature of crash points (`faults.rs`), which
/// every debug build (the one the tests run) has and no release build.
pub const FAULTS: &str = "faults";

/// Builds the kernel object, then `limiter` with it embedded; returns the binary.
pub fn build(release: bool) -> Result<PathBuf> {
    step("building the XDP program (nightly, bpfel-unknown-none)");
    let ebpf = root().join("limiter-ebpf");
    status(
        nightly_cargo()
            .current_dir(&ebpf)
            .args(["build", "--release"]),
    )?;
    let object = ebpf.join("target/bpfel-unknown-none/release/limiter");
    step("building the limiter binary");
    let mut command = cargo();
    command
        .args(["build", "--package", "limiter-userspace"])
        .env("LIMITER_EBPF_OBJECT", &object);
    if release {
        command.arg("--release");
    } else {
        // The binary the tests run: with the crash points of the fault
        // tests, which a release build leaves out.
        command.args(["--features", FAULTS]);
    }
    status(&mut command)?;
    let binary = root()
        .join("target")
        .join(if release { "release" } else { "debug" })
        .join("limiter");
    println!("xtask: built {}", binary.display());
    Ok(binary)
}

/// The program cut after each of its stages (`limiter-ebpf/src/profile.rs`),
/// for the bench's profile: `stage-N` in the returned directory. Built in
/// a target directory of their own, so no cut program can ever be the one
/// a later build embeds.
pub fn build_profile_stages() -> Result<PathBuf> {
    /// `profile::METERED`, the last stage.
    const STAGES: u32 = 9;
    step("building the XDP program cut after each stage (the bench's profile)");
    let ebpf = root().join("limiter-ebpf");
    let dir = root().join("target/profile");
    std::fs::create_dir_all(&dir)?;
    for stage in 1..=STAGES {
        build_program_variant(
            &ebpf,
            &ebpf.join("target/profile"),
            &[("LIMITER_PROFILE_STOP", &stage.to_string())],
            &dir.join(format!("stage-{stage}")),
        )?;
    }
    Ok(dir)
}

/// Builds the XDP program of `crate_dir` (a `limiter-ebpf`) with `env`
/// set, in `target_dir` (one of its own, so that no variant is ever the
/// program a later build embeds), and copies it to `to`.
fn build_program_variant(
    crate_dir: &Path,
    target_dir: &Path,
    env: &[(&str, &str)],
    to: &Path,
) -> Result<()> {
    status(
        nightly_cargo()
            .current_dir(crate_dir)
            .args(["build", "--release", "--quiet", "--target-dir"])
            .arg(target_dir)
            .envs(env.iter().copied()),
    )?;
    let built = target_dir.join("bpfel-unknown-none/release/limiter");
    std::fs::copy(&built, to)
        .with_context(|| format!("copying {} to {}", built.display(), to.display()))?;
    Ok(())
}

/// The program without any tracing code (`LIMITER_NO_TRACE=1`): a build
/// the verifier budget checks, and the bench's measure of what the idle
/// trace branch costs; a target directory of its own, as the profile's
/// cuts.
pub fn build_without_trace() -> Result<PathBuf> {
    step("building the XDP program without tracing code (verifier budget, bench)");
    let ebpf = root().join("limiter-ebpf");
    let to = root().join("target/notrace-limiter.o");
    build_program_variant(
        &ebpf,
        &ebpf.join("target/notrace"),
        &[("LIMITER_NO_TRACE", "1")],
        &to,
    )?;
    Ok(to)
}

/// The XDP program as built from git revision `revision` (a worktree of
/// its own, removed after), for the bench's `baseline` section; and the
/// commit it names.
pub fn build_baseline(revision: &str) -> Result<(PathBuf, String)> {
    let git_output = |args: &[&str]| -> Result<String> {
        let out = Command::new("git")
            .current_dir(root())
            .args(args)
            .output()
            .with_context(|| format!("git {}", args.join(" ")))?;
        if !out.status.success() {
            bail!(
                "git {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let commit = git_output(&["rev-parse", "--verify", &format!("{revision}^{{commit}}")])
        .with_context(|| format!("--baseline {revision}: not a commit of this repository"))?;
    step(&format!(
        "building the XDP program at {revision} ({commit}, the bench's baseline)"
    ));
    // Its maps are loaded by this build: layouts that differ would fail,
    // flags that mean something else would measure another program.
    if git_output(&[
        "diff",
        "--quiet",
        &commit,
        "HEAD",
        "--",
        "limiter-common/src/abi.rs",
    ])
    .is_err()
    {
        println!(
            "xtask: warning: limiter-common/src/abi.rs differs between {revision} and HEAD; \
             the baseline is loaded with this build's maps and rules"
        );
    }
    let source = root().join("target/baseline-src");
    let source_arg = source.to_string_lossy().into_owned();
    // What an interrupted run left: the worktree, or its registration.
    let _ = git_output(&["worktree", "remove", "--force", &source_arg]);
    let _ = std::fs::remove_dir_all(&source);
    git_output(&["worktree", "prune"])?;
    git_output(&[
        "worktree",
        "add",
        "--force",
        "--detach",
        &source_arg,
        &commit,
    ])?;
    let to = root().join("target/baseline-limiter.o");
    let built = build_program_variant(
        &source.join("limiter-ebpf"),
        &root().join("limiter-ebpf/target/baseline"),
        &[],
        &to,
    );
    let removed = git_output(&["worktree", "remove", "--force", &source_arg]);
    built?;
    removed?;
    Ok((to, commit))
}

/// The integration tests' one test binary (`tests/tests/integration`).
pub const INTEGRATION: &str = "integration";

/// Builds the integration tests (as `cargo test` would, without running
/// them), with `env` set, and returns their binary.
pub fn integration_tests(env: &[(&str, &str)]) -> Result<PathBuf> {
    let out = crate::stdout_of(
        cargo()
            .args([
                "test",
                "--package",
                "limiter-tests",
                "--test",
                INTEGRATION,
                "--no-run",
                "--message-format=json",
            ])
            .envs(env.iter().copied()),
        "building the integration tests",
    )?;
    test_executable(&String::from_utf8_lossy(&out), INTEGRATION)
        .with_context(|| format!("cargo built no test binary {INTEGRATION}"))
}

/// The executable of test target `name` in cargo's JSON messages.
fn test_executable(messages: &str, name: &str) -> Option<PathBuf> {
    messages.lines().find_map(|line| {
        let message: serde_json::Value = serde_json::from_str(line).ok()?;
        let is_test = message["target"]["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == "test"));
        let executable = message["executable"].as_str()?;
        (is_test && message["target"]["name"] == name).then(|| PathBuf::from(executable))
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::test_executable;

    /// Only the test target of that name, with an executable: not a
    /// library of the same name, not a message without one.
    #[test]
    fn the_test_binary_is_found_in_cargos_messages() {
        let messages = concat!(
            "not json\n",
            r#"{"reason":"compiler-artifact","target":{"name":"integration","kind":["lib"]},"executable":"/lib"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"name":"other","kind":["test"]},"executable":"/other"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"name":"integration","kind":["test"]},"executable":"/t/integration-1"}"#,
            "\n",
        );
        assert_eq!(
            test_executable(messages, "integration"),
            Some(PathBuf::from("/t/integration-1"))
        );
        assert_eq!(test_executable(messages, "missing"), None);
    }
}
