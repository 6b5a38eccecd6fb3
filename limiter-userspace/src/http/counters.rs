//! What layer 7 counts of each rule, for the metrics.

use std::sync::atomic::AtomicU64;

use super::striped;

/// Counters per rule, as the kernel keeps them.
#[derive(Default)]
pub struct HttpCounters {
    // Added to at every request: striped (see [`striped`]).
    pub passed: striped::StripedCounter,
    pub dropped: striped::StripedCounter,
    pub shadow: striped::StripedCounter,
    /// Admitted requests whose streaming body a byte limit cut short.
    pub bodies_cut: AtomicU64,
    /// The same under a dry run: counted, not cut.
    pub shadow_bodies: AtomicU64,
    /// Of `dropped` and `shadow`: those the rule's aggregate refused (a
    /// fleet rule's demand for more of the fleet's budget).
    pub aggregate_excess: AtomicU64,
    /// Of `dropped` and `shadow`: those whose key had as many requests in
    /// flight as the rule's `concurrent` allows.
    pub in_flight_excess: AtomicU64,
    /// Of `passed`: those over the rule's soft limit.
    pub over_soft: AtomicU64,
    /// Keys blocked (or, under a dry run, counted) by `escalate`.
    pub escalations: AtomicU64,
}
