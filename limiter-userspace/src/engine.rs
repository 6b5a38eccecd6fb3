//! The control logic over the kernel: applying rule sets atomically with
//! stable rule ids, manual blocks, dry-run switches, and the views of it
//! all that the control protocol returns. Used by the daemon and by
//! `limiter run`.

use std::{collections::HashMap, net::IpAddr, path::Path, time::Duration};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;
use limiter_common::abi::{DEFAULT_RULE, MAX_RULES, RuleConfig, global_flag, rule_flag};

use crate::{
    clock::{monotonic_ns, realtime_offset_ns},
    compile,
    kernel::{Datapath, counters, flip::Switch},
    rules::describe::describe,
    rules::{
        RuleSet,
        pairing::{OldRule, Paired, pair},
    },
    wire::{Attachment, BlockView, Change, Mode, RuleView, RulesView, Snapshot},
};

pub mod escalate;
mod fleet;
mod watch;

pub struct Engine {
    datapath: Datapath,
    /// The rule set in force and the id of each of its rules.
    applied: Option<(RuleSet, Vec<u32>)>,
    /// Fleet rules' shares in force.
    fleet_shares: HashMap<crate::fleet::RuleRef, crate::fleet::Grant>,
    /// Keys over their limit, and the blocks escalation made.
    watch: watch::Watch,
}

impl Engine {
    /// Loads the program over the state pinned under `pin_dir` (if any).
    pub fn open(pin_dir: &Path, max_keys: u32) -> Result<Self> {
        Ok(Self {
            datapath: Datapath::open(pin_dir, max_keys)?,
            applied: None,
            fleet_shares: HashMap::new(),
            watch: watch::Watch::default(),
        })
    }

    /// Loads a given object instead of the embedded one (the tests load
    /// the build that takes its clock from a map).
    pub fn open_object(object: &[u8], pin_dir: &Path, max_keys: u32) -> Result<Self> {
        Ok(Self {
            datapath: Datapath::open_object(object, pin_dir, max_keys)?,
            applied: None,
            fleet_shares: HashMap::new(),
            watch: watch::Watch::default(),
        })
    }

    pub fn datapath(&self) -> &Datapath {
        &self.datapath
    }

    pub fn datapath_mut(&mut self) -> &mut Datapath {
        &mut self.datapath
    }

    pub fn applied(&self) -> Option<&(RuleSet, Vec<u32>)> {
        self.applied.as_ref()
    }

    pub fn attach(&mut self, iface: &str, mode: Mode, pin_link: bool) -> Result<Attachment> {
        Ok(self.datapath.attach(iface, mode, pin_link)?)
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        Ok(counters::read(self.datapath.maps())?)
    }

