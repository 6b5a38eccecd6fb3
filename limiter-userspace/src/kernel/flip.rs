//! The switch from one rule set to the next, in its order, with the
//! crash points the fault tests stop it at: clear the state of ids new
//! to the set (`reset`); write the inactive generation whole and carry
//! the state of rules whose limits alone changed (`written`); flip with
//! one write to `CONFIG`, wait out the grace so no packet still reads the
//! old generation, and finish carrying (`flipped`); sweep the keys of
//! rules gone (`sweeping`, after each). A process killed at any point
//! leaves the kernel enforcing the old rules or the new, never a mix:
//! the next start applies its rule file over whatever it finds.

use limiter_common::abi::{GlobalConfig, RuleConfig, global_flag};

use super::{Datapath, KernelError};
use crate::{
    clock::{GRACE, realtime_offset_ns},
    compile::Tables,
    faults::crash_point,
};

/// A switch as the engine planned it: which ids are new, which keep
/// their state under new limits, which are gone, and the tables of the
/// new set, compiled for the inactive generation.
pub struct Switch<'a> {
    /// `CONFIG` as it was when the switch was planned.
    pub config: GlobalConfig,
    /// Ids new to the set: their state is cleared first.
    pub fresh: &'a [u32],
    /// Ids whose rule changed its limits alone, each with its old config:
    /// their keys' state is carried over to the new limits.
    pub carried: &'a [(u32, RuleConfig)],
    /// Ids of rules no longer in force: their keys are swept after the flip.
    pub freed: &'a [u32],
    /// The new set's tables, for generation `config.generation ^ 1`.
    pub tables: &'a Tables,
    /// Where the next fresh id is looked for (`GlobalConfig::next_rule_id`).
    pub next_rule_id: u32,
}

impl Datapath {
    /// Carries `switch` out; returns how many keys the sweep forgot.
    pub fn switch(&mut self, switch: Switch<'_>) -> Result<usize, KernelError> {
        let Switch {
            mut config,
            fresh,
            carried,
            freed,
            tables,
            next_rule_id,
        } = switch;
        let next = (config.generation & 1) ^ 1;
        for &id in fresh {
            self.reset_rule_state(id)?;
        }
        // Normally forgotten when their rule went; not if a limiter died
        // between a flip and that sweep.
        self.forget_keys(fresh)?;
        crash_point("reset");

        self.clear_generation(next)?;
        self.write_generation(next, tables)?;
        let mut carrying = Vec::new();
        for (id, old_rule) in carried {
            if let Some((_, new_rule)) = tables.rules.iter().find(|(i, _)| i == id) {
                // The third limit's meter, old and new, if both have one
                // (of one kind: the identity says so).
                let third = tables
                    .third_word
                    .iter()
                    .find(|(i, _)| i == id)
                    .and_then(|(_, new)| Some((self.third_word(config.generation, *id)?, *new)));
                let third = third.as_ref().map(|(old, new)| (old, new));
                carrying.push(self.carry_rule_state(*id, old_rule, new_rule, third)?);
            }
        }
        crash_point("written");

        config.generation = next;
        config.malformed_action = tables.malformed_action;
        if tables.drop_orphan_fragments {
            config.flags |= global_flag::DROP_ORPHAN_FRAGMENTS;
        } else {
            config.flags &= !global_flag::DROP_ORPHAN_FRAGMENTS;
        }
        config.next_rule_id = next_rule_id;
        config.realtime_offset_ns = realtime_offset_ns();
        self.set_config(config)?;
        std::thread::sleep(GRACE);
        crash_point("flipped");
        for carrying in &carrying {
            self.finish_carrying(carrying)?;
        }

        Ok(self
            .maps
            .keys
            .forget_each(freed, || crash_point("sweeping")))
    }
}
