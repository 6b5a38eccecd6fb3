//! Fleet-wide rules in the kernel: the share the leases allow is written
//! into the rule's aggregate packet meter with the moment it lapses, after
//! which the kernel itself falls back to the node's reserve (see
//! `RuleConfig::fleet_until_ns`). A new generation carries the share of
//! rules whose fingerprint is unchanged.

use anyhow::{Context, Result, bail};
use limiter_common::abi::{MeterConfig, RuleConfig};

use super::Engine;
use crate::{
    fleet::{Grant, RuleCounts},
    kernel::counters,
    rules::{Rate, Rule},
};

impl Engine {
    /// Enforces `grant` as fleet rule `name`'s share of its aggregate.
    pub fn set_fleet_share(&mut self, name: &str, grant: Grant) -> Result<()> {
        let (rule, id) = self.fleet_rule(name)?;
        let fingerprint = rule.fingerprint();
        let meter = share_meter(&rule, grant.local);
        let generation = self.datapath.config()?.generation & 1;
        let (_, mut config) = self
            .datapath
            .rules(generation)?
            .into_iter()
            .find(|(i, _)| *i == id)
            .with_context(|| format!("rule {name:?} is not in the kernel's active generation"))?;
        // Lowering: the deadline first, so no moment has the old share
        // with the new deadline's length (the program reads a rule whole,
        // but a map update is not atomic for a reader).
        write_share(&mut config, meter, grant.until_ns);
        self.datapath.set_rule(generation, id, &config)?;
        self.fleet_shares.insert(fingerprint, grant);
        Ok(())
    }

    /// What fleet rule `name` admitted and what its aggregate refused, over
    /// every interface, since its id was given.
    pub fn fleet_counts(&self, name: &str) -> Result<RuleCounts> {
        let (_, id) = self.fleet_rule(name)?;
        let c = counters::rule_totals(self.datapath.maps(), id)?;
        Ok(RuleCounts {
            admitted: c.passed_packets,
            refused: c.aggregate_excess,
        })
    }

    /// The fleet rules applied: (rule, id).
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

    fn fleet_rule(&self, name: &str) -> Result<(Rule, u32)> {
        let (set, ids) = self.applied().context("no rules applied yet")?;
        let index = set
            .rules
            .iter()
            .position(|r| r.name == name)
            .with_context(|| format!("no rule named {name:?}"))?;
        let rule = &set.rules[index];
        if rule.fleet.is_none() {
            bail!("rule {name:?} is not fleet-wide");
        }
        Ok((rule.clone(), ids[index]))
    }

    /// Writes the shares in force into `tables`' fleet rules (by
    /// fingerprint), and forgets those of rules no longer applied.
    pub(super) fn carry_fleet_shares(
        &mut self,
        set: &crate::rules::RuleSet,
        tables: &mut crate::compile::Tables,
        ids: &[u32],
    ) {
        let mut kept = std::collections::HashMap::new();
        for (rule, id) in set.rules.iter().zip(ids) {
            let fingerprint = rule.fingerprint();
            let Some(grant) = self.fleet_shares.get(&fingerprint).copied() else {
                continue;
            };
            if let Some((_, config)) = tables.rules.iter_mut().find(|(i, _)| i == id) {
                write_share(config, share_meter(rule, grant.local), grant.until_ns);
                kept.insert(fingerprint, grant);
            }
        }
        self.fleet_shares = kept;
    }
}

fn share_meter(rule: &Rule, local: u64) -> MeterConfig {
    let whole: Rate = rule
        .aggregate
        .and_then(|a| a.packets)
        .expect("validation: a fleet rule has an aggregate rate");
    let share = whole.share(local);
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
