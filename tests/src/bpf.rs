//! The XDP program loaded in this process, unattached, and run on
//! frames through BPF_PROG_TEST_RUN: its verdicts, its clock (the
//! test-clock build), its counters, and the CPU a test runs it on.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::Result;
use aya::programs::{TestRun, TestRunOptions};
use limiter::{
    engine::Engine,
    kernel::{Datapath, counters},
    wire::Snapshot,
};

use crate::fixtures::rules;

/// BPF_PROG_TEST_RUN's verdicts.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// The program loaded with a rule set, unattached (for BPF_PROG_TEST_RUN),
/// its maps pinned in a directory of its own that is removed on drop.
pub struct Loaded {
    // Field order is drop order: unload, then remove the pins.
    pub engine: Engine,
    _pins: PinDir,
}

/// A pin directory removed on drop, also when loading fails half-way
/// (the maps are pinned before the verifier has its say).
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

impl Loaded {
    /// Where its maps are pinned.
    pub fn pin_dir(&self) -> &Path {
        &self._pins.0
    }
}

impl std::ops::Deref for Loaded {
    type Target = Datapath;
    fn deref(&self) -> &Datapath {
        self.engine.datapath()
    }
}

/// The verdict of the test build of the program (`test_clock_object`)
/// on `frame`, with its clock set to `monotonic`.
pub fn run_at(dp: &mut Loaded, frame: &[u8], monotonic: u64) -> u32 {
    set_clock(dp, monotonic);
    dp.program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
}

/// Sets the test build's clock (`test_clock_object`) to `monotonic`.
pub fn set_clock(dp: &mut Loaded, monotonic: u64) {
    dp.engine
        .datapath_mut()
        .maps_mut()
        .test_clock
        .as_mut()
        .expect("the test build has CLOCK")
        .set(0, monotonic, 0)
        .expect("setting the clock");
}

/// Loads the program with `text`'s rules: the build the `limiter` binary
/// embeds, or the one `LIMITER_TEST_OBJECT` names (`cargo xtask mutants`
/// builds each mutant of the program and runs these tests on it).
pub fn loaded(text: &str) -> Loaded {
    match std::env::var_os("LIMITER_TEST_OBJECT") {
        Some(path) => loaded_object(
            &fs::read(&path).unwrap_or_else(|e| panic!("LIMITER_TEST_OBJECT {path:?}: {e}")),
            text,
        ),
        None => loaded_object(limiter::kernel::OBJECT, text),
    }
}

/// The build of the program that reads its clock from the `CLOCK` map,
/// which this crate's build script makes from the same tree (or the one
/// `LIMITER_TEST_CLOCK_OBJECT` names, as `LIMITER_TEST_OBJECT`).
pub fn test_clock_object() -> Vec<u8> {
    let path = std::env::var_os("LIMITER_TEST_CLOCK_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../limiter-ebpf/target/test-clock/bpfel-unknown-none/release/limiter")
        });
    fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run the tests with `cargo xtask test`, which builds it)",
            path.display()
        )
    })
}

/// Loads a given build of the program with `text`'s rules.
pub fn loaded_object(object: &[u8], text: &str) -> Loaded {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = PathBuf::from(format!(
        "/sys/fs/bpf/limiter-test-{}-{n}",
        std::process::id()
    ));
    limiter::kernel::pins::ensure_bpffs().expect("bpffs");
    let _ = fs::remove_dir_all(&dir);
    let pins = PinDir(dir);
    let set = rules(text);
    let mut engine =
        Engine::open_object(object, &pins.0, set.max_keys).expect("loading the XDP program");
    engine.apply(set).expect("applying the rules");
    Loaded {
        engine,
        _pins: pins,
    }
}

pub fn snapshot(datapath: &Datapath) -> Snapshot {
    counters::read(datapath.maps()).expect("reading counters")
}

/// Pins the calling thread to CPU `cpu` (per-CPU state in the kernel,
/// one sender per CPU).
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data, zero is an empty set; CPU_SET stays
    // inside it and the call only reads it.
    let result = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    anyhow::ensure!(
        result == 0,
        "pinning to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// The verdict of a loaded program on `frame`, with its own clock.
pub fn verdict(datapath: &Datapath, frame: &[u8]) -> u32 {
    datapath
        .program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
}
