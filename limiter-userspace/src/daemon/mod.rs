//! `limiter daemon`: owns the program, its pinned maps and its pinned XDP
//! links on every configured interface. Everything that matters is pinned,
//! so when the daemon stops (even `kill -9`) the program keeps enforcing
//! with the same buckets, and the next daemon adopts it all. It applies rule
//! files atomically (control socket, SIGHUP, optional file watch), serves
//! the control socket and the metrics endpoint.

mod apply;
mod config;
mod fleet;
mod handle;
mod housekeeping;
mod metrics;
mod serve;
mod shared;
mod startup;

pub use config::{DaemonConfig, InterfaceConfig};
pub use housekeeping::log_escalations;
pub use startup::run;
