//! The rule tables in two generations: a rule set is written whole into the
//! generation packets do not read, then one write to `CONFIG` flips it (see
//! `crate::engine`). Also the per-rule state that goes with a rule id.

use aya::maps::{LpmTrie, MapData, PerCpuValues, lpm_trie::Key};
use std::sync::atomic::AtomicU64;

use limiter_common::{
    abi::{
        AggregateState, Candidates, MAX_IFACES, MAX_RULES, PrefixKey, RuleConfig, RuleCounters,
        algorithm, counter_slot, map_name, rule_flag, rule_slot, v4_table,
    },
    gcra::Gcra,
    meter::{self, CarriedTat},
};

use super::{Datapath, KernelError, keys::Carried, maps::map_error};
use crate::compile::{Tables, v4_table::V4Table};

impl Datapath {
    /// The named rules of `generation`, by id.
    pub fn rules(&self, generation: u32) -> Result<Vec<(u32, RuleConfig)>, KernelError> {
        super::maps::named_rules(&self.maps.rules, generation)
    }

    /// Rewrites one rule of one generation in place (a single map update,
    /// so packets see the old or the new value, never a mix).
    pub fn set_rule(
        &mut self,
        generation: u32,
        id: u32,
        rule: &RuleConfig,
    ) -> Result<(), KernelError> {
        self.maps
            .rules
            .set(rule_slot(generation, id), rule, 0)
            .map_err(map_error(map_name::RULES))
    }

    /// Empties every table of `generation`.
    pub fn clear_generation(&mut self, generation: u32) -> Result<(), KernelError> {
        let rules = &mut self.maps.rules;
        for id in 0..MAX_RULES {
            let slot = rule_slot(generation, id);
            if rules
                .get(&slot, 0)
                .map_err(map_error(map_name::RULES))?
                .name[0]
                != 0
            {
                rules
                    .set(slot, RuleConfig::default(), 0)
                    .map_err(map_error(map_name::RULES))?;
            }
        }
        // The IPv4 table of a generation is written whole: nothing to clear.
        remove_prefixes(
            &mut self.maps.lpm_v6,
            map_name::LPM_V6,
            (generation & 1) as u8,
        )?;
        Ok(())
    }

    /// Writes a generation's tables (into an inactive, cleared generation).
    pub fn write_generation(
        &mut self,
        generation: u32,
        tables: &Tables,
    ) -> Result<(), KernelError> {
        for (id, rule) in &tables.rules {
            self.set_rule(generation, *id, rule)?;
        }
        self.write_v4_table(&tables.v4)?;
        for (prefix, key, candidates) in &tables.v6 {
            self.maps
                .lpm_v6
                .insert(&Key::new(*prefix, *key), candidates, 0)
                .map_err(map_error(map_name::LPM_V6))?;
        }
        let maps = &mut self.maps;
        by_rule_slot(
            maps.costs.as_mut(),
            map_name::COSTS,
            generation,
            &tables.costs,
        )?;
        by_rule_slot(
            maps.soft_limits.as_mut(),
            map_name::SOFT_LIMITS,
            generation,
            &tables.third_word,
        )?;
        Ok(())
    }

    /// Writes one generation of the IPv4 table: its lists first, then its
    /// blocks through the mappings (nothing reads them until the flip).
    fn write_v4_table(&mut self, table: &V4Table) -> Result<(), KernelError> {
        let g = table.generation;
        for (i, list) in (g * v4_table::LISTS..).zip(&table.lists) {
            self.maps
                .v4_lists
                .set(i, list, 0)
                .map_err(map_error(map_name::V4_LISTS))?;
        }
        let maps = &mut self.maps;
        for (first, block) in table.l16.chunks_exact(v4_table::BLOCK).enumerate() {
            let block: &v4_table::Block = block.try_into().expect("chunks of a block");
            maps.v4_l16
                .write((g * v4_table::L16_BLOCKS) as usize + first, &[*block]);
        }
        let base = (g * v4_table::SUBTABLES) as usize;
        maps.v4_l24.write(base, &table.l24);
        maps.v4_l32.write(base, &table.l32);
        Ok(())
    }

