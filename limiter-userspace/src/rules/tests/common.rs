//! What every topic's tests share: a rule file's text parsed as
//! `rules.yaml`, and its error in words.

use std::path::Path;

use crate::rules::{InvalidFile, RuleSet};

pub(super) fn parse(text: &str) -> Result<RuleSet, InvalidFile> {
    RuleSet::parse(text, Path::new("rules.yaml"))
}

pub(super) fn error(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}
