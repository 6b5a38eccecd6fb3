//! The daemon's side of the fleet rules: their loops kept in step with the
//! rules applied, their shares reported, and the kernel as they see it.

use anyhow::{Context, Result};

use super::shared::Shared;
use crate::{
    fleet::{Enforcer, Grant, RuleCounts, RuleRef, node::ShareStatus},
    rules,
};

/// Runs the fleet loops of exactly `rules` (those just applied).
pub fn sync_fleet(shared: &Shared, rules: &[rules::Rule]) {
    if let Some(fleet) = shared.fleet.lock().expect("fleet lock").as_mut() {
        fleet.sync(rules);
    }
}

pub fn fleet_status(shared: &Shared) -> Vec<ShareStatus> {
    shared
        .fleet
        .lock()
        .expect("fleet lock")
        .as_ref()
        .map(|f| {
            f.status()
                .lock()
                .expect("fleet status")
                .values()
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// The kernel, as the fleet loops see it: they outlive no daemon, hence
/// the weak reference (the daemon holds the loops).
pub struct KernelShares(pub std::sync::Weak<Shared>);

impl Enforcer for KernelShares {
    fn counts(&self, rule: &RuleRef) -> Result<RuleCounts> {
        let shared = self.0.upgrade().context("the daemon is stopping")?;
        shared.engine().fleet_counts(rule)
    }

    fn enforce(&self, rule: &RuleRef, grant: Grant) -> Result<()> {
        let shared = self.0.upgrade().context("the daemon is stopping")?;
        shared.engine().set_fleet_share(rule, grant)
    }
}
