//! The key table (`limiter_common::keytable`) from userspace, through a
//! shared memory mapping of its array map: reading every key costs no
//! system call and no copy of the whole map, and forgetting a rule's keys
//! frees their slots one tag at a time (a compare-and-swap on the word the
//! kernel claims slots with), never rewriting a bucket the kernel is
//! updating.

use std::sync::atomic::{AtomicU32, Ordering};

use aya::maps::{Map, MapData, MapError};
use limiter_common::{
    abi::{FlowKey, KeyState},
    keytable::{Slot, Tags, WAYS, slot_index, tag},
};

use super::mapped::Mapped;

/// The mapped table.
pub struct KeyTable {
    tags: Mapped<Tags>,
    slots: Mapped<Slot>,
}

impl KeyTable {
    /// The table of the maps `KEY_TAGS` and `KEYS`.
    pub fn new(tags: Map, slots: Map) -> Result<Self, MapError> {
        let table = Self {
            tags: Mapped::new(tags)?,
            slots: Mapped::new(slots)?,
        };
        if table.slots.len() != table.tags.len() * WAYS {
            return Err(MapError::InvalidValueSize {
                size: table.slots.len(),
                expected: table.tags.len() * WAYS,
            });
        }
        Ok(table)
    }

    /// The table's two maps, tags and slots (for their kernel accounting).
    pub fn maps(&self) -> [&MapData; 2] {
        [self.tags.map(), self.slots.map()]
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
    fn for_each_key(&self, mut f: impl FnMut(usize, usize, u32)) {
        for bucket in 0..self.tags.len() {
            for way in 0..WAYS {
                let seen = self.tag(bucket, way).load(Ordering::Acquire);
                if seen & tag::KEY != 0 {
                    f(bucket, way, seen);
                }
            }
        }
    }

    /// Every key and its state.
    pub fn dump(&self) -> Vec<(FlowKey, KeyState)> {
        let mut out = Vec::new();
        self.for_each_key(|bucket, way, _| {
            let slot = self.slot(bucket, way);
            out.push((slot.key, slot.state));
        });
        out
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
}
