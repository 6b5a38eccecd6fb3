//! Helpers for the root-only integration tests: rule files, crafted frames,
//! the `limiter` binary run as a child process, and the bounds the tests
//! hold the limiter to. A module per job; this file re-exports what the
//! tests and benchmarks use, as `limiter_tests::X`.

pub mod frames;
pub mod generator;
pub mod nginx;
pub mod stack;
pub mod xlated;

pub use limiter_conformance::{reference, traces};

mod assertions;
mod benchmark;
mod bpf;
mod daemon;
mod fixtures;
mod http;
mod lab;
mod process;
mod proxy;

pub use assertions::{
    assert_close, assert_within, json_lines, ok, parse_openmetrics, stats_rule, wait_until,
};
pub use benchmark::{machine, median};
pub use bpf::{
    Loaded, XDP_DROP, XDP_PASS, loaded, loaded_object, pin_to_cpu, run_at, set_clock, snapshot,
    test_clock_object, verdict,
};
pub use daemon::Daemon;
pub use fixtures::{Rng, TempDir, rules};
pub use http::{
    OPENMETRICS_ACCEPT, TestClock, exchange, http_get, http_request, request_from, status,
};
pub use lab::{
    CountingListener, connect_from_sender, flood, flood_pairs, session_on_receiver, sources,
    xdp_attached,
};
pub use process::{RunningLimiter, limiter_bin, limiter_command, piped, run_in_lab, start_timeout};
pub use proxy::{
    Proxy, free_loopback_addr, proxy, proxy_for, proxy_logged, proxy_printing, proxy_unread,
    upstream,
};
