//! Reading the program's counters, from a loaded program or from the maps a
//! running limiter pinned.

use std::{
    borrow::Borrow,
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use limiter_common::abi::{
    GlobalConfig, GlobalCounters, MAX_RULES, RuleConfig, RuleCounters, counter_slot, global_flag,
    map_name, rule_slot,
};
use serde::{Deserialize, Serialize};

use crate::datapath::{Datapath, open_pinned};

/// The maps a reader needs.
pub struct CounterMaps<T> {
    config: Array<T, GlobalConfig>,
    rules: Array<T, RuleConfig>,
    rule_stats: PerCpuArray<T, RuleCounters>,
    global: PerCpuArray<T, GlobalCounters>,
    ifaces: HashMap<T, u32, u32>,
    keys: T,
}

/// Counters summed over CPUs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    /// The active generation of the rule tables.
    pub generation: u32,
    /// Whether global dry-run is on.
    pub shadow: bool,
    pub global: GlobalCounters,
    /// Every rule of the active generation, summed over interfaces.
    pub rules: Vec<RuleStats>,
    /// The same per registered interface (slot 0: any other, e.g. test runs).
    pub interfaces: Vec<InterfaceStats>,
    pub keys: KeyMap,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RuleStats {
    pub id: u32,
    pub name: String,
    #[serde(flatten)]
    pub counters: RuleCounters,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct InterfaceStats {
    pub ifindex: u32,
    pub name: String,
    pub rules: Vec<RuleStats>,
}

/// The per-key state map, as the kernel accounts for it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
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

impl CounterMaps<MapData> {
    /// Opens the maps a running limiter pinned under `pin_dir`.
    pub fn from_pins(pin_dir: &Path) -> Result<Self> {
        let open = |name: &str| {
            open_pinned(pin_dir, name).with_context(|| {
                format!(
                    "no limiter state at {} (is a limiter running? `limiter stats` needs root)",
                    pin_dir.join(name).display()
                )
            })
        };
        Ok(Self {
            config: Array::try_from(Map::Array(open(map_name::CONFIG)?))?,
            rules: Array::try_from(Map::Array(open(map_name::RULES)?))?,
            rule_stats: PerCpuArray::try_from(Map::PerCpuArray(open(map_name::RULE_STATS)?))?,
            global: PerCpuArray::try_from(Map::PerCpuArray(open(map_name::GLOBAL_STATS)?))?,
            ifaces: HashMap::try_from(Map::HashMap(open(map_name::IFACES)?))?,
            keys: open(map_name::KEYS)?,
        })
    }
}

impl<'a> CounterMaps<&'a MapData> {
    /// Borrows the maps of a loaded program.
    pub fn from_datapath(datapath: &'a Datapath) -> Result<Self> {
        Ok(Self {
            config: Array::try_from(datapath.map(map_name::CONFIG)?)?,
            rules: Array::try_from(datapath.map(map_name::RULES)?)?,
            rule_stats: PerCpuArray::try_from(datapath.map(map_name::RULE_STATS)?)?,
            global: PerCpuArray::try_from(datapath.map(map_name::GLOBAL_STATS)?)?,
            ifaces: HashMap::try_from(datapath.map(map_name::IFACES)?)?,
            keys: match datapath.map(map_name::KEYS)? {
                Map::LruHashMap(data) => data,
                _ => anyhow::bail!("{} is not an LRU hash map", map_name::KEYS),
            },
        })
    }
}

impl<T: Borrow<MapData>> CounterMaps<T> {
    /// Sums every CPU's counters, per rule and interface.
    pub fn read(&self) -> Result<Snapshot> {
        let config = self.config.get(&0, 0)?;
        let mut snapshot = Snapshot {
            generation: config.generation,
            shadow: config.flags & global_flag::SHADOW != 0,
            keys: KeyMap::read(self.keys.borrow())?,
            ..Snapshot::default()
        };
        for cpu in self.global.get(&0, 0)?.iter() {
            snapshot.global.add(cpu);
        }
        let mut names = Vec::new();
        for id in 0..MAX_RULES {
            let rule = self.rules.get(&rule_slot(config.generation, id), 0)?;
            if rule.name[0] != 0 {
                names.push((id, String::from_utf8_lossy(rule.name()).into_owned()));
            }
        }
        let mut slots: Vec<(u32, u32)> = self.ifaces.iter().collect::<Result<_, _>>()?;
        slots.push((0, 0));
        slots.sort_by_key(|&(_, slot)| slot);
        snapshot.rules = names
            .iter()
            .map(|(id, name)| RuleStats {
                id: *id,
                name: name.clone(),
                counters: RuleCounters::default(),
            })
            .collect();
        for (ifindex, slot) in slots {
            let mut rules = Vec::with_capacity(names.len());
            for (i, (id, name)) in names.iter().enumerate() {
                let mut counters = RuleCounters::default();
                for cpu in self.rule_stats.get(&counter_slot(slot, *id), 0)?.iter() {
                    counters.add(cpu);
                }
                snapshot.rules[i].counters.add(&counters);
                rules.push(RuleStats {
                    id: *id,
                    name: name.clone(),
                    counters,
                });
            }
            snapshot.interfaces.push(InterfaceStats {
                ifindex,
                name: iface_name(ifindex),
                rules,
            });
        }
        Ok(snapshot)
    }
}

/// The interface's name in our network namespace, or `if<N>`; `other` for slot 0.
fn iface_name(ifindex: u32) -> String {
    if ifindex == 0 {
        return "other".into();
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf holds IF_NAMESIZE bytes as required.
    let name = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if name.is_null() {
        return format!("if{ifindex}");
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into buf.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

impl Snapshot {
    pub fn rule(&self, name: &str) -> Option<&RuleCounters> {
        self.rules
            .iter()
            .find(|r| r.name == name)
            .map(|r| &r.counters)
    }
}
