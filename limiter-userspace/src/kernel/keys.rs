//! The key table (`limiter_common::keytable`) from userspace, through a
//! shared memory mapping of its array map: reading every key costs no
//! system call and no copy of the whole map, and forgetting a rule's keys
//! frees their slots one tag at a time (a compare-and-swap on the word the
//! kernel claims slots with), never rewriting a bucket the kernel is
//! updating. The table's presence filter is rebuilt here too (see
//! [`KeyTable::rebuild_filter`]).

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    sync::atomic::{AtomicU32, AtomicU64, Ordering, fence},
};

use aya::maps::{Map, MapData, MapError, PerCpuArray};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use limiter_common::{
    abi::{FlowKey, KeyState, PendingDrops, RuleConfig},
    gcra::Gcra,
    keytable::{self, Slot, Tags, WAYS, filter_words, slot_index, tag},
    meter::{self, CarriedTat},
};

use super::mapped::Mapped;

/// The mapped table.
pub struct KeyTable {
    tags: Mapped<Tags>,
    slots: Mapped<Slot>,
    /// Both halves of the presence filter, one after the other.
    filter: Mapped<u64>,
    /// Each CPU's refusals not yet on their key's slot (`PENDING_DROPS`;
    /// absent from pins of builds before it).
    pending: Option<PerCpuArray<MapData, PendingDrops>>,
}

/// How many times [`KeyTable::visit`] reads the keys held in
/// `PENDING_DROPS` when entries changed while it read. (An entry changes
/// hands at most once in 65 refusals on its CPU, and a reading takes
/// microseconds.)
const PENDING_READS: usize = 8;

/// The refusals `entries` hold for `key`, as their key's or as their
/// former key's.
fn held_for(entries: &[PendingDrops], key: &FlowKey) -> Option<u32> {
    let mut counts = entries.iter().flat_map(|e| {
        [(e.key, e.count), (e.old_key, e.old_count)]
            .into_iter()
            .filter(|&(k, n)| n != 0 && k == *key)
            .map(|(_, n)| n)
    });
    let first = counts.next()?;
    Some(counts.fold(first, u32::wrapping_add))
}

impl KeyTable {
    /// The table of the maps `KEY_TAGS`, `KEYS` and `KEY_FILTER`.
    pub fn new(tags: Map, slots: Map, filter: Map) -> Result<Self, MapError> {
        let table = Self {
            tags: Mapped::new(tags)?,
            slots: Mapped::new(slots)?,
            filter: Mapped::new(filter)?,
            pending: None,
        };
        let sized = |size: usize, expected: usize| {
            if size == expected {
                Ok(())
            } else {
                // Maps of different tables: pins of two loads mixed.
                Err(MapError::InvalidValueSize { size, expected })
            }
        };
        sized(table.slots.len(), table.tags.len() * WAYS)?;
        sized(table.filter.len(), 2 * table.filter_words())?;
        Ok(table)
    }

    /// The table with `PENDING_DROPS`, whose counts its readers add (a
    /// map of another layout is left out, as pins of a build before it
    /// have none).
    pub fn with_pending(self, pending: Option<Map>) -> Self {
        Self {
            pending: pending.and_then(|map| PerCpuArray::try_from(map).ok()),
            ..self
        }
    }

    /// Every CPU's `PENDING_DROPS` entry.
    fn pending_drops(&self) -> Option<Vec<PendingDrops>> {
        let values = self.pending.as_ref()?.get(&0, 0).ok()?;
        Some(values.iter().copied().collect())
    }

    /// The table's maps, tags, slots and filter (for their kernel
    /// accounting).
    pub fn maps(&self) -> [&MapData; 3] {
        [self.tags.map(), self.slots.map(), self.filter.map()]
    }

    /// Words in each half of the filter.
    fn filter_words(&self) -> usize {
        filter_words(self.buckets()) as usize
    }

