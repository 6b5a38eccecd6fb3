//! What `rules apply` and `rules show` answer: a rule-set change by rule
//! name, and the rules in force with their counters and the blocks.

use serde::{Deserialize, Serialize};

use crate::{fleet::node::ShareStatus, rules::describe::Description};

/// What a rule-set change did, by rule name.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Change {
    pub generation: u32,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Algorithm, match or key changed: new buckets.
    pub modified: Vec<String>,
    /// Only the name's action changed, or nothing: buckets kept.
    pub unchanged: Vec<String>,
    /// Limits changed, match and key not: keys kept, their state carried
    /// over to the new limits.
    #[serde(default)]
    pub carried: Vec<String>,
    /// Keys of removed or modified rules deleted from the state map.
    pub forgotten_keys: usize,
}

/// A manual block, as listed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BlockView {
    pub prefix: String,
    /// Seconds until it expires; `None`: never.
    pub expires_in_secs: Option<f64>,
    pub expired: bool,
    pub dropped_packets: u64,
    /// The rule whose `escalate` made it, if one did (remembered by this
    /// process only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalated_by: Option<String>,
}

impl Change {
    /// Logs the change as one event (`event = "rules_applied"`), its lists
    /// as fields, for a log pipeline; `origin` says where the rules came
    /// from.
    pub fn log(&self, origin: &str) {
        tracing::info!(
            event = "rules_applied",
            origin,
            generation = self.generation,
            added = ?self.added,
            removed = ?self.removed,
            modified = ?self.modified,
            carried = ?self.carried,
            unchanged = ?self.unchanged,
            forgotten_keys = self.forgotten_keys,
            "applied {origin}: added {:?}, removed {:?}, modified {:?}, limits changed (state carried over) {:?}, unchanged {:?}",
            self.added,
            self.removed,
            self.modified,
            self.carried,
            self.unchanged
        );
    }
}

/// `limiter rules show`: the active rules with ids and counters, and blocks.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RulesView {
    pub generation: u32,
    /// Global dry run.
    pub shadow: bool,
    pub rules: Vec<RuleView>,
    pub blocks: Vec<BlockView>,
    /// Each fleet rule's share (filled by the daemon, which runs them).
    #[serde(default)]
    pub fleet: Vec<ShareStatus>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RuleView {
    pub id: u32,
    pub name: String,
    #[serde(flatten)]
    pub description: Description,
    pub passed_packets: u64,
    pub dropped_packets: u64,
    pub shadow_packets: u64,
    pub new_keys: u64,
}
