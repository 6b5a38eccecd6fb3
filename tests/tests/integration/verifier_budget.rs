//! The verifier's budget, on whatever kernel runs the tests (the host's,
//! and each kernel of `cargo xtask test`'s matrix): every program of every
//! build of the XDP object the project ships loads, and the verifier
//! processed at most `BUDGET` instructions for it. The kernel refuses a
//! program past 1,000,000; staying well below leaves room for the next
//! feature and keeps loading fast (the daemon's start is mostly this).

use limiter_tests::{loaded_object, test_clock_object, xlated};

/// At most this many verified instructions for any one program.
const BUDGET: u32 = 400_000;

/// A rule file that makes every program reachable: rules of every
/// algorithm, with soft limits, costs, aggregates and escalation.
const RULES: &str = r#"
default: pass
rules:
  - { name: gcra, match: { source: 198.18.0.0/16, protocol: udp, dest_port: 53 }, limit: { rate: 1000, unit: second } }
  - { name: window, match: { source: 198.18.0.0/16, protocol: tcp }, algorithm: sliding_window, limit: { rate: 1000, unit: second } }
"#;

/// The builds: (name, object). The no-trace build is made by `cargo xtask
/// test` and named by `LIMITER_NO_TRACE_OBJECT`.
fn builds() -> Vec<(&'static str, Vec<u8>)> {
    let mut builds = vec![
        ("release", limiter::kernel::OBJECT.to_vec()),
        ("test-clock", test_clock_object()),
    ];
    match std::env::var_os("LIMITER_NO_TRACE_OBJECT") {
        Some(path) => builds.push((
            "no-trace",
            std::fs::read(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", std::path::Path::new(&path).display())),
        )),
        None => panic!("LIMITER_NO_TRACE_OBJECT is not set (`cargo xtask test` sets it)"),
    }
    builds
}

#[test]
fn every_program_of_every_build_verifies_within_the_budget() {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut over = Vec::new();
    for (build, object) in builds() {
        let loaded = loaded_object(&object, RULES);
        let counts = loaded.engine.datapath().verified_instructions();
        let names: Vec<&str> = counts.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            [
                "limiter",
                "limiter_decide",
                "limiter_report",
                "limiter_trace"
            ],
            "{build}: the programs loaded"
        );
        for (program, count) in counts {
            let count = count.unwrap_or_else(|| {
                panic!(
                    "{build}/{program}: the kernel did not say how many instructions it verified"
                )
            });
            // The figure BENCHMARKS.md records per kernel and build.
            println!(
                "verified: kernel {} build {build} program {program}: {count}",
                kernel.trim()
            );
            if count > BUDGET {
                over.push(format!("{build}/{program}: {count}"));
            }
        }
    }
    assert!(
        over.is_empty(),
        "over the budget of {BUDGET} verified instructions on {}: {}",
        kernel.trim(),
        over.join(", ")
    );
}

/// Linux 6.1 refuses a program whose chain of calls takes more than 512
/// bytes of stack, each frame rounded up to 32; the host's kernel rounds
/// to 16 and takes it. Read from each build's object, so a frame that
/// grew shows here before the kernel matrix boots 6.1.
#[test]
fn every_chain_of_calls_fits_linux_6_1s_stack() {
    let mut over = Vec::new();
    for (build, object) in builds() {
        let chains = limiter_tests::stack::deepest_chains(&object)
            .unwrap_or_else(|e| panic!("{build}: {e}"));
        assert_eq!(chains.len(), 4, "{build}: the programs read");
        for chain in chains {
            let frames: Vec<String> = chain.frames.iter().map(u32::to_string).collect();
            println!(
                "stack: build {build} program {}: {} bytes ({})",
                chain.program,
                chain.total(),
                frames.join(" + ")
            );
            if chain.total() > limiter_tests::stack::MAX_STACK {
                over.push(format!("{build}/{}: {}", chain.program, frames.join(" + ")));
            }
        }
    }
    assert!(
        over.is_empty(),
        "chains of calls over Linux 6.1's {} bytes of stack: {}",
        limiter_tests::stack::MAX_STACK,
        over.join(", ")
    );
}

/// Every map look-up of every program is one the verifier could resolve:
/// inlined (arrays) or a direct call (tries, hashes), never the generic
/// helper's indirect call, which the compiler causes by merging two
/// look-ups of different maps into one call (`matching::candidates_v6`).
/// One such call in the rule match cost about 10 ns a frame end to end.
#[test]
fn no_map_look_up_is_left_to_the_generic_helper() {
    let helper = xlated::generic_map_lookup_call().expect("the helper's address");
    let mut generic = Vec::new();
    for (build, object) in builds() {
        let loaded = loaded_object(&object, RULES);
        let ids = loaded.engine.datapath().program_ids();
        assert_eq!(ids.len(), 4, "{build}: the programs loaded");
        for (program, id) in ids {
            let n = xlated::calls_to(id, helper)
                .unwrap_or_else(|e| panic!("{build}/{program}: reading its instructions: {e}"));
            if n > 0 {
                generic.push(format!("{build}/{program}: {n}"));
            }
        }
    }
    assert!(
        generic.is_empty(),
        "map look-ups left to the generic helper: {}",
        generic.join(", ")
    );
}
