//! The program's counters summed over CPUs, per rule and interface, from
//! a loaded program's maps or a running limiter's pins.

use std::os::fd::{AsFd, AsRawFd};

use limiter_common::abi::{RuleCounters, counter_slot, global_flag, map_name, orphan_fragments};

use super::{KernelError, Maps, keys::KeyTable, maps::map_error};
use crate::wire::{InterfaceStats, KeyMapSize, OrphanFragments, RuleStats, Snapshot};

impl KeyMapSize {
    fn read(table: &KeyTable) -> Result<Self, KernelError> {
        let mut memory_bytes = 0;
        for map in table.maps() {
            let path = format!("/proc/self/fdinfo/{}", map.fd().as_fd().as_raw_fd());
            let info = std::fs::read_to_string(&path).map_err(|source| KernelError::Io {
                path: path.clone().into(),
                source,
            })?;
            memory_bytes += info
                .lines()
                .find_map(|l| l.strip_prefix("memlock:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
        Ok(Self {
            capacity: table.capacity(),
            memory_bytes,
        })
    }
}

/// Sums every CPU's counters, per rule and interface, from the maps of a
/// loaded program or of a running limiter's pins.
pub fn read(maps: &Maps) -> Result<Snapshot, KernelError> {
    let config = maps
        .config
        .get(&0, 0)
        .map_err(map_error(map_name::CONFIG))?;
    let mut snapshot = Snapshot {
        generation: config.generation,
        shadow: config.flags & global_flag::SHADOW != 0,
        keys: KeyMapSize::read(&maps.keys)?,
        ..Snapshot::default()
    };
    for cpu in maps
        .global_stats
        .get(&0, 0)
        .map_err(map_error(map_name::GLOBAL_STATS))?
        .iter()
    {
        snapshot.global.add(cpu);
    }
    if let Some(orphans) = &maps.orphan_fragments {
        let sum = |index| -> Result<u64, KernelError> {
            Ok(orphans
                .get(&index, 0)
                .map_err(map_error(map_name::ORPHAN_FRAGMENTS))?
                .iter()
                .sum())
        };
        snapshot.orphan_fragments = OrphanFragments {
            charged: sum(orphan_fragments::CHARGED)?,
            dropped: sum(orphan_fragments::DROPPED)?,
        };
    }
    let names: Vec<(u32, String)> = super::maps::named_rules(&maps.rules, config.generation)?
        .into_iter()
        .map(|(id, rule)| (id, String::from_utf8_lossy(rule.name()).into_owned()))
        .collect();
    let mut slots = maps.iface_slots()?;
    slots.push((0, 0));
    slots.sort_by_key(|&(_, slot)| slot);
    snapshot.rules = names
        .iter()
        .map(|(id, name)| RuleStats {
            id: *id,
            name: name.clone(),
            counters: RuleCounters::default(),
            over_soft: 0,
        })
        .collect();
    for (ifindex, slot) in slots {
        let mut rules = Vec::with_capacity(names.len());
        for (i, (id, name)) in names.iter().enumerate() {
            let mut counters = RuleCounters::default();
            for cpu in maps
                .rule_stats
                .get(&counter_slot(slot, *id), 0)
                .map_err(map_error(map_name::RULE_STATS))?
                .iter()
            {
                counters.add(cpu);
            }
            let over_soft = match &maps.soft_stats {
                Some(soft) => soft
                    .get(&counter_slot(slot, *id), 0)
                    .map_err(map_error(map_name::SOFT_STATS))?
                    .iter()
                    .sum(),
                None => 0,
            };
            snapshot.rules[i].counters.add(&counters);
            snapshot.rules[i].over_soft += over_soft;
            rules.push(RuleStats {
                id: *id,
                name: name.clone(),
                counters,
                over_soft,
            });
        }
        snapshot.interfaces.push(InterfaceStats {
            ifindex,
            name: iface_name(ifindex),
            xdp_mode: (ifindex != 0)
                .then(|| super::netlink::xdp_mode(ifindex).ok().flatten())
                .flatten(),
            rules,
        });
    }
    Ok(snapshot)
}

/// Rule `id`'s counters over every interface (what [`read`] sums, for one
/// rule: the fleet loop reads it several times a second).
pub fn rule_totals(maps: &Maps, id: u32) -> Result<RuleCounters, KernelError> {
    let mut slots = maps.iface_slots()?;
    slots.push((0, 0));
    let mut total = RuleCounters::default();
    for (_, slot) in slots {
        for cpu in maps
            .rule_stats
            .get(&counter_slot(slot, id), 0)
            .map_err(map_error(map_name::RULE_STATS))?
            .iter()
        {
            total.add(cpu);
        }
    }
    Ok(total)
}

/// The interface's name in our network namespace, or `if<N>`; `other` for slot 0.
pub(super) fn iface_name(ifindex: u32) -> String {
    if ifindex == 0 {
        return "other".into();
    }
    nix::net::if_::if_indextoname(ifindex).map_or_else(
        |_| format!("if{ifindex}"),
        |name| name.to_string_lossy().into_owned(),
    )
}
