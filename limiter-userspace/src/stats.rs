//! Reading the program's counters, from a loaded program or from the maps a
//! running limiter pinned.

use std::{
    borrow::Borrow,
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{Array, Map, MapData, PerCpuArray};
use limiter_common::abi::{GlobalCounters, MAX_RULES, RuleConfig, RuleCounters, map_name};
use serde::Serialize;

/// The counter maps of one limiter.
pub struct CounterMaps<T> {
    rules: Array<T, RuleConfig>,
    rule_stats: PerCpuArray<T, RuleCounters>,
    global: PerCpuArray<T, GlobalCounters>,
    keys: T,
}

/// Counters summed over CPUs.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Snapshot {
    pub global: GlobalCounters,
    pub rules: Vec<RuleStats>,
    pub keys: KeyMap,
}

/// The per-key state map, as the kernel accounts for it.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct KeyMap {
    /// Keys it holds before the least recently used are evicted.
    pub capacity: u64,
    /// Kernel memory charged for it (`memlock` in the map's fdinfo); the
    /// LRU hash preallocates every entry, so this is its size when full.
    pub memory_bytes: u64,
}

impl KeyMap {
    fn read(map: &MapData) -> Result<Self> {
        let path = format!("/proc/self/fdinfo/{}", map.fd().as_fd().as_raw_fd());
        let info = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        Ok(Self {
            capacity: field("max_entries:"),
            memory_bytes: field("memlock:"),
        })
    }
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RuleStats {
    pub id: u32,
    pub name: String,
    #[serde(flatten)]
    pub counters: RuleCounters,
}

impl CounterMaps<MapData> {
    /// Opens the maps a running limiter pinned under `pin_dir`.
    pub fn from_pins(pin_dir: &Path) -> Result<Self> {
        let open = |name: &str| {
            let path = pin_dir.join(name);
            MapData::from_pin(&path).with_context(|| {
                format!(
                    "no limiter state at {} (is `limiter run` running, as root?)",
                    path.display()
                )
            })
        };
        Ok(Self {
            rules: Array::try_from(Map::Array(open(map_name::RULES)?))?,
            rule_stats: PerCpuArray::try_from(Map::PerCpuArray(open(map_name::RULE_STATS)?))?,
            global: PerCpuArray::try_from(Map::PerCpuArray(open(map_name::GLOBAL_STATS)?))?,
            keys: open(map_name::KEYS)?,
        })
    }
}

impl<'a> CounterMaps<&'a MapData> {
    /// Borrows the maps of a loaded program.
    pub fn from_datapath(datapath: &'a crate::datapath::Datapath) -> Result<Self> {
        Ok(Self {
            rules: Array::try_from(datapath.map(map_name::RULES)?)?,
            rule_stats: PerCpuArray::try_from(datapath.map(map_name::RULE_STATS)?)?,
            global: PerCpuArray::try_from(datapath.map(map_name::GLOBAL_STATS)?)?,
            keys: match datapath.map(map_name::KEYS)? {
                Map::LruHashMap(data) => data,
                _ => anyhow::bail!("{} is not an LRU hash map", map_name::KEYS),
            },
        })
    }
}

impl<T: Borrow<MapData>> CounterMaps<T> {
    /// Sums every CPU's counters for the global counters and each named rule.
    pub fn read(&self) -> Result<Snapshot> {
        let mut snapshot = Snapshot {
            keys: KeyMap::read(self.keys.borrow())?,
            ..Snapshot::default()
        };
        for cpu in self.global.get(&0, 0)?.iter() {
            snapshot.global.add(cpu);
        }
        for id in 0..MAX_RULES {
            let rule = self.rules.get(&id, 0)?;
            if rule.name[0] == 0 {
                continue;
            }
            let mut counters = RuleCounters::default();
            for cpu in self.rule_stats.get(&id, 0)?.iter() {
                counters.add(cpu);
            }
            let len = rule
                .name
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(rule.name.len());
            snapshot.rules.push(RuleStats {
                id,
                name: String::from_utf8_lossy(&rule.name[..len]).into_owned(),
                counters,
            });
        }
        Ok(snapshot)
    }
}

impl Snapshot {
    pub fn rule(&self, name: &str) -> Option<&RuleCounters> {
        self.rules
            .iter()
            .find(|r| r.name == name)
            .map(|r| &r.counters)
    }
}
