//! The areas of `cargo xtask mutants`: what each mutates and which tests
//! judge it, chosen so that an area runs in at most 30 minutes on two
//! cores (see tests/MUTANTS.md for each area's last run).

/// Where the tests that run the `limiter` binary build it from the tree
/// they are in (`LIMITER_TESTS_BUILD_BIN`): a target directory of its own,
/// since the `cargo test` running them holds the workspace's.
pub const TESTS_BIN_TARGET: &str = "target/tests-bin";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AreaName {
    /// limiter-common: the algorithms, the ABI, the key table.
    Common,
    /// The fleet's leases, shares and manager.
    Fleet,
    /// The proxy's HTTP/1.1 relay and chunked framing.
    Relay,
    /// Escalation: the watch (common) and the daemon's looks (engine).
    Escalation,
    /// The kernel trace's filter and the proxy's tracer.
    Trace,
    /// Rule-file validation.
    Validation,
    /// The XDP program itself.
    Kernel,
    /// Every area, one after another.
    All,
}

/// How an area's mutants are judged.
pub enum Judge {
    /// One run of cargo-mutants with the area's tests.
    Once,
    /// Then the survivors again, against these tests (of these packages).
    SecondPass {
        test_packages: &'static [&'static str],
        tests: &'static [&'static str],
    },
    /// The XDP program's own driver (`kernel.rs`).
    Kernel,
}

pub struct Area {
    pub name: &'static str,
    pub what: &'static str,
    /// The packages whose files are mutated.
    pub packages: &'static [&'static str],
    /// The files mutated (cargo-mutants globs; all of the packages' when
    /// empty).
    pub files: &'static [&'static str],
    /// The packages whose tests judge, and `cargo test`'s arguments (test
    /// targets, then after `--` the test binaries').
    pub test_packages: &'static [&'static str],
    pub tests: &'static [&'static str],
    /// The tests run the `limiter` binary, built from the mutated tree.
    pub binary: bool,
    pub jobs: u32,
    /// Seconds a mutant's tests may take.
    pub timeout: u64,
    /// A default run takes one mutant in this many (cargo-mutants'
    /// `--shard 0/N`: spread over the list) to fit 30 minutes; `--full`
    /// takes them all.
    pub shards: u32,
    pub judge: Judge,
}

const COMMON: Area = Area {
    name: "common",
    what: "limiter-common's unit and property tests and the reference model, then the \
           conformance corpus through the XDP program and the layer-7 tests",
    packages: &["limiter-common"],
    files: &[],
    test_packages: &["limiter-common", "limiter-conformance"],
    tests: &[],
    binary: false,
    jobs: 2,
    timeout: 20,
    // 670 mutants: a third fits 30 minutes with pass 2.
    shards: 3,
    judge: Judge::SecondPass {
        test_packages: &["limiter-tests"],
        // The proxy tests are left out: they run the `limiter` binary.
        tests: &[
            "--test",
            "integration",
            "--",
            "conformance::",
            "l7::",
            "--skip",
            "proxy",
            "--skip",
            "upstream",
            "--test-threads=1",
        ],
    },
};

const FLEET: Area = Area {
    name: "fleet",
    what: "the fleet module, against its unit tests and the leases and manager tests on real \
           redis-servers",
    packages: &["limiter-userspace"],
    files: &["limiter-userspace/src/fleet/*.rs"],
    test_packages: &["limiter-userspace"],
    tests: &["--lib", "--test", "fleet_leases", "--test", "fleet_config"],
    binary: false,
    // One at a time: the tests measure when shares lapse.
    jobs: 1,
    timeout: 120,
    shards: 4,
    judge: Judge::Once,
};

const RELAY: Area = Area {
    name: "relay",
    what: "the proxy's relay and chunked framing, against its unit tests and the proxy's \
           framing tests (limiter proxy built from each mutant, real sockets)",
    packages: &["limiter-userspace"],
    files: &[
        "limiter-userspace/src/http/proxy/relay/mod.rs",
        "limiter-userspace/src/http/proxy/relay/connection.rs",
        "limiter-userspace/src/http/proxy/relay/request.rs",
        "limiter-userspace/src/http/proxy/relay/answer.rs",
        "limiter-userspace/src/http/proxy/relay/io.rs",
        "limiter-userspace/src/http/proxy/chunked.rs",
    ],
    test_packages: &["limiter-userspace", "limiter-tests"],
    // The words pick the unit tests and the tests of proxy_abuse; the
    // other modules' tests they also name are skipped (the integration
    // tests are one binary).
    tests: &[
        "--lib",
        "--test",
        "integration",
        "--",
        "chunked",
        "framing",
        "answer",
        "head",
        "pipelin",
        "upstream",
        "bod",
        "hop_by_hop",
        "content_length",
        "--skip",
        "a_request_to_an_unreachable_upstream_is_charged",
        "--skip",
        "an_unreachable_upstream_gets_502_and_shadow_passes",
        "--skip",
        "requests_in_flight_are_capped_per_key_until_their_bodies_end",
        "--skip",
        "the_upstream_gets_the_path_and_host_the_rules_judged",
        "--skip",
        "a_streamed_body_charges_a_third_limit_only_in_bytes",
        "--skip",
        "ipv4_authentication_headers",
        "--skip",
        "ipv6_extension_headers",
        "--skip",
        "extension_headers_do_not_get_around_a_limit",
        "--test-threads=1",
    ],
    binary: true,
    jobs: 1,
    timeout: 240,
    // About 210 mutants, 1.5 to 2 minutes each (the binary rebuilt).
    shards: 12,
    judge: Judge::Once,
};

