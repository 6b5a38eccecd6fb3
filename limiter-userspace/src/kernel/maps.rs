//! One typed handle per map of the program, taken from a freshly loaded
//! object or opened from the pins of a running limiter, and the check of
//! pinned maps against the object's own definitions before they are
//! reused. This is the only code that opens a map: everything else reads
//! and writes these handles.

use std::path::Path;

use aya::{
    Ebpf,
    maps::{Array, LpmTrie, Map, MapData, MapError, MapInfo, PerCpuArray},
};
use aya_obj::{EbpfSectionKind, Object, maps::PinningType};
use limiter_common::{
    abi::{
        AggregateState, Block, Candidates, Costs, GlobalConfig, GlobalCounters, PrefixKey,
        RuleConfig, RuleCounters, map_name, v4_table,
    },
    gcra::Gcra,
    keytable::{WAYS, buckets_for},
};

use super::{KernelError, keys::KeyTable, mapped::Mapped};

/// Every map of the program (see `limiter-common`'s `abi` for the layouts).
pub struct Maps {
    /// Index 0: the settings every packet reads.
    pub config: Array<MapData, GlobalConfig>,
    /// Both generations of the rule table (`abi::rule_slot`).
    pub rules: Array<MapData, RuleConfig>,
    /// IPv4 source → candidate rules (`abi::v4_table`), mapped.
    pub v4_l16: Mapped<v4_table::Block>,
    pub v4_l24: Mapped<v4_table::Block>,
    pub v4_l32: Mapped<v4_table::Block>,
    pub v4_lists: Array<MapData, Candidates>,
    /// IPv6 source prefix (generation first) → candidate rules.
    pub lpm_v6: LpmTrie<MapData, PrefixKey<16>, Candidates>,
    /// The per-key state table, memory-mapped.
    pub keys: KeyTable,
    /// Per rule id: the state of its aggregate limit.
    pub aggregates: Array<MapData, AggregateState>,
    pub blocks_v4: LpmTrie<MapData, [u8; 4], Block>,
    /// A bit per IPv4 /16 that a block covers, mapped.
    pub blocked_v4: Mapped<u64>,
    pub blocks_v6: LpmTrie<MapData, [u8; 16], Block>,
    /// ifindex → counter slot (0: not registered), an array by ifindex.
    pub ifaces: Array<MapData, u32>,
    /// Per rule id: the TAT of its key-creation budget.
    pub admissions: Array<MapData, u64>,
    /// Per CPU, per (interface slot, rule id) (`abi::counter_slot`).
    pub rule_stats: PerCpuArray<MapData, RuleCounters>,
    pub global_stats: PerCpuArray<MapData, GlobalCounters>,
    /// Soft packet limits by rule slot, and the packets over them per
    /// (interface, rule) and CPU; absent from the pins of a build that
    /// had none.
    pub soft_limits: Option<Array<MapData, Gcra>>,
    pub soft_stats: Option<PerCpuArray<MapData, u64>>,
    /// `abi::orphan_fragments` (absent from pins of a build before it).
    pub orphan_fragments: Option<PerCpuArray<MapData, u64>>,
    /// Counter slot -> the interface's MTU (absent from pins of a build
    /// before it).
    pub iface_mtu: Option<Array<MapData, u32>>,
    /// Packet costs by class, by rule slot (absent from older pins).
    pub costs: Option<Array<MapData, Costs>>,
    /// The test build's clock (`--features test-clock`); absent otherwise.
    pub test_clock: Option<Array<MapData, u64>>,
}

/// The test build's clock map.
const TEST_CLOCK: &str = "CLOCK";

impl Maps {
    /// Takes every map out of a loaded object (the program keeps using
    /// them: it was relocated against their file descriptors).
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, KernelError> {
        let mut open = |name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| KernelError::BadObject(format!("it has no map {name}")))
        };
        let maps = Self::from_maps(&mut open)?;
        Ok(Self {
            test_clock: ebpf
                .take_map(TEST_CLOCK)
                .map(|m| typed(TEST_CLOCK, m))
                .transpose()?,
            ..maps
        })
    }

    /// Opens the maps a running limiter pinned under `pin_dir`.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, KernelError> {
        let mut open = |name: &str| {
            let data = pinned_data(pin_dir, name)?;
            Map::from_map_data(data).map_err(|source| KernelError::Map {
                name: name.to_owned(),
                source,
            })
        };
        Self::from_maps(&mut open)
    }

    fn from_maps(
        open: &mut dyn FnMut(&str) -> Result<Map, KernelError>,
    ) -> Result<Self, KernelError> {
        Ok(Self {
            config: handle(open, map_name::CONFIG)?,
            rules: handle(open, map_name::RULES)?,
            v4_l16: mapped(open, map_name::V4_L16)?,
            v4_l24: mapped(open, map_name::V4_L24)?,
            v4_l32: mapped(open, map_name::V4_L32)?,
            v4_lists: handle(open, map_name::V4_LISTS)?,
            lpm_v6: handle(open, map_name::LPM_V6)?,
            keys: KeyTable::new(
                open(map_name::KEY_TAGS)?,
                open(map_name::KEYS)?,
                open(map_name::KEY_FILTER)?,
            )
            .map(|table| table.with_pending(open(map_name::PENDING_DROPS).ok()))
            .map_err(|source| KernelError::Map {
                name: map_name::KEYS.to_owned(),
                source,
            })?,
            aggregates: handle(open, map_name::AGGREGATES)?,
            blocks_v4: handle(open, map_name::BLOCKS_V4)?,
            blocked_v4: mapped(open, map_name::BLOCKED_V4)?,
            blocks_v6: handle(open, map_name::BLOCKS_V6)?,
            ifaces: handle(open, map_name::IFACES)?,
            admissions: handle(open, map_name::ADMISSIONS)?,
            rule_stats: handle(open, map_name::RULE_STATS)?,
            global_stats: handle(open, map_name::GLOBAL_STATS)?,
            soft_limits: handle(open, map_name::SOFT_LIMITS).ok(),
            soft_stats: handle(open, map_name::SOFT_STATS).ok(),
            orphan_fragments: handle(open, map_name::ORPHAN_FRAGMENTS).ok(),
            iface_mtu: handle(open, map_name::IFACE_MTU).ok(),
            costs: handle(open, map_name::COSTS).ok(),
            test_clock: None,
        })
    }

    /// Registered interfaces: (ifindex, counter slot).
    pub fn iface_slots(&self) -> Result<Vec<(u32, u32)>, KernelError> {
        let slots: Vec<u32> = self
            .ifaces
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_error(map_name::IFACES))?;
        Ok((0..).zip(slots).filter(|&(_, slot)| slot != 0).collect())
    }
}

