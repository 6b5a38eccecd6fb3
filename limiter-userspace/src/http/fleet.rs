//! Fleet-wide rules at layer 7: the proxy's share of a rule's aggregate,
//! written by the fleet loop (`crate::fleet`) with the moment it lapses,
//! after which the reserve applies, as in the kernel.

use std::{borrow::Cow, sync::atomic::Ordering};

use anyhow::Context;

use super::limiter::Limiter;
use crate::{
    fleet::{Enforcer, Grant, RuleCounts, RuleRef},
    rules::Rate,
};

impl Limiter {
    /// The aggregate request meter of rule `index` now: the rule's own,
    /// borrowed (every request asks), or a fleet rule's share of the
    /// moment.
    pub(super) fn aggregate_packets(&self, index: usize) -> Option<Cow<'_, Rate>> {
        let rule = &self.rules.rules[index];
        match &self.fleet[index] {
            None => rule
                .aggregate
                .as_ref()
                .and_then(|a| a.packets.as_ref())
                .map(Cow::Borrowed),
            Some(fleet) => {
                let (share, until) = *fleet.share.lock().expect("fleet share lock");
                // A share's deadline is judged to the nanosecond.
                let now = self.clock.monotonic_ns();
                Some(Cow::Owned(if now < until { share } else { fleet.reserve }))
            }
        }
    }

    fn fleet_index(&self, which: &RuleRef) -> anyhow::Result<usize> {
        let name = &which.name;
        let index = self
            .rules
            .rules
            .iter()
            .position(|r| &r.name == name)
            .with_context(|| format!("no rule named {name:?}"))?;
        anyhow::ensure!(
            self.fleet[index].is_some(),
            "rule {name:?} is not fleet-wide"
        );
        anyhow::ensure!(
            self.rules.rules[index].fingerprint() == which.fingerprint,
            "rule {name:?} is not the one its fleet loop shares"
        );
        Ok(index)
    }
}

impl Enforcer for Limiter {
    fn counts(&self, rule: &RuleRef) -> anyhow::Result<RuleCounts> {
        let counters = &self.counters[self.fleet_index(rule)?];
        Ok(RuleCounts {
            admitted: counters.passed.get(),
            refused: counters.aggregate_excess.load(Ordering::Relaxed),
        })
    }

    fn enforce(&self, rule: &RuleRef, grant: Grant) -> anyhow::Result<()> {
        let index = self.fleet_index(rule)?;
        let whole = self.rules.rules[index]
            .fleet_rate()
            .context("a fleet rule has an aggregate rate")?;
        let fleet = self.fleet[index].as_ref().context("fleet-wide")?;
        // The grant's deadline is on the system's monotonic clock; the
        // limiter may keep another (tests drive their own).
        let left = grant.until_ns.saturating_sub(crate::clock::monotonic_ns());
        let until = self.clock.monotonic_ns().saturating_add(left);
        *fleet.share.lock().expect("fleet share lock") = (whole.share(grant.local), until);
        Ok(())
    }
}
