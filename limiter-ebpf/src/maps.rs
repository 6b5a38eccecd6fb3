//! The program's maps. All are pinned by name under the directory the
//! loader names, so a restarted daemon finds the same state, and a new
//! program replacing this one on its link shares it.

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    macros::map,
    maps::{Array, LpmTrie, LruHashMap, PerCpuArray, ProgramArray, RingBuf},
};
use limiter_common::{
    abi::{
        AggregateState, BLOCKED_V4_WORDS, Block, Candidates, Costs, DEFAULT_MAX_KEYS,
        FirstFragment, FragmentKey, GENERATIONS, GlobalConfig, GlobalCounters, Handoff, MAX_BLOCKS,
        MAX_FRAGMENTED_DATAGRAMS, MAX_IFACES, MAX_IFINDEX, MAX_PREFIXES, MAX_RULES, PendingDrops,
        PrefixKey, RuleConfig, RuleCounters, orphan_fragments, v4_table,
    },
    gcra::Gcra,
    keytable::{Slot, Tags, WAYS, buckets_for, filter_words},
    meter::order,
    trace::{TraceConfig, TraceEvent},
    window::WindowState,
};

/// Settings for every packet (index 0), including the active generation.
#[map]
pub static CONFIG: Array<GlobalConfig> = Array::pinned(1, 0);

/// Rules by `rule_slot(generation, id)`; id 0 is the default.
#[map]
pub static RULES: Array<RuleConfig> = Array::pinned(GENERATIONS * MAX_RULES, 0);

/// IPv4 source -> the rules that may apply to it, in direct-indexed
/// arrays (`abi::v4_table`), written by userspace through a mapping.
#[map]
pub static V4_L16: Array<v4_table::Block> =
    Array::pinned(GENERATIONS * v4_table::L16_BLOCKS, BPF_F_MMAPABLE);
#[map]
pub static V4_L24: Array<v4_table::Block> =
    Array::pinned(GENERATIONS * v4_table::SUBTABLES, BPF_F_MMAPABLE);
#[map]
pub static V4_L32: Array<v4_table::Block> =
    Array::pinned(GENERATIONS * v4_table::SUBTABLES, BPF_F_MMAPABLE);
#[map]
pub static V4_LISTS: Array<Candidates> = Array::pinned(GENERATIONS * v4_table::LISTS, 0);

/// (generation, IPv6 source prefix) -> the rules that may apply to it.
#[map]
pub static LPM_V6: LpmTrie<PrefixKey<16>, Candidates> = LpmTrie::pinned(MAX_PREFIXES, 0);

/// Per-key state: the key table (`limiter_common::keytable`), tags by
/// bucket and slots by `slot_index`, sized at load from `max_keys`.
/// Memory-mappable, so userspace reads them and frees slots tag by tag,
/// never rewriting state the kernel is updating.
#[map]
pub static KEY_TAGS: Array<Tags> = Array::pinned(buckets_for(DEFAULT_MAX_KEYS), BPF_F_MMAPABLE);
#[map]
pub static KEYS: Array<Slot> =
    Array::pinned(buckets_for(DEFAULT_MAX_KEYS) * WAYS as u32, BPF_F_MMAPABLE);

/// The key table's presence filter (`keytable::filter_words`): two
/// halves of that many words, sized with the table at load; memory-mappable,
/// so userspace rebuilds a half in place.
#[map]
pub static KEY_FILTER: Array<u64> = Array::pinned(
    2 * filter_words(buckets_for(DEFAULT_MAX_KEYS)),
    BPF_F_MMAPABLE,
);

/// Per-rule aggregate GCRA state, by rule id (hierarchical limits).
#[map]
pub static AGGREGATES: Array<AggregateState> = Array::pinned(MAX_RULES, 0);

/// Which IPv4 /16s a block covers, in part or whole (a bit each; see
/// `abi::BLOCKED_V4_WORDS`), written by userspace through a mapping.
#[map]
pub static BLOCKED_V4: Array<u64> = Array::pinned(BLOCKED_V4_WORDS, BPF_F_MMAPABLE);

/// Manual blocks by source prefix.
#[map]
pub static BLOCKS_V4: LpmTrie<[u8; 4], Block> = LpmTrie::pinned(MAX_BLOCKS, 0);
#[map]
pub static BLOCKS_V6: LpmTrie<[u8; 16], Block> = LpmTrie::pinned(MAX_BLOCKS, 0);

/// Interface index -> counter slot (1..MAX_IFACES; 0: not registered),
/// written at attach.
#[map]
pub static IFACES: Array<u32> = Array::pinned(MAX_IFINDEX, 0);

/// Counter slot -> the interface's MTU (0: unknown), so a buffer longer
/// than any of its frames (skb mode: GSO, GRO) is charged the frames it
/// carries (`limiter_common::segments`).
#[map]
pub static IFACE_MTU: Array<u32> = Array::pinned(MAX_IFACES, 0);

/// Source and fragmented datagram -> what became of its first fragment
/// (`crate::fragments`).
#[map]
pub static FRAGMENTS: LruHashMap<FragmentKey, FirstFragment> =
    LruHashMap::pinned(MAX_FRAGMENTED_DATAGRAMS, 0);

