//! The rule file's errors, each with its file, line and field, and what
//! valid files mean, by topic; the helpers they share are in `common`.

mod common;
mod cost;
mod escalation;
mod files;
mod fleet;
mod layer7;
mod limits;
mod which_rule;
