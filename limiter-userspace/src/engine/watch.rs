//! What escalation remembers between its looks (`escalate`): in the
//! engine's state, apart from the looks themselves, which act on the
//! engine.

use std::collections::{HashMap, HashSet, VecDeque};

use ipnet::IpNet;
use limiter_common::abi::FlowKey;

/// Keys over their limit since when, escalations per rule, and the blocks
/// they made.
#[derive(Default)]
pub struct Watch {
    pub(super) over_since: HashMap<FlowKey, u64>,
    /// Each key's count of refused packets at the last look (keys that
    /// have refused any): a key that refused one since is over its limit.
    pub(super) dropped: HashMap<FlowKey, u32>,
    /// The rules (by id) the last look looked at: a key of another has no
    /// count to compare with yet (its refusals may be old).
    pub(super) looked: HashSet<u32>,
    /// Keys a dry run would have blocked, or held by their rule, until
    /// when: not counted again meanwhile (a held key is over its limit
    /// at every look), as a block would have stopped them, nor at the
    /// first look after.
    pub(super) dry_until: HashMap<FlowKey, u64>,
    /// Escalations per rule name, since the process started.
    pub(super) counts: HashMap<String, u64>,
    pub(super) made: HashMap<IpNet, String>,
    /// When each block of the last minute was made (`max_per_minute`).
    pub(super) recent: VecDeque<u64>,
    /// Escalations left out, by why (`never_block`, `max_per_minute`).
    pub(super) left_out: HashMap<&'static str, u64>,
    /// When the last escalation left out for the cap was logged.
    pub(super) cap_logged: u64,
}

impl Watch {
    /// The rule whose escalation made the block of `net`, if one did.
    pub fn made_by(&self, net: &IpNet) -> Option<String> {
        self.made.get(net).cloned()
    }
}