/// The named rules of `generation` in the rule table, by id (a slot with
/// no name holds no rule).
pub fn named_rules(
    rules: &Array<MapData, RuleConfig>,
    generation: u32,
) -> Result<Vec<(u32, RuleConfig)>, KernelError> {
    let mut out = Vec::new();
    for id in 0..limiter_common::abi::MAX_RULES {
        let rule = rules
            .get(&limiter_common::abi::rule_slot(generation, id), 0)
            .map_err(map_error(map_name::RULES))?;
        if rule.name[0] != 0 {
            out.push((id, rule));
        }
    }
    Ok(out)
}

/// Opens map `name`, a memory-mappable array, and maps it.
fn mapped<T>(
    open: &mut dyn FnMut(&str) -> Result<Map, KernelError>,
    name: &str,
) -> Result<Mapped<T>, KernelError> {
    Mapped::new(open(name)?).map_err(|source| KernelError::Map {
        name: name.to_owned(),
        source,
    })
}

/// Opens map `name` and gives it its type.
fn handle<T: TryFrom<Map, Error = MapError>>(
    open: &mut dyn FnMut(&str) -> Result<Map, KernelError>,
    name: &str,
) -> Result<T, KernelError> {
    typed(name, open(name)?)
}

fn typed<T: TryFrom<Map, Error = MapError>>(name: &str, map: Map) -> Result<T, KernelError> {
    T::try_from(map).map_err(|source| KernelError::Map {
        name: name.to_owned(),
        source,
    })
}

/// Refuses pins whose layout differs from the object's: a map pinned by an
/// incompatible build would be misread, and aya reuses pins unchecked. The
/// expected key size, value size and capacity come from the ELF itself.
pub(super) fn check_pinned(
    object: &[u8],
    pin_dir: &Path,
    max_keys: u32,
) -> Result<(), KernelError> {
    let parsed = Object::parse(object).map_err(|e| KernelError::BadObject(e.to_string()))?;
    for (name, map) in &parsed.maps {
        let data_section = matches!(
            map.section_kind(),
            EbpfSectionKind::Data | EbpfSectionKind::Rodata | EbpfSectionKind::Bss
        );
        let path = pin_dir.join(name);
        if data_section || map.pinning() != PinningType::ByName || !path.exists() {
            continue;
        }
        let pinned = MapInfo::from_pin(&path).map_err(|source| KernelError::Map {
            name: name.clone(),
            source,
        })?;
        let mismatch = |what: &str, pinned: u32, ours: u32| KernelError::IncompatiblePins {
            dir: pin_dir.to_owned(),
            detail: format!("{name}: {what} is {pinned}, this build uses {ours}"),
        };
        if pinned.key_size() != map.key_size() {
            return Err(mismatch("key size", pinned.key_size(), map.key_size()));
        }
        if pinned.value_size() != map.value_size() {
            return Err(mismatch(
                "value size",
                pinned.value_size(),
                map.value_size(),
            ));
        }
        if name == map_name::KEYS {
            // Sized at load time from the rule file's `max_keys`.
            if pinned.max_entries() != buckets_for(max_keys) * WAYS as u32 {
                tracing::warn!(
                    "{name} keeps its capacity of {} keys (asked for {max_keys}); `limiter detach` first to change it",
                    pinned.max_entries()
                );
            }
        } else if name == map_name::KEY_TAGS || name == map_name::KEY_FILTER {
            // Sized with KEYS.
        } else if pinned.max_entries() != map.max_entries() {
            return Err(mismatch(
                "capacity",
                pinned.max_entries(),
                map.max_entries(),
            ));
        }
    }
    Ok(())
}

/// Turns a map error into ours, naming the map.
/// The map pinned as `name` under `pin_dir`, opened once more.
pub(super) fn pinned_data(pin_dir: &Path, name: &str) -> Result<MapData, KernelError> {
    let path = pin_dir.join(name);
    MapData::from_pin(&path).map_err(|e| match e {
        MapError::PinError { .. } if !path.exists() => KernelError::NotRunning {
            dir: pin_dir.to_owned(),
        },
        source => KernelError::Map {
            name: name.to_owned(),
            source,
        },
    })
}

pub(super) fn map_error(name: &'static str) -> impl FnOnce(MapError) -> KernelError {
    move |source| KernelError::Map {
        name: name.to_owned(),
        source,
    }
}
