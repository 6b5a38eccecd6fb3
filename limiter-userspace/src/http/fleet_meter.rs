//! A fleet-wide rule's meter at layer 7: the proxy's share of the rule's
//! aggregate and until when it holds, or the reserve (`fleet` writes and
//! reads it).

use std::sync::Mutex;

use crate::rules::{Rate, Rule};

pub(super) struct FleetMeter {
    /// The share and until when (the limiter's monotonic ns).
    pub(super) share: Mutex<(Rate, u64)>,
    pub(super) reserve: Rate,
}

impl FleetMeter {
    /// The meter of `rule` if it is fleet-wide: its reserve until a share
    /// is granted.
    pub(super) fn of(rule: &Rule) -> Option<Self> {
        let reserve = rule.fleet_rate()?.share(rule.fleet?.reserve);
        Some(Self {
            share: Mutex::new((reserve, 0)),
            reserve,
        })
    }
}
