//! The root-only integration tests, one test binary with a module per
//! subject (as aya's integration-test crate): each former file its own
//! binary linked tokio, hyper, rustls and aya again, 27 links, and once
//! filled a CI machine's disk. A test's name is its path, `module::test`
//! (`module::topic::test` in a module split by topic), so a filter
//! `module::` picks one subject's tests (`cargo xtask mutants`' kernel
//! judges and the kernel matrix select them so).
//!
//! One process holds what each binary held alone: the `log` logger that
//! `reports` installs stays for the tests after it (a process has one),
//! `TempDir`s and daemons' metrics ports are named by the process id
//! (and a name the test gives), and the `limiter` binary
//! (`LIMITER_TESTS_BUILD_BIN`) is built once. `cargo xtask test` runs
//! the tests one at a time (`--test-threads=1`).

mod churn;
mod conformance;
mod credits;
mod daemon;
mod drops;
mod escalate;
mod faults;
mod fleet;
mod fragments;
mod fuzz_datapath;
mod host;
mod key_table;
mod l7;
mod l7_differential;
mod limit_change;
mod limits;
mod observability;
mod prog_test_run;
mod proxy_abuse;
mod reports;
mod skb_mode;
mod soft;
mod tcp_flags;
mod trace;
mod traffic;
mod two_cpus;
mod verifier_budget;
