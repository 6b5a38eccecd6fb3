//! The IPv4 rule table (`limiter_common::abi::v4_table`): source prefixes
//! and their candidate lists expanded into direct-indexed arrays of 16, 8
//! and 8 bits, so the kernel finds a source's candidates in at most three
//! array loads with the longest prefix's answer.

use limiter_common::abi::{Candidates, v4_table};

/// One generation of the table, its indices absolute (generation base
/// included), ready to be written over that generation's part of the maps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct V4Table {
    pub generation: u32,
    /// The generation's `V4_L16` entries, one per /16 (its 256 blocks).
    pub l16: Vec<u32>,
    /// Its `V4_L24` and `V4_L32` subtables, in order from its base.
    pub l24: Vec<v4_table::Block>,
    pub l32: Vec<v4_table::Block>,
    /// Its `V4_LISTS`, in order from its base; the first is empty.
    pub lists: Vec<Candidates>,
}

/// A prefix of `len` bits of `addr`, and the candidates of its sources.
pub type Prefix = ([u8; 4], u8, Candidates);

impl V4Table {
    /// The table of `prefixes` (distinct, at most `v4_table::LISTS - 1`)
    /// for `generation`: each address gets the list of the longest prefix
    /// that covers it, or the empty list.
    pub fn build(generation: u32, prefixes: &[Prefix]) -> Self {
        let g = generation & 1;
        let list_base = g * v4_table::LISTS;
        let subtable_base = g * v4_table::SUBTABLES;
        assert!(
            prefixes.len() < v4_table::LISTS as usize,
            "too many prefixes"
        );
        let mut table = Self {
            generation: g,
            l16: vec![list_base; v4_table::L16_BLOCKS as usize * v4_table::BLOCK],
            l24: Vec::new(),
            l32: Vec::new(),
            lists: vec![Candidates::default()],
        };
        // Shorter prefixes first: a longer one then overwrites what it
        // narrows, and a subtable starts as a copy of what covered it.
        let mut order: Vec<&Prefix> = prefixes.iter().collect();
        order.sort_by_key(|(_, len, _)| *len);
        for (addr, len, candidates) in order {
            let list = list_base + table.lists.len() as u32;
            table.lists.push(*candidates);
            let len = u32::from((*len).min(32));
            let address = u32::from_be_bytes(*addr) & mask(len);
            if len <= 16 {
                let first = (address >> 16) as usize;
                let count = 1usize << (16 - len);
                table.l16[first..first + count].fill(list);
                continue;
            }
            let l16 = (address >> 16) as usize;
            let l24 = table.subtable(Level::L24, l16, subtable_base);
            let third = ((address >> 8) & 0xff) as usize;
            if len <= 24 {
                let count = 1usize << (24 - len);
                table.l24[l24][third..third + count].fill(list);
                continue;
            }
            let l32 = table.subtable(Level::L32(l24), third, subtable_base);
            let fourth = (address & 0xff) as usize;
            let count = 1usize << (32 - len);
            table.l32[l32][fourth..fourth + count].fill(list);
        }
        table
    }

    /// The subtable below entry `index` of a level (`L24`: of `l16`;
    /// `L32(t)`: of `l24[t]`), made from a copy of that entry if needed;
    /// its position in `l24` or `l32`.
    fn subtable(&mut self, level: Level, index: usize, base: u32) -> usize {
        let entry = match level {
            Level::L24 => self.l16[index],
            Level::L32(t) => self.l24[t][index],
        };
        if entry & v4_table::NEXT != 0 {
            return ((entry & !v4_table::NEXT) - base) as usize;
        }
        let tables = match level {
            Level::L24 => &mut self.l24,
            Level::L32(_) => &mut self.l32,
        };
        assert!(
            tables.len() < v4_table::SUBTABLES as usize,
            "too many subtables"
        );
        tables.push([entry; v4_table::BLOCK]);
        let position = tables.len() - 1;
        let next = v4_table::NEXT | (base + position as u32);
        match level {
            Level::L24 => self.l16[index] = next,
            Level::L32(t) => self.l24[t][index] = next,
        }
        position
    }

