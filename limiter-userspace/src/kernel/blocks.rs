//! Manual blocks (`limiter block`): one LPM trie per address family; the
//! kernel drops whatever a live block covers before any rule, and stops
//! applying an expired one by itself.

use aya::maps::{LpmTrie, MapData, MapError, lpm_trie::Key};
use limiter_common::abi::{Block, map_name};
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

    /// Tells the datapath the blocks changed: how many there are (none:
    /// it skips the lookup) and a new epoch, which makes every tracked
    /// source be checked against the tries again.
    fn blocks_changed(&mut self, added: i32) -> Result<(), KernelError> {
        let mut config = self.config()?;
        config.blocks = config.blocks.saturating_add_signed(added);
        config.block_epoch = config.block_epoch.wrapping_add(1);
        self.set_config(config)
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