    /// Switches to `set`: writes it into the inactive generation, flips,
    /// and forgets the keys of rules that are gone. Rules whose
    /// fingerprint is unchanged keep their id, so their buckets, aggregate
    /// state and counters carry over; so do rules whose limits alone
    /// changed, their state carried over to the new limits (the same
    /// fraction of the burst in use; window counts kept).
    pub fn apply(&mut self, set: RuleSet) -> Result<Change> {
        set.kernel_compatible()?;
        let config = self.datapath.config()?;
        let active = config.generation & 1;
        let next = active ^ 1;
        let old: Vec<(u32, RuleConfig)> = self
            .datapath
            .rules(active)?
            .into_iter()
            .filter(|(id, _)| *id != DEFAULT_RULE)
            .collect();

        // Ids: reuse by fingerprint, and a rule whose limits alone changed
        // keeps the id, and the keys, of the old rule with its identity
        // (`rules::pairing`, as layer 7's reload pairs them): its state is
        // carried over to the new limits below. Allocate the rest
        // round-robin so that a freed id is not handed out again soon.
        let held: Vec<OldRule<'_>> = old
            .iter()
            .map(|(_, rule)| OldRule {
                fingerprint: rule.fingerprint,
                identity: rule.identity,
                name: rule.name(),
            })
            .collect();
        let pairs = pair(&held, &set.rules);
        let mut ids: Vec<Option<u32>> = pairs.iter().map(|p| p.map(|p| old[p.old()].0)).collect();
        let carried: Vec<(u32, RuleConfig)> = pairs
            .iter()
            .flatten()
            .filter_map(|p| match *p {
                Paired::Carried(i) => Some(old[i]),
                Paired::Kept(_) => None,
            })
            .collect();
        let mut taken: Vec<u32> = old.iter().map(|(id, _)| *id).collect();
        let mut cursor = config.next_rule_id.clamp(1, MAX_RULES - 1);
        let mut fresh = Vec::new();
        for slot in ids.iter_mut().filter(|s| s.is_none()) {
            let id = (0..MAX_RULES - 1)
                .map(|i| 1 + (cursor - 1 + i) % (MAX_RULES - 1))
                .find(|id| !taken.contains(id))
                .with_context(|| {
                    format!(
                        "no free rule ids: the rules in force and the new ones together would be \
                         more than {} (rules whose match, key and limits are unchanged share an id); \
                         apply a smaller file first",
                        MAX_RULES - 1
                    )
                })?;
            taken.push(id);
            fresh.push(id);
            *slot = Some(id);
            cursor = id % (MAX_RULES - 1) + 1;
        }
        let ids: Vec<u32> = ids.into_iter().map(|id| id.expect("assigned")).collect();
        let mut tables = compile::build(&set, &ids, next as u8);
        self.carry_fleet_shares(&set, &mut tables, &ids);
        let freed: Vec<u32> = old
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !ids.contains(id))
            .collect();
        let forgotten_keys = self.datapath.switch(Switch {
            config,
            fresh: &fresh,
            carried: &carried,
            freed: &freed,
            tables: &tables,
            next_rule_id: cursor,
        })?;
        let carried_ids: Vec<u32> = carried.iter().map(|(id, _)| *id).collect();
        let change = diff(&old, &set, &ids, &carried_ids, next, forgotten_keys);
        self.applied = Some((set, ids));
        Ok(change)
    }

    /// Dry run for everything (`rule: None`) or for one rule of the active
    /// set. A rule's switch lasts until the next rule file is applied.
    pub fn set_shadow(&mut self, rule: Option<&str>, on: bool) -> Result<()> {
        let mut config = self.datapath.config()?;
        let Some(name) = rule else {
            if on {
                config.flags |= global_flag::SHADOW;
            } else {
                config.flags &= !global_flag::SHADOW;
            }
            return Ok(self.datapath.set_config(config)?);
        };
        let (set, ids) = self.applied.as_ref().context("no rules applied yet")?;
        let index = set
            .rules
            .iter()
            .position(|r| r.name == name)
            .with_context(|| format!("no rule named {name:?}"))?;
        let id = ids[index];
        let (generation, mut rule) = self.active_rule_config(id, name)?;
        if rule.flags & rule_flag::UNLIMITED != 0 {
            bail!("rule {name:?} is unlimited: it never drops, so it has no dry run");
        }
        if on {
            rule.flags |= rule_flag::SHADOW;
        } else {
            rule.flags &= !rule_flag::SHADOW;
        }
        self.datapath.set_rule(generation, id, &rule)?;
        if let Some((set, _)) = self.applied.as_mut() {
            set.rules[index].shadow = on;
        }
        Ok(())
    }

    /// The active generation, and rule `id`'s (named `name`) config in it.
    fn active_rule_config(&self, id: u32, name: &str) -> Result<(u32, RuleConfig)> {
        let generation = self.datapath.config()?.generation & 1;
        let (_, rule) = self
            .datapath
            .rules(generation)?
            .into_iter()
            .find(|(i, _)| *i == id)
            .with_context(|| format!("rule {name:?} is not in the kernel's active generation"))?;
        Ok((generation, rule))
    }

    /// Blocks `net` (for `duration`, or until unblocked).
    pub fn block(&mut self, net: IpNet, duration: Option<Duration>) -> Result<()> {
        let expires_ns = match duration {
            Some(d) => u64::try_from(d.as_nanos())
                .ok()
                .and_then(|ns| monotonic_ns().checked_add(ns))
                .filter(|&at| at != 0)
                .context("a block lasts at most 500 years; leave out the duration for ever")?,
            None => 0,
        };
        let net = net.trunc();
        let prefix = u32::from(net.prefix_len());
        match net.addr() {
            IpAddr::V4(a) => self.datapath.set_block(a.octets(), prefix, expires_ns)?,
            IpAddr::V6(a) => self.datapath.set_block(a.octets(), prefix, expires_ns)?,
        }
        Ok(())
    }

    /// Removes a block; `false` if `net` was not blocked.
    pub fn unblock(&mut self, net: IpNet) -> Result<bool> {
        let net = net.trunc();
        let prefix = u32::from(net.prefix_len());
        Ok(match net.addr() {
            IpAddr::V4(a) => self.datapath.remove_block(a.octets(), prefix)?,
            IpAddr::V6(a) => self.datapath.remove_block(a.octets(), prefix)?,
        })
    }

    pub fn blocks(&self) -> Result<Vec<BlockView>> {
        let now = monotonic_ns();
        let view = |addr: IpAddr, prefix: u32, block: limiter_common::abi::Block| BlockView {
            prefix: IpNet::new(addr, prefix as u8)
                .map_or_else(|_| addr.to_string(), |n| n.to_string()),
            expires_in_secs: (block.expires_ns != 0)
                .then(|| block.expires_ns.saturating_sub(now) as f64 / 1e9),
            expired: block.expires_ns != 0 && block.expires_ns <= now,
            dropped_packets: block.dropped_packets,
            escalated_by: IpNet::new(addr, prefix as u8)
                .ok()
                .and_then(|net| self.watch.made_by(&net)),
        };
        let mut out: Vec<BlockView> = self
            .datapath
            .blocks::<4>()?
            .into_iter()
            .map(|(a, p, b)| view(IpAddr::from(a), p, b))
            .collect();
        out.extend(
            self.datapath
                .blocks::<16>()?
                .into_iter()
                .map(|(a, p, b)| view(IpAddr::from(a), p, b)),
        );
        Ok(out)
    }

    /// Deletes blocks that have expired (the kernel already ignores them).
    pub fn remove_expired_blocks(&mut self) -> Result<usize> {
        let expired: Vec<IpNet> = self
            .blocks()?
            .into_iter()
            .filter(|b| b.expired)
            .filter_map(|b| b.prefix.parse().ok())
            .collect();
        for net in &expired {
            self.unblock(*net)?;
            tracing::info!(event = "block_expired", prefix = %net, "the block of {net} expired");
        }
        Ok(expired.len())
    }
}