const ESCALATION: Area = Area {
    name: "escalation",
    what: "escalation's watch and the daemon's looks, against their unit tests, the model's \
           check of the watch and the escalation traces replayed through the XDP program and \
           Engine::escalate",
    packages: &["limiter-common", "limiter-userspace"],
    files: &[
        "limiter-common/src/escalation.rs",
        "limiter-userspace/src/engine/escalate.rs",
    ],
    test_packages: &[
        "limiter-common",
        "limiter-userspace",
        "limiter-conformance",
        "limiter-tests",
    ],
    // `escalat` picks the unit tests, the model's and the conformance
    // replays; the daemon's and proxy's escalation tests (module
    // `escalate` of the integration tests, one binary) are skipped.
    tests: &[
        "--lib",
        "--test",
        "model",
        "--test",
        "integration",
        "--",
        "escalat",
        "--skip",
        "a_global_dry_run_escalates_nothing",
        "--skip",
        "a_source_over_its_limit_too_long_is_blocked_by_the_daemon",
        "--skip",
        "forged_refusals_hold_the_key_not_the_source",
        "--skip",
        "never_block_and_the_cap_bound_what_escalation_blocks",
        "--skip",
        "the_proxy_blocks_a_key_over_its_limit_too_long",
        "--test-threads=1",
    ],
    binary: false,
    jobs: 1,
    timeout: 120,
    shards: 3,
    judge: Judge::Once,
};

const TRACE: Area = Area {
    name: "trace",
    what: "the kernel trace's filter and the proxy's tracer, against their unit tests and the \
           trace tests",
    packages: &["limiter-userspace"],
    files: &[
        "limiter-userspace/src/trace.rs",
        "limiter-userspace/src/http/trace.rs",
    ],
    test_packages: &["limiter-userspace", "limiter-tests"],
    tests: &[
        "--lib",
        "--test",
        "integration",
        "--",
        "trace",
        // The corpus replay over HTTP: no tracing in it, a minute long.
        "--skip",
        "http_verdicts",
        "--test-threads=1",
    ],
    binary: true,
    jobs: 1,
    timeout: 300,
    // About 80 mutants, 1.3 minutes each.
    shards: 4,
    judge: Judge::Once,
};

const VALIDATION: Area = Area {
    name: "validation",
    what: "rule-file validation, against the rule tests and the input fuzzers",
    packages: &["limiter-userspace"],
    files: &[
        "limiter-userspace/src/rules/validate/mod.rs",
        "limiter-userspace/src/rules/validate/file.rs",
        "limiter-userspace/src/rules/validate/rule.rs",
        "limiter-userspace/src/rules/validate/limits.rs",
        "limiter-userspace/src/rules/validate/fleet.rs",
        "limiter-userspace/src/rules/validate/cost.rs",
        "limiter-userspace/src/rules/validate/escalation.rs",
        "limiter-userspace/src/rules/validate/text.rs",
        "limiter-userspace/src/rules/invalid.rs",
        "limiter-userspace/src/rules/raw.rs",
    ],
    test_packages: &["limiter-userspace"],
    tests: &["--lib", "--test", "fuzz_inputs"],
    binary: false,
    jobs: 2,
    timeout: 60,
    shards: 1,
    judge: Judge::Once,
};

const KERNEL: Area = Area {
    name: "kernel",
    what: "the XDP program's decisions (limiter-ebpf), against the BPF_PROG_TEST_RUN tests \
           and the conformance replays",
    packages: &["limiter-ebpf"],
    // The decision and its state; the parser is judged by the fuzzed
    // frames against the reference parser (`cargo xtask fuzz`).
    files: &[
        "src/decide.rs",
        "src/meter.rs",
        "src/admission.rs",
        "src/keys.rs",
        "src/blocks.rs",
        "src/fragments.rs",
        "src/drops.rs",
        "src/cell.rs",
    ],
    test_packages: &[],
    tests: &[],
    binary: false,
    jobs: 1,
    timeout: 180,
    shards: 1,
    judge: Judge::Kernel,
};

/// The areas `name` names.
pub fn chosen(name: AreaName) -> Vec<&'static Area> {
    let all: [(AreaName, &'static Area); 7] = [
        (AreaName::Common, &COMMON),
        (AreaName::Fleet, &FLEET),
        (AreaName::Relay, &RELAY),
        (AreaName::Escalation, &ESCALATION),
        (AreaName::Trace, &TRACE),
        (AreaName::Validation, &VALIDATION),
        (AreaName::Kernel, &KERNEL),
    ];
    all.into_iter()
        .filter(|(n, _)| name == AreaName::All || *n == name)
        .map(|(_, area)| area)
        .collect()
}
