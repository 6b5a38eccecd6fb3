//! The limiter's userspace: rule files, the kernel datapath's loader and
//! counters, the daemon, and the lab used by the demo and the tests.

pub mod config;
pub mod control;
pub mod daemon;
pub mod datapath;
pub mod engine;
pub mod import;
pub mod keys;
pub mod l7;
pub mod lab;
pub mod limiter;
pub mod metrics;
pub mod pins;
pub mod proxy;
pub mod report;
pub mod stats;
pub mod tables;