    /// The list index the kernel's walk finds for `addr` (for tests and
    /// for checking a table against its prefixes).
    pub fn lookup(&self, addr: [u8; 4]) -> u32 {
        let g = self.generation;
        let subtable = |tables: &[v4_table::Block], entry: u32, octet: u8| {
            let at = (entry & !v4_table::NEXT) - g * v4_table::SUBTABLES;
            tables[at as usize][usize::from(octet)]
        };
        let mut entry = self.l16[usize::from(u16::from_be_bytes([addr[0], addr[1]]))];
        if entry & v4_table::NEXT != 0 {
            entry = subtable(&self.l24, entry, addr[2]);
        }
        if entry & v4_table::NEXT != 0 {
            entry = subtable(&self.l32, entry, addr[3]);
        }
        entry
    }

    /// The candidates the kernel finds for `addr`.
    pub fn candidates(&self, addr: [u8; 4]) -> &Candidates {
        &self.lists[(self.lookup(addr) - self.generation * v4_table::LISTS) as usize]
    }
}

enum Level {
    L24,
    L32(usize),
}

fn mask(len: u32) -> u32 {
    if len == 0 { 0 } else { u32::MAX << (32 - len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(tag: u32) -> Candidates {
        Candidates {
            len: tag,
            ..Candidates::default()
        }
    }

    /// The list a linear longest-prefix search finds (`len` tags it).
    fn longest(prefixes: &[Prefix], addr: [u8; 4]) -> u32 {
        let a = u32::from_be_bytes(addr);
        prefixes
            .iter()
            .filter(|(p, len, _)| {
                let m = mask(u32::from(*len));
                u32::from_be_bytes(*p) & m == a & m
            })
            .max_by_key(|(_, len, _)| *len)
            .map_or(0, |(_, _, c)| c.len)
    }

    fn check(table: &V4Table, prefixes: &[Prefix], addr: [u8; 4]) {
        let base = table.generation * v4_table::LISTS;
        let found = table.lists[(table.lookup(addr) - base) as usize].len;
        assert_eq!(found, longest(prefixes, addr), "{addr:?}");
    }

    #[test]
    fn the_longest_prefix_wins_at_every_level() {
        let prefixes = [
            ([0, 0, 0, 0], 0, list(1)),
            ([10, 0, 0, 0], 8, list(2)),
            ([10, 1, 0, 0], 16, list(3)),
            ([10, 1, 2, 0], 23, list(4)),
            ([10, 1, 3, 128], 25, list(5)),
            ([10, 1, 3, 129], 32, list(6)),
            ([10, 2, 0, 0], 17, list(7)),
        ];
        for generation in [0, 1] {
            let t = V4Table::build(generation, &prefixes);
            assert_eq!(t.l24.len(), 2);
            assert_eq!(t.l32.len(), 1);
            for addr in [
                [9, 9, 9, 9],
                [10, 0, 0, 1],
                [10, 1, 0, 1],
                [10, 1, 2, 1],
                [10, 1, 3, 1],
                [10, 1, 3, 128],
                [10, 1, 3, 129],
                [10, 1, 3, 130],
                [10, 1, 4, 0],
                [10, 2, 127, 1],
                [10, 2, 128, 1],
                [11, 0, 0, 0],
            ] {
                check(&t, &prefixes, addr);
            }
        }
    }

    /// Guards the expansion against a plain longest-prefix search, on
    /// random prefixes and addresses near them.
    #[test]
    fn random_tables_agree_with_a_linear_search() {
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // Addresses in a few /8s, /16s and /24s keep the prefixes nested.
        let near = |r: u64| {
            [
                10 + (r % 3) as u8,
                (r >> 8) as u8 % 4,
                (r >> 16) as u8 % 8,
                (r >> 24) as u8,
            ]
        };
        for round in 0..20 {
            let mut prefixes: Vec<Prefix> = Vec::new();
            for i in 0..60 {
                let r = next();
                let addr = near(r);
                let len = (r >> 32) as u8 % 33;
                let m = mask(u32::from(len));
                let addr = (u32::from_be_bytes(addr) & m).to_be_bytes();
                if prefixes.iter().all(|(a, l, _)| (*a, *l) != (addr, len)) {
                    prefixes.push((addr, len, list(100 + i)));
                }
            }
            let t = V4Table::build(round % 2, &prefixes);
            for _ in 0..2000 {
                check(&t, &prefixes, near(next()));
            }
        }
    }
}
