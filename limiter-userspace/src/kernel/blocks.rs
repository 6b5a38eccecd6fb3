//! Manual blocks (`limiter block`): one LPM trie per address family; the
//! kernel drops whatever a live block covers before any rule, and stops
//! applying an expired one by itself.

use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{LpmTrie, MapData, MapError, lpm_trie::Key};
use limiter_common::abi::{BLOCKED_V4_WORDS, Block, map_name};
use nix::errno::Errno;

use super::{Datapath, KernelError, maps::map_error};

/// The blocks trie of an address family, by address length.
pub trait BlockTrie<const N: usize> {
    fn trie(&self) -> (&LpmTrie<MapData, [u8; N], Block>, &'static str);
    fn trie_mut(&mut self) -> (&mut LpmTrie<MapData, [u8; N], Block>, &'static str);
}

impl BlockTrie<4> for Datapath {
    fn trie(&self) -> (&LpmTrie<MapData, [u8; 4], Block>, &'static str) {
        (&self.maps.blocks_v4, map_name::BLOCKS_V4)
    }
    fn trie_mut(&mut self) -> (&mut LpmTrie<MapData, [u8; 4], Block>, &'static str) {
        (&mut self.maps.blocks_v4, map_name::BLOCKS_V4)
    }
}

impl BlockTrie<16> for Datapath {
    fn trie(&self) -> (&LpmTrie<MapData, [u8; 16], Block>, &'static str) {
        (&self.maps.blocks_v6, map_name::BLOCKS_V6)
    }
    fn trie_mut(&mut self) -> (&mut LpmTrie<MapData, [u8; 16], Block>, &'static str) {
        (&mut self.maps.blocks_v6, map_name::BLOCKS_V6)
    }
}

impl Datapath {
    /// Inserts or replaces a block of `prefix_len` bits of `addr`.
    pub fn set_block<const N: usize>(
        &mut self,
        addr: [u8; N],
        prefix_len: u32,
        expires_ns: u64,
    ) -> Result<(), KernelError>
    where
        Self: BlockTrie<N>,
    {
        let (blocks, name) = BlockTrie::<N>::trie_mut(self);
        let key = Key::new(prefix_len, addr);
        let existing = blocks.get(&key, 0).ok();
        blocks
            .insert(
                &key,
                Block {
                    expires_ns,
                    dropped_packets: existing.map_or(0, |b| b.dropped_packets),
                },
                0,
            )
            .map_err(map_error(name))?;
        self.blocks_changed(if existing.is_some() { 0 } else { 1 })
    }

    /// Tells the datapath the blocks changed: which IPv4 /16s they cover,
    /// how many there are (none: it skips the lookup) and a new epoch,
    /// which makes every tracked source be checked against the tries again.
    fn blocks_changed(&mut self, added: i32) -> Result<(), KernelError> {
        self.write_v4_coverage()?;
        let mut config = self.config()?;
        config.blocks = config.blocks.saturating_add_signed(added);
        config.block_epoch = config.block_epoch.wrapping_add(1);
        self.set_config(config)
    }

    /// Writes `BLOCKED_V4` from the IPv4 blocks trie (also at load: pins
    /// adopted from an older build have blocks and no such map yet).
    pub(super) fn write_v4_coverage(&mut self) -> Result<(), KernelError> {
        let covered = v4_coverage(
            self.blocks::<4>()?
                .iter()
                .map(|&(addr, prefix_len, _)| (addr, prefix_len)),
        );
        for (i, bits) in covered.iter().enumerate() {
            // Word by word, atomically: the kernel reads them meanwhile.
            // SAFETY: an aligned u64 of the mapping.
            unsafe { AtomicU64::from_ptr(self.maps.blocked_v4.at(i)) }
                .store(*bits, Ordering::Release);
        }
        Ok(())
    }

    /// Removes a block; `false` if there was none.
    pub fn remove_block<const N: usize>(
        &mut self,
        addr: [u8; N],
        prefix_len: u32,
    ) -> Result<bool, KernelError>
    where
        Self: BlockTrie<N>,
    {
        let (blocks, name) = BlockTrie::<N>::trie_mut(self);
        match blocks.remove(&Key::new(prefix_len, addr)) {
            Ok(()) => self.blocks_changed(-1).map(|()| true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(Errno::ENOENT as i32) =>
            {
                Ok(false)
            }
            Err(e) => Err(map_error(name)(e)),
        }
    }

    /// Every block of one family: (address, prefix length, state).
    pub fn blocks<const N: usize>(&self) -> Result<Vec<([u8; N], u32, Block)>, KernelError>
    where
        Self: BlockTrie<N>,
    {
        let (blocks, name) = BlockTrie::<N>::trie(self);
        blocks
            .iter()
            .map(|entry| entry.map(|(k, v)| (k.data(), k.prefix_len(), v)))
            .collect::<Result<_, _>>()
            .map_err(map_error(name))
    }
}

/// `BLOCKED_V4`'s words for IPv4 blocks (address, prefix length): the bit
/// of every /16 a block covers, in part or whole.
fn v4_coverage(blocks: impl Iterator<Item = ([u8; 4], u32)>) -> Vec<u64> {
    let mut words = vec![0u64; BLOCKED_V4_WORDS as usize];
    for (addr, prefix_len) in blocks {
        let first = usize::from(u16::from_be_bytes([addr[0], addr[1]]));
        let count = 1usize << (16 - prefix_len.min(16));
        let first = first & !(count - 1);
        for slash16 in first..first + count {
            words[slash16 / 64] |= 1 << (slash16 % 64);
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::v4_coverage;

    fn covered(words: &[u64], a: u8, b: u8) -> bool {
        let i = usize::from(u16::from_be_bytes([a, b]));
        words[i / 64] & (1 << (i % 64)) != 0
    }

    #[test]
    fn blocks_cover_their_slash16s() {
        let words = v4_coverage([([10, 1, 2, 3], 32), ([192, 168, 0, 0], 15)].into_iter());
        assert!(covered(&words, 10, 1));
        assert!(!covered(&words, 10, 0) && !covered(&words, 10, 2));
        assert!(covered(&words, 192, 168) && covered(&words, 192, 169));
        assert!(!covered(&words, 192, 167) && !covered(&words, 192, 170));
        assert_eq!(words.iter().map(|w| w.count_ones()).sum::<u32>(), 3);
        let all = v4_coverage([([0, 0, 0, 0], 0)].into_iter());
        assert!(all.iter().all(|&w| w == u64::MAX));
    }
}
