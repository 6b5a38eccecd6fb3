//! Reading a rule file: its YAML into the fields as written, those
//! validated into a [`RuleSet`], each error with its file, line and field.

use std::path::Path;

use super::{invalid::InvalidField, raw, set::RuleSet, validate};
use crate::yaml::{self, InvalidFile};

/// The default rule file, used by the lab and shown in the README.
pub const EXAMPLE: &str = include_str!("../../../examples/rules.yaml");

impl RuleSet {
    /// Reads and validates a rule file.
    pub fn load(path: &Path) -> Result<Self, InvalidFile> {
        Self::parse(&yaml::read(path)?, path)
    }

    /// Validates rule-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, InvalidFile> {
        let raw: raw::RuleFile = yaml::parse(text, origin)?;
        validate::rule_set(raw).map_err(|InvalidField { field, message }| InvalidFile {
            file: origin.to_owned(),
            line: yaml::Lines::index(text).line(&field),
            field,
            message,
        })
    }
}
