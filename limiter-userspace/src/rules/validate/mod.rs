//! The checks a rule file must pass before anything is applied: every
//! field, across fields (a port needs a protocol), across rules (unique
//! names and matches) and against the kernel's tables (rules per prefix).
//! Errors name the field (`rules[2].limit.rate`); the caller adds the line.
//!
//! The file as a whole (`file`), one rule (`rule`), its rates (`limits`),
//! fleet fields (`fleet`), costs (`cost`), escalation (`escalation`),
//! fields written as text (`text`).

mod cost;
mod escalation;
mod file;
mod fleet;
mod limits;
mod rule;
mod text;

pub(super) use file::rule_set;
pub use text::{BadText, parse_net, parse_unit};