    /// Zeroes a rule id's aggregate state and counters before the id is
    /// given to a new rule.
    pub fn reset_rule_state(&mut self, id: u32) -> Result<(), KernelError> {
        self.maps
            .aggregates
            .set(id, AggregateState::default(), 0)
            .map_err(map_error(map_name::AGGREGATES))?;
        self.maps
            .admissions
            .set(id, 0, 0)
            .map_err(map_error(map_name::ADMISSIONS))?;
        let cpus = aya::util::nr_cpus().map_err(|(_, source)| KernelError::Io {
            path: "/sys/devices/system/cpu/possible".into(),
            source,
        })?;
        for iface in 0..MAX_IFACES {
            self.maps
                .rule_stats
                .set(
                    counter_slot(iface, id),
                    per_cpu_zeros::<RuleCounters>(cpus)?,
                    0,
                )
                .map_err(map_error(map_name::RULE_STATS))?;
            if let Some(soft) = &mut self.maps.soft_stats {
                soft.set(counter_slot(iface, id), per_cpu_zeros(cpus)?, 0)
                    .map_err(map_error(map_name::SOFT_STATS))?;
            }
        }
        Ok(())
    }

    /// Carries rule `id`'s GCRA state (its keys' and its aggregate's) from
    /// limits `old` over to `new`, before `new` is in force
    /// (`meter::carry`: every TAT to the later of its own and its carried
    /// value, so no key has more budget than either limit allows
    /// meanwhile); [`Datapath::finish_carrying`], once the new limits are
    /// in force, takes back what that added. Windows keep their counts:
    /// nothing to do. A meter in force on one side only starts or stays as
    /// it is; fleet-wide aggregates, whose share restarts anyway, are left.
    pub fn carry_rule_state(
        &mut self,
        id: u32,
        old: &RuleConfig,
        new: &RuleConfig,
        third: Option<(&Gcra, &Gcra)>,
    ) -> Result<Carrying, KernelError> {
        let mut carrying = Carrying {
            id,
            keys: Vec::new(),
            aggregate: [CarriedTat::default(); 2],
        };
        if old.algorithm != algorithm::GCRA || new.algorithm != algorithm::GCRA {
            return Ok(carrying);
        }
        let both = |flag: u32| old.flags & new.flags & flag != 0;
        let key_meters = [
            both(rule_flag::LIMIT_PACKETS).then_some((&old.packets.gcra, &new.packets.gcra)),
            both(rule_flag::LIMIT_BYTES).then_some((&old.bytes.gcra, &new.bytes.gcra)),
            third.filter(|_| both(rule_flag::THIRD_LIMIT)),
        ];
        carrying.keys = self.maps.keys.carry(id, &key_meters, || self.clock_ns());
        if old.fleet_until_ns != 0 || new.fleet_until_ns != 0 {
            return Ok(carrying);
        }
        let aggregate_meters = [
            both(rule_flag::AGGREGATE_PACKETS)
                .then_some((&old.aggregate_packets.gcra, &new.aggregate_packets.gcra)),
            both(rule_flag::AGGREGATE_BYTES)
                .then_some((&old.aggregate_bytes.gcra, &new.aggregate_bytes.gcra)),
        ];
        if aggregate_meters.iter().all(Option::is_none) {
            return Ok(carrying);
        }
        // A map update, not a compare-and-swap: a charge the kernel makes
        // between this read and write (microseconds) is lost.
        let mut state = self.aggregate(id)?;
        let now = self.clock_ns();
        for (m, meters) in aggregate_meters.iter().enumerate() {
            if let Some((from, to)) = meters {
                let cell = AtomicU64::new(state.meters[m][0]);
                carrying.aggregate[m] = meter::carry(&cell, from, to, now);
                state.meters[m][0] = cell.into_inner();
            }
        }
        self.set_aggregate(id, state)?;
        Ok(carrying)
    }

