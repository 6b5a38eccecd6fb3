//! The program's maps. Userspace sizes `KEYS` at load time and pins them all.

use aya_ebpf::{
    macros::map,
    maps::{Array, LpmTrie, LruHashMap, PerCpuArray},
};
use limiter_common::abi::{
    Candidates, DEFAULT_MAX_KEYS, FlowKey, GlobalConfig, GlobalCounters, KeyState, MAX_RULES,
    RuleConfig, RuleCounters,
};

/// Settings for every packet (index 0).
#[map]
pub static CONFIG: Array<GlobalConfig> = Array::with_max_entries(1, 0);

/// Rules by id; id 0 is the default for traffic no rule matches.
#[map]
pub static RULES: Array<RuleConfig> = Array::with_max_entries(MAX_RULES, 0);

/// Source prefix -> the rules that may apply to it.
#[map]
pub static LPM_V4: LpmTrie<[u8; 4], Candidates> = LpmTrie::with_max_entries(MAX_RULES, 0);
#[map]
pub static LPM_V6: LpmTrie<[u8; 16], Candidates> = LpmTrie::with_max_entries(MAX_RULES, 0);

/// Per-key GCRA state. LRU: under a flood of spoofed sources the least
/// recently seen keys are evicted rather than new ones refused.
#[map]
pub static KEYS: LruHashMap<FlowKey, KeyState> = LruHashMap::with_max_entries(DEFAULT_MAX_KEYS, 0);

#[map]
pub static RULE_STATS: PerCpuArray<RuleCounters> = PerCpuArray::with_max_entries(MAX_RULES, 0);

#[map]
pub static GLOBAL_STATS: PerCpuArray<GlobalCounters> = PerCpuArray::with_max_entries(1, 0);

/// Test builds only: the clock, set by the test before each run.
#[cfg(feature = "test-clock")]
#[map]
pub static CLOCK: Array<u64> = Array::with_max_entries(1, 0);
