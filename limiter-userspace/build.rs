//! Embeds the XDP object that `cargo xtask build` compiled.
//!
//! Without one (a plain `cargo build`/`cargo clippy` on a machine without
//! bpf-linker) an empty stub is embedded so the crate still builds, and the
//! binary says how to get the real thing when it is asked to load it.

use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=LIMITER_EBPF_OBJECT");
    let object = env::var_os("LIMITER_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../limiter-ebpf/target/bpfel-unknown-none/release/limiter")
        });
    println!("cargo:rerun-if-changed={}", object.display());
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("limiter.bpf.o");
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("writing OUT_DIR"),
        Err(_) => {
            println!(
                "cargo:warning=no XDP object at {}; embedding a stub (run `cargo xtask build`)",
                object.display()
            );
            fs::write(&out, []).expect("writing OUT_DIR");
        }
    }
}