    fn filter_word(&self, index: usize) -> &AtomicU64 {
        // SAFETY: an aligned u64 of the mapping, which the kernel also
        // changes atomically.
        unsafe { AtomicU64::from_ptr(self.filter.at(index)) }
    }

    /// How many bits of filter half `half` are set, and how many it has.
    pub fn filter_fill(&self, half: u32) -> (u64, u64) {
        let words = self.filter_words();
        let start = if half != 0 { words } else { 0 };
        let set = (start..start + words)
            .map(|i| u64::from(self.filter_word(i).load(Ordering::Relaxed).count_ones()))
            .sum();
        (set, words as u64 * 64)
    }

    /// Rebuilds the filter half the kernel does not read (the one that is
    /// not `active`) from the keys the table holds, hashed with `seed`,
    /// and returns it: the caller then makes it the active half.
    ///
    /// Sound while the kernel stores keys: it sets a new key's bit in both
    /// halves after publishing the key's tag. Clearing comes first, then a
    /// full fence, then the scan; so a key this scan missed (its tag not yet
    /// published when read) sets its own bit after the clearing.
    pub fn rebuild_filter(&self, seed: u64, active: u32) -> u32 {
        let rebuilt = u32::from(active == 0);
        let words = self.filter_words();
        let start = if rebuilt != 0 { words } else { 0 };
        for i in start..start + words {
            self.filter_word(i).store(0, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        let words = words as u32;
        // A slot being claimed too: a claim that gives up restores the old
        // key's tag without setting its bit, and the old key is still in
        // the slot until a claim succeeds (if it did, this bit is merely
        // one too many).
        let held_or_claimed = |seen: u32| seen & tag::KEY != 0 || seen == tag::CLAIMED;
        self.for_each_tagged(held_or_claimed, |bucket, way, _| {
            let hash = keytable::hash(&self.slot(bucket, way).key, seed);
            let (word, bit) = keytable::filter_bit(hash, words);
            self.filter_word(start + word as usize)
                .fetch_or(bit, Ordering::Relaxed);
        });
        fence(Ordering::SeqCst);
        rebuilt
    }

    /// Buckets in the table.
    pub fn buckets(&self) -> u32 {
        self.tags.len() as u32
    }

    /// Slots in the table: the most keys it can hold.
    pub fn capacity(&self) -> u64 {
        self.slots.len() as u64
    }

    fn tag(&self, bucket: usize, way: usize) -> &AtomicU32 {
        // SAFETY: an aligned u32 of the mapping, which the kernel also
        // accesses atomically.
        unsafe { AtomicU32::from_ptr(&raw mut (*self.tags.at(bucket))[way]) }
    }

    /// A copy of a slot (the kernel may be changing it: a torn state only
    /// skews one reading of `limiter top`).
    fn slot(&self, bucket: usize, way: usize) -> Slot {
        self.slots.get(slot_index(bucket as u32, way) as usize)
    }

    /// Calls `f` with each slot holding a key, and its tag.
    fn for_each_key(&self, f: impl FnMut(usize, usize, u32)) {
        self.for_each_tagged(|seen| seen & tag::KEY != 0, f);
    }

    /// Calls `f` with each slot whose tag `wanted` accepts, and its tag.
    fn for_each_tagged(&self, wanted: impl Fn(u32) -> bool, mut f: impl FnMut(usize, usize, u32)) {
        for bucket in 0..self.tags.len() {
            for way in 0..WAYS {
                let seen = self.tag(bucket, way).load(Ordering::Acquire);
                if wanted(seen) {
                    f(bucket, way, seen);
                }
            }
        }
    }

    /// Keys held, and how many of them sit in their preferred way
    /// (`keytable::preferred_way`: found one cache miss deep, not two).
    pub fn in_preferred_way(&self) -> (usize, usize) {
        let (mut held, mut preferred) = (0, 0);
        self.for_each_key(|_, way, seen| {
            held += 1;
            preferred += usize::from(way == keytable::preferred_way(seen));
        });
        (held, preferred)
    }

    /// Every key and its state.
    pub fn dump(&self) -> Vec<(FlowKey, KeyState)> {
        let mut out = Vec::new();
        self.visit(|key, state| out.push((*key, *state)));
        out
    }

    /// Calls `f` with every key and a copy of its state, without
    /// collecting them. A key's refusals include those the CPUs still hold
    /// for it in `PENDING_DROPS` (see `PendingDrops`): the keys held there
    /// are read last, their slots and the entries between two readings of
    /// the entries' `flushes` with no change of hands or move to a slot in
    /// between (read again until so, a few times), so that no count is
    /// seen both on an entry and on a slot. A key that takes an entry
    /// while the slots are read is given without its new count, which the
    /// next reading has.
    pub fn visit(&self, mut f: impl FnMut(&FlowKey, &KeyState)) {
        let Some(entries) = self.pending_drops() else {
            self.for_each_key(|bucket, way, _| {
                let slot = self.slot(bucket, way);
                f(&slot.key, &slot.state);
            });
            return;
        };
        let mut deferred = Vec::new();
        self.for_each_key(|bucket, way, _| {
            let slot = self.slot(bucket, way);
            if held_for(&entries, &slot.key).is_some() {
                deferred.push((bucket, way));
            } else {
                f(&slot.key, &slot.state);
            }
        });
        for read in 1..=PENDING_READS {
            let Some(first) = self.pending_drops() else {
                break;
            };
            let Some(entries) = self.pending_drops() else {
                break;
            };
            fence(Ordering::SeqCst);
            let slots: Vec<Slot> = deferred.iter().map(|&(b, w)| self.slot(b, w)).collect();
            fence(Ordering::SeqCst);
            let Some(last) = self.pending_drops() else {
                break;
            };
            let settled = first
                .iter()
                .zip(&last)
                .all(|(a, b)| a.flushes == b.flushes && a.flushes % 2 == 0);
            if settled || read == PENDING_READS {
                for mut slot in slots {
                    let held = held_for(&entries, &slot.key).unwrap_or(0);
                    slot.state.dropped_packets = slot.state.dropped_packets.wrapping_add(held);
                    f(&slot.key, &slot.state);
                }
                return;
            }
        }
        // `PENDING_DROPS` could not be read again: the slots alone.
        for (bucket, way) in deferred {
            let slot = self.slot(bucket, way);
            f(&slot.key, &slot.state);
        }
    }

    /// Holds keys (escalation's `scope: key`): each meter given a TAT is
    /// moved to it, or kept if already later (an atomic maximum, as the
    /// kernel swaps the same words); a key the table no longer holds is
    /// left out. How many keys it held.
    pub fn hold(&self, holds: &[(FlowKey, [Option<u64>; 2])]) -> usize {
        let mut n = 0;
        self.for_each_key(|bucket, way, _| {
            let key = self.slot(bucket, way).key;
            if let Some((_, tats)) = holds.iter().find(|(k, _)| *k == key) {
                let index = slot_index(bucket as u32, way) as usize;
                for (meter, tat) in tats.iter().enumerate() {
                    if let Some(tat) = tat {
                        self.meter_word(index, meter)
                            .fetch_max(*tat, Ordering::AcqRel);
                    }
                }
                n += 1;
            }
        });
        n
    }

    /// The addresses a key stands for, as a prefix: its address, masked
    /// by its rule (`rule`'s key masks; a whole address without one).
    pub fn prefix_of(key: &FlowKey, rule: Option<&RuleConfig>) -> IpNet {
        let ones = |mask: &[u8]| mask.iter().map(|b| b.count_ones()).sum::<u32>() as u8;
        if key.is_v4() {
            let a = Ipv4Addr::new(key.addr[12], key.addr[13], key.addr[14], key.addr[15]);
            let bits = rule.map_or(32, |r| ones(&r.v4_key_mask));
            IpNet::V4(Ipv4Net::new(a, bits).expect("at most 32 bits").trunc())
        } else {
            let a = Ipv6Addr::from(key.addr);
            let bits = rule.map_or(128, |r| ones(&r.v6_key_mask));
            IpNet::V6(Ipv6Net::new(a, bits).expect("at most 128 bits").trunc())
        }
    }

    /// How many keys the table holds.
    pub fn count(&self) -> usize {
        let mut n = 0;
        self.for_each_key(|_, _, _| n += 1);
        n
    }

    /// Frees the slots of every key of the given rule ids; returns how
    /// many. A slot the kernel re-claimed meanwhile is left to its new key.
    pub fn forget(&self, ids: &[u32]) -> usize {
        self.forget_each(ids, || {})
    }

    /// [`KeyTable::forget`], calling `freed` after each key it frees.
    pub fn forget_each(&self, ids: &[u32], freed: impl Fn()) -> usize {
        let mut n = 0;
        self.for_each_key(|bucket, way, seen| {
            if ids.contains(&self.slot(bucket, way).key.rule_id())
                && self
                    .tag(bucket, way)
                    .compare_exchange(seen, tag::FREE, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                n += 1;
                freed();
            }
        });
        n
    }

    /// Carries the GCRA state of rule `id`'s keys over to new limits,
    /// before they are in force: `meters[m]` (0 packets, 1 bytes, 2 the
    /// third word's limit) is the
    /// (old, new) meter of each TAT to carry ([`meter::carry`], at `now()`
    /// read per key: a large table takes a while). Returns what
    /// [`KeyTable::take_back`] needs once the new limits are in force. A
    /// compare-and-swap on the word the kernel charges with, so no charge
    /// is lost; a slot claimed by another key meanwhile is not recorded.
    pub fn carry(
        &self,
        id: u32,
        meters: &[Option<(&Gcra, &Gcra)>; 3],
        now: impl Fn() -> u64,
    ) -> Vec<Carried> {
        let mut out = Vec::new();
        self.for_each_key(|bucket, way, seen| {
            let key = self.slot(bucket, way).key;
            if key.rule_id() != id {
                return;
            }
            let index = slot_index(bucket as u32, way) as usize;
            let at = now();
            let tats = std::array::from_fn(|m| {
                meters[m].map_or(CarriedTat::default(), |(from, to)| {
                    meter::carry(self.meter_word(index, m), from, to, at)
                })
            });
            // Still the key whose TATs were read (else those were another
            // key's, only made later: nothing to take back from them).
            if self.tag(bucket, way).load(Ordering::Acquire) == seen
                && self.slot(bucket, way).key == key
            {
                out.push(Carried {
                    index,
                    tag: seen,
                    key,
                    tats,
                });
            }
        });
        out
    }

    /// Takes back what [`KeyTable::carry`] added beyond the carried values
    /// (`meter::take_back`, at `now()`), from keys still in their slots.
    pub fn take_back(&self, carried: &[Carried], now: impl Fn() -> u64) {
        for c in carried {
            let (bucket, way) = (c.index / WAYS, c.index % WAYS);
            if self.tag(bucket, way).load(Ordering::Acquire) != c.tag
                || self.slots.get(c.index).key != c.key
            {
                continue;
            }
            let at = now();
            for (m, tat) in c.tats.iter().enumerate() {
                meter::take_back(self.meter_word(c.index, m), *tat, at);
            }
        }
    }

    fn meter_word(&self, index: usize, meter: usize) -> &AtomicU64 {
        // SAFETY: an aligned u64 of the mapping, which the kernel changes
        // with compare-and-swap too.
        unsafe { AtomicU64::from_ptr(&raw mut (*self.slots.at(index)).state.meters[meter]) }
    }
}

/// A key whose state [`KeyTable::carry`] carried.
pub struct Carried {
    index: usize,
    tag: u32,
    key: FlowKey,
    /// Per meter (packets, bytes, third word).
    tats: [CarriedTat; 3],
}
