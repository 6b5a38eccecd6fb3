//! Fleet-wide rules in the kernel: the share the leases allow is written
//! into the rule's aggregate packet meter with the moment it lapses, after
//! which the kernel itself falls back to the node's reserve (see
//! `RuleConfig::fleet_until_ns`). A new generation carries the share of
//! rules whose fingerprint is unchanged.

use anyhow::{Context, Result, bail};
use limiter_common::abi::{MeterConfig, RuleConfig};

use super::Engine;
use crate::{
    fleet::{Grant, RuleCounts, RuleRef},
    kernel::counters,
    rules::Rule,
};

impl Engine {
    /// Enforces `grant` as fleet rule `which`'s share of its aggregate.
    pub fn set_fleet_share(&mut self, which: &RuleRef, grant: Grant) -> Result<()> {
        let (rule, id) = self.fleet_rule(which)?;
        let meter = share_meter(&rule, grant.local);
        let (generation, mut config) = self.active_rule_config(id, &which.name)?;
        // One map update (a reader racing it may see old and new fields
        // mixed for that instant, each a valid meter).
        write_share(&mut config, meter, grant.until_ns);
        self.datapath.set_rule(generation, id, &config)?;
        self.fleet_shares.insert(which.clone(), grant);
        Ok(())
    }

    /// What fleet rule `name` admitted and what its aggregate refused, over
    /// every interface, since its id was given.
    pub fn fleet_counts(&self, which: &RuleRef) -> Result<RuleCounts> {
        let (_, id) = self.fleet_rule(which)?;
        let c = counters::rule_totals(self.datapath.maps(), id)?;
        Ok(RuleCounts {
            admitted: c.passed_packets,
            refused: c.aggregate_excess,
        })
    }

    /// The fleet rules applied.
    pub fn fleet_rules(&self) -> Vec<Rule> {
        self.applied()
            .map(|(set, _)| {
                set.rules
                    .iter()
                    .filter(|r| r.fleet.is_some())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The applied rule `which` names, if its fingerprint is still the one
    /// in force (a loop that outlived a reload must not touch its successor).
    fn fleet_rule(&self, which: &RuleRef) -> Result<(Rule, u32)> {
        let name = &which.name;
        let (set, ids) = self.applied().context("no rules applied yet")?;
        let index = set
            .rules
            .iter()
            .position(|r| &r.name == name)
            .with_context(|| format!("no rule named {name:?}"))?;
        let rule = &set.rules[index];
        if rule.fleet.is_none() {
            bail!("rule {name:?} is not fleet-wide");
        }
        if rule.fingerprint() != which.fingerprint {
            bail!("rule {name:?} changed since its fleet loop started");
        }
        Ok((rule.clone(), ids[index]))
    }

    /// Writes the shares in force into `tables`' fleet rules (by name and
    /// fingerprint: a renamed rule is another rule in the store), and
    /// forgets those of rules no longer applied.
    pub(super) fn carry_fleet_shares(
        &mut self,
        set: &crate::rules::RuleSet,
        tables: &mut crate::compile::Tables,
        ids: &[u32],
    ) {
        let mut kept = std::collections::HashMap::new();
        for (rule, id) in set.rules.iter().zip(ids) {
            let which = RuleRef::of(rule);
            let Some(grant) = self.fleet_shares.get(&which).copied() else {
                continue;
            };
            if let Some((_, config)) = tables.rules.iter_mut().find(|(i, _)| i == id) {
                write_share(config, share_meter(rule, grant.local), grant.until_ns);
                kept.insert(which, grant);
            }
        }
        self.fleet_shares = kept;
    }
}

fn share_meter(rule: &Rule, local: u64) -> MeterConfig {
    let share = rule.fleet_rate().expect("a fleet rule").share(local);
    MeterConfig {
        gcra: share.gcra,
        window: share.window,
    }
}

fn write_share(config: &mut RuleConfig, meter: MeterConfig, until_ns: u64) {
    config.aggregate_packets = meter;
    // 0 means "not a fleet rule": a share always lapses.
    config.fleet_until_ns = until_ns.max(1);
}