/// What `set` (rule `i` under id `ids[i]`) changed from `old`, by name; a
/// rule whose id is in `carried` kept its keys under new limits (renamed
/// or not: its old name is not listed as removed).
fn diff(
    old: &[(u32, RuleConfig)],
    set: &RuleSet,
    ids: &[u32],
    carried: &[u32],
    generation: u32,
    forgotten_keys: usize,
) -> Change {
    let name_of = |rule: &RuleConfig| String::from_utf8_lossy(rule.name()).into_owned();
    let old_by_name: HashMap<String, u32> = old.iter().map(|(id, r)| (name_of(r), *id)).collect();
    let mut change = Change {
        generation,
        forgotten_keys,
        ..Change::default()
    };
    for (rule, id) in set.rules.iter().zip(ids) {
        let list = if carried.contains(id) {
            &mut change.carried
        } else {
            match old_by_name.get(&rule.name) {
                None => &mut change.added,
                Some(old_id) if old_id == id => &mut change.unchanged,
                Some(_) => &mut change.modified,
            }
        };
        list.push(rule.name.clone());
    }
    for (name, id) in &old_by_name {
        if !set.rules.iter().any(|r| &r.name == name) && !carried.contains(id) {
            change.removed.push(name.clone());
        }
    }
    change.removed.sort();
    change
}

impl Engine {
    /// Refreshes the kernel's `CLOCK_REALTIME − CLOCK_MONOTONIC` (window
    /// algorithms align to the epoch; NTP moves the difference slowly).
    pub fn refresh_clock(&mut self) -> Result<()> {
        let mut config = self.datapath.config()?;
        config.realtime_offset_ns = realtime_offset_ns();
        Ok(self.datapath.set_config(config)?)
    }
}

impl Engine {
    /// The active rules with their ids and counters, and the blocks.
    pub fn rules_view(&self) -> Result<RulesView> {
        let snapshot = self.snapshot()?;
        let (set, ids) = self.applied().context("no rules applied yet")?;
        let rules = set
            .rules
            .iter()
            .zip(ids)
            .map(|(rule, &id)| {
                let c = snapshot
                    .rules
                    .iter()
                    .find(|r| r.id == id)
                    .map(|r| r.counters)
                    .unwrap_or_default();
                RuleView {
                    id,
                    name: rule.name.clone(),
                    description: describe(rule),
                    passed_packets: c.passed_packets,
                    dropped_packets: c.dropped_packets,
                    shadow_packets: c.shadow_packets,
                    new_keys: c.new_keys,
                }
            })
            .collect();
        Ok(RulesView {
            generation: snapshot.generation,
            shadow: snapshot.shadow,
            rules,
            blocks: self.blocks()?,
            fleet: Vec::new(),
        })
    }
}
