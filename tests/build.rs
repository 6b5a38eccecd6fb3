//! For `cargo xtask mutants` only: rebuilds the test-clock XDP object from
//! the source tree this crate is built in, so that the conformance replay
//! runs the kernel program compiled from the mutated `limiter-common`
//! (cargo-mutants builds and tests a copy of the tree and offers no other
//! hook). Off unless `LIMITER_TESTS_BUILD_KERNEL` is set: plain builds, and
//! `cargo xtask test` (which builds the objects itself), never run nightly
//! cargo from here.

use std::{env, path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-env-changed=LIMITER_TESTS_BUILD_KERNEL");
    if env::var_os("LIMITER_TESTS_BUILD_KERNEL").is_none() {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    for source in ["limiter-common/src", "limiter-ebpf/src"] {
        println!("cargo:rerun-if-changed={}", root.join(source).display());
    }
    // A clean environment: the outer (stable) cargo's variables would pin
    // its toolchain, target dir and flags on the nightly build.
    let keep = ["PATH", "HOME", "CARGO_HOME", "RUSTUP_HOME"];
    let mut command = Command::new("cargo");
    command.env_clear();
    for (name, value) in env::vars_os() {
        if keep.iter().any(|k| name == *k) {
            command.env(name, value);
        }
    }
    let status = command
        .current_dir(root.join("limiter-ebpf"))
        .args([
            "+nightly",
            "build",
            "--release",
            "--features",
            "test-clock",
            "--target-dir",
            "target/test-clock",
        ])
        // Cargo reads a build script's stdout as instructions.
        .stdout(std::io::stderr())
        .status()
        .expect("running cargo +nightly for the test-clock object");
    assert!(
        status.success(),
        "building the test-clock XDP object failed"
    );
}
