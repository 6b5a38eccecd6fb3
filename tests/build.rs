//! Builds the test-clock XDP object (the program reading its clock from a
//! map, which the conformance replay drives) from the source tree this
//! crate is built in, whenever `limiter-common` or the program changes.
//! `cargo xtask test` relies on it, and so does `cargo xtask mutants`,
//! where the tree is cargo-mutants' mutated copy (it offers no other
//! hook). Off unless `LIMITER_TESTS_BUILD_KERNEL` is set, so plain builds
//! and clippy never need the nightly toolchain.

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