/// Per rule: the TAT of its key-creation budget (`RuleConfig::admission`).
#[map]
pub static ADMISSIONS: Array<u64> = Array::pinned(MAX_RULES, 0);

/// Per interface slot and rule: `counter_slot(iface, id)`.
#[map]
pub static RULE_STATS: PerCpuArray<RuleCounters> = PerCpuArray::pinned(MAX_IFACES * MAX_RULES, 0);

#[map]
pub static GLOBAL_STATS: PerCpuArray<GlobalCounters> = PerCpuArray::pinned(1, 0);

/// Per CPU: the refusals of the key this CPU refuses most, not yet on its
/// slot (`PendingDrops`). Pinned: a restarted daemon's program carries
/// them on, and readers find them.
#[map]
pub static PENDING_DROPS: PerCpuArray<PendingDrops> = PerCpuArray::pinned(1, 0);

/// Later fragments whose first fragment was not seen, per CPU
/// (`abi::orphan_fragments`): charged to the strictest rule, or dropped.
#[map]
pub static ORPHAN_FRAGMENTS: PerCpuArray<u64> = PerCpuArray::pinned(orphan_fragments::ENTRIES, 0);

/// Test builds only: the clock, set by the test before each run.
#[cfg(feature = "test-clock")]
#[map]
pub static CLOCK: Array<u64> = Array::pinned(1, 0);

/// Scratch for a window rule's meters (the key's two, unpacked from their
/// packed words, and the aggregate's), copied in while their locks are
/// held (`meter_windows`): per CPU, and XDP runs
/// to the end on its CPU, so no other packet sees it meanwhile. A map
/// value rather than the stack, which the program has all but used up.
#[map]
pub static WINDOW_SCRATCH: PerCpuArray<[WindowState; order::METERS]> =
    PerCpuArray::with_max_entries(1, 0);

/// Soft packet limits by `rule_slot(generation, id)`, for rules with
/// `rule_flag::SOFT`: kept apart from `RULES` so its layout, and the
/// state pinned by earlier builds, stay as they were.
#[map]
pub static SOFT_LIMITS: Array<Gcra> = Array::pinned(GENERATIONS * MAX_RULES, 0);

/// Per interface slot and rule (`counter_slot`), per CPU: packets passed
/// over the rule's soft limit.
#[map]
pub static SOFT_STATS: PerCpuArray<u64> = PerCpuArray::pinned(MAX_IFACES * MAX_RULES, 0);

/// Packet costs by class (`rule_flag::COSTS`), by `rule_slot`.
#[map]
pub static COSTS: Array<Costs> = Array::pinned(GENERATIONS * MAX_RULES, 0);

/// What `limiter trace` asks for (`trace::TraceConfig`); `on` is 0 while
/// nobody traces, and then nothing else is read.
#[map]
pub static TRACE: Array<TraceConfig> = Array::pinned(1, 0);

/// The decisions traced, for the tracer to read.
#[map]
pub static TRACE_EVENTS: RingBuf = RingBuf::pinned(1 << 20, 0);

/// Per CPU: decisions traced, and those lost to a full ring.
#[map]
pub static TRACE_COUNTS: PerCpuArray<[u64; 2]> = PerCpuArray::pinned(1, 0);

/// Index 0: the trace program (`limiter_trace`), which the limiter tail
/// calls while someone traces. Filled by the loader of this object;
/// pinned, so the entry outlives the process that loaded it (a program
/// array is emptied when no process or pin holds it any more).
#[map]
pub static TRACE_PROG: ProgramArray = ProgramArray::pinned(1, 0);

/// The decision handed to the trace program, per CPU (XDP runs to the end
/// on its CPU, tail call included).
#[map]
pub static TRACE_SCRATCH: PerCpuArray<TraceEvent> = PerCpuArray::with_max_entries(1, 0);

/// Index 0: the decision program (`limiter_decide`), which the entry
/// program tail calls with every packet it matched. Pinned, as
/// `TRACE_PROG` (see there), and so that a restarted daemon's new
/// decision program serves the entry program still attached until the
/// link is switched (`abi::Handoff` is their ABI).
#[map]
pub static STAGES: ProgramArray = ProgramArray::pinned(1, 0);

/// The packet handed from the entry program to the decision program, per
/// CPU (`abi::Handoff`); pinned for the reason `STAGES` is.
#[map]
pub static HANDOFF: PerCpuArray<Handoff> = PerCpuArray::pinned(1, 0);

/// The report program (`report::limiter_report`), which the decision
/// program tail calls on a rare event. Not pinned: each build's decision
/// program reports through its own.
#[map]
pub static REPORT_PROG: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// The decision handed to the report program (`Decision::packed`), per CPU.
#[map]
pub static REPORT_SCRATCH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// When each rare event was last reported on this CPU, and how often since.
#[map]
pub static REPORT_STATE: PerCpuArray<crate::report::ReportState> =
    PerCpuArray::with_max_entries(1, 0);