    /// The meter of rule `id`'s keys' third word in `generation` (a soft
    /// or a third limit, as the rule's flags say).
    pub fn third_word(&self, generation: u32, id: u32) -> Option<Gcra> {
        self.maps
            .soft_limits
            .as_ref()?
            .get(&rule_slot(generation, id), 0)
            .ok()
    }

    /// Takes back what [`Datapath::carry_rule_state`] added beyond the
    /// carried values, now that the new limits are in force.
    pub fn finish_carrying(&mut self, carrying: &Carrying) -> Result<(), KernelError> {
        self.maps.keys.take_back(&carrying.keys, || self.clock_ns());
        if carrying.aggregate != [CarriedTat::default(); 2] {
            let mut state = self.aggregate(carrying.id)?;
            let now = self.clock_ns();
            for (m, tat) in carrying.aggregate.iter().enumerate() {
                let cell = AtomicU64::new(state.meters[m][0]);
                meter::take_back(&cell, *tat, now);
                state.meters[m][0] = cell.into_inner();
            }
            self.set_aggregate(carrying.id, state)?;
        }
        Ok(())
    }

    fn aggregate(&self, id: u32) -> Result<AggregateState, KernelError> {
        self.maps
            .aggregates
            .get(&id, 0)
            .map_err(map_error(map_name::AGGREGATES))
    }

    fn set_aggregate(&mut self, id: u32, state: AggregateState) -> Result<(), KernelError> {
        self.maps
            .aggregates
            .set(id, state, 0)
            .map_err(map_error(map_name::AGGREGATES))
    }

    /// Deletes every key of the given rule ids; returns how many.
    pub fn forget_keys(&mut self, ids: &[u32]) -> Result<usize, KernelError> {
        Ok(self.maps.keys.forget(ids))
    }
}

/// Removes one generation's entries from an LPM trie of rules.
fn remove_prefixes<const N: usize>(
    trie: &mut LpmTrie<MapData, PrefixKey<N>, Candidates>,
    name: &'static str,
    generation: u8,
) -> Result<(), KernelError>
where
    PrefixKey<N>: aya::Pod,
{
    let stale: Vec<_> = trie
        .keys()
        .filter_map(Result::ok)
        .filter(|k| k.data().generation == generation)
        .collect();
    for key in stale {
        trie.remove(&key).map_err(map_error(name))?;
    }
    Ok(())
}

/// A default value for each of `cpus` CPUs, for a per-CPU map.
fn per_cpu_zeros<T: aya::Pod + Default + Clone>(
    cpus: usize,
) -> Result<PerCpuValues<T>, KernelError> {
    PerCpuValues::try_from(vec![T::default(); cpus]).map_err(|source| KernelError::Io {
        path: "/sys/devices/system/cpu/possible".into(),
        source,
    })
}

/// Writes `entries` (rule id, value) into `map` at their `rule_slot` of
/// `generation`; a map the object lacks is an error only if there is
/// something to write.
fn by_rule_slot<T: aya::Pod>(
    map: Option<&mut aya::maps::Array<MapData, T>>,
    name: &'static str,
    generation: u32,
    entries: &[(u32, T)],
) -> Result<(), KernelError> {
    if entries.is_empty() {
        return Ok(());
    }
    let map = map.ok_or_else(|| KernelError::BadObject(format!("it has no map {name}")))?;
    for (id, value) in entries {
        map.set(rule_slot(generation, *id), value, 0)
            .map_err(map_error(name))?;
    }
    Ok(())
}

/// A rule's state on its way to new limits ([`Datapath::carry_rule_state`]).
pub struct Carrying {
    id: u32,
    keys: Vec<Carried>,
    /// Per aggregate meter (packets, bytes).
    aggregate: [CarriedTat; 2],
}
