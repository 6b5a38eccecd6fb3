//! `limiter stats` (the `stats` request): the program's counters summed
//! over CPUs, per rule and interface, as the kernel module reads them.

use limiter_common::abi::{GlobalCounters, RuleCounters};
use serde::{Deserialize, Serialize};

/// Counters summed over CPUs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    /// The active generation of the rule tables.
    pub generation: u32,
    /// Whether global dry-run is on.
    pub shadow: bool,
    pub global: GlobalCounters,
    /// Later fragments whose first fragment was not seen (the rule file's
    /// `fragments`).
    #[serde(default)]
    pub orphan_fragments: OrphanFragments,
    /// Every rule of the active generation, summed over interfaces.
    pub rules: Vec<RuleStats>,
    /// The same per registered interface (slot 0: any other, e.g. test runs).
    pub interfaces: Vec<InterfaceStats>,
    pub keys: KeyMapSize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RuleStats {
    pub id: u32,
    pub name: String,
    #[serde(flatten)]
    pub counters: RuleCounters,
    /// Packets passed over the rule's soft limit (`soft` in the rule file).
    #[serde(default)]
    pub over_soft: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct InterfaceStats {
    pub ifindex: u32,
    pub name: String,
    /// How the program is attached here, as the kernel says (`None`: not
    /// attached, or not an interface of this network namespace). Skb mode
    /// is what `auto` falls back to where native XDP fails.
    #[serde(default)]
    pub xdp_mode: Option<super::Mode>,
    pub rules: Vec<RuleStats>,
}

/// Later fragments whose first fragment was not seen, summed over CPUs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OrphanFragments {
    /// Charged to the strictest rule they may belong to.
    pub charged: u64,
    /// Dropped (`fragments: drop`).
    pub dropped: u64,
}

/// The per-key state map, as the kernel accounts for it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyMapSize {
    /// Slots: the most keys it holds (see `limiter_common::keytable`).
    pub capacity: u64,
    /// Kernel memory charged for it (`memlock` in the fdinfo of its three
    /// maps, tags, slots and filter): the whole table, allocated when it is created.
    pub memory_bytes: u64,
}

impl Snapshot {
    pub fn rule(&self, name: &str) -> Option<&RuleCounters> {
        self.rules
            .iter()
            .find(|r| r.name == name)
            .map(|r| &r.counters)
    }
}
