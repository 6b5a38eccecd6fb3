//! The file as a whole: its bounds (`max_keys`, how many rules), each
//! rule in turn, across rules (unique names, no rule that could never
//! apply), the key-creation budget (`new_keys`), and against the kernel's
//! tables (rules per prefix).

use std::{collections::HashMap, time::Duration};

use limiter_common::{
    abi::{DEFAULT_MAX_KEYS, MAX_CANDIDATES, MAX_KEYS, MAX_RULES},
    gcra::Gcra,
    window::Window,
};

use super::{
    escalation::escalation_policy, fleet::local_only, limits::validate_rates, rule::validate_rule,
};
use crate::rules::invalid::{InvalidField, invalid};
use crate::rules::{
    matching,
    raw::{self, Algorithm},
    request::{HeaderCondition, KeyPart, RequestMatch},
    set::{EscalationPolicy, Match, Rate, Rule, RuleSet},
};

pub(in crate::rules) fn rule_set(file: raw::RuleFile) -> Result<RuleSet, InvalidField> {
    let max_keys = file.max_keys.unwrap_or(DEFAULT_MAX_KEYS);
    if max_keys == 0 {
        return Err(invalid("max_keys", "must be at least 1"));
    }
    if max_keys > MAX_KEYS {
        return Err(invalid(
            "max_keys",
            format!("{max_keys} keys; at most {MAX_KEYS} (60.5 bytes of kernel memory each)"),
        ));
    }
    if file.rules.len() >= MAX_RULES as usize {
        return Err(invalid(
            "rules",
            format!("{} rules; at most {} fit", file.rules.len(), MAX_RULES - 1),
        ));
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut matches: HashMap<(Match, RequestMatch), Vec<usize>> = HashMap::new();
    let mut rules = Vec::with_capacity(file.rules.len());
    for (i, raw) in file.rules.iter().enumerate() {
        let at = |field: &str| format!("rules[{i}].{field}");
        let rule = validate_rule(raw).map_err(|e| e.within(at))?;
        if let Some(first) = names.insert(&raw.name, i) {
            return Err(invalid(
                at("name"),
                format!("duplicate name {:?} (also rules[{first}])", raw.name),
            ));
        }
        let same_match = matches
            .entry((rule.matches, rule.request.clone()))
            .or_default();
        if let Some(&first) = same_match
            .iter()
            .find(|&&j| keys_whenever(&rules[j], &rule))
        {
            return Err(invalid(
                at("match"),
                format!(
                    "same match as rules[{first}] ({:?}), which keys every request this one could: this one could never apply",
                    file.rules[first].name
                ),
            ));
        }
        same_match.push(i);
        rules.push(rule);
    }
    let new_keys = match &file.new_keys {
        Some(fields) => new_keys(fields).map_err(|e| e.within(|f| format!("new_keys.{f}")))?,
        None => default_new_keys(max_keys),
    };
    let escalation = match &file.escalation {
        Some(fields) => escalation_policy(fields)?,
        None => EscalationPolicy::default(),
    };
    let rule_set = RuleSet {
        default: file.default,
        malformed: file.malformed,
        max_keys,
        new_keys,
        escalation,
        fragments: file.fragments,
        rules,
    };
    // The kernel's limit: a rule file with layer-7 rules is not for it.
    if !rule_set.has_layer7_rules() {
        fits_the_tries(&rule_set)?;
    }
    Ok(rule_set)
}

/// Whether `earlier`, of the same match as `later` and before it in the
/// file, keys every request `later` could: then `later` never applies. Of
/// rules with the same match, the first that can key a request does; a
/// rule skips a request that lacks a part of its key (a header, say, as
/// envoy's descriptors do).
fn keys_whenever(earlier: &Rule, later: &Rule) -> bool {
    let conditions = &later.request;
    // Whether a request `later` applies to may lack `part`.
    let may_lack = |part: &KeyPart| {
        !later.keyed_by.contains(part)
            && match part {
                KeyPart::Source => false,
                // Only a request without HTTP fields (from a caller that
                // tells addresses alone), which only a rule without
                // layer-7 conditions, keyed by the address, applies to.
                KeyPart::Path | KeyPart::Method => {
                    conditions.is_empty() && later.keyed_by.iter().all(|p| *p == KeyPart::Source)
                }
                KeyPart::Host => conditions.host.is_none(),
                KeyPart::Header(name) => !conditions.headers.iter().any(|h| {
                    h.name == *name
                        && matches!(
                            h.condition,
                            HeaderCondition::Equals(_) | HeaderCondition::Present
                        )
                }),
            }
    };
    !earlier.keyed_by.iter().any(may_lack)
}

/// A key-creation budget: keys per unit, with a burst.
fn new_keys(fields: &raw::RateFields) -> Result<Rate, InvalidField> {
    if fields.bytes.is_some() || fields.burst_bytes.is_some() {
        return Err(invalid(
            "bytes",
            "a key-creation budget counts keys, not bytes",
        ));
    }
    if fields.delay.is_some() {
        return Err(invalid("delay", "applies to limits only"));
    }
    local_only(fields)?;
    validate_rates(fields, Algorithm::Gcra)?
        .packets
        .ok_or_else(|| invalid("rate", "keys per unit are required"))
}

/// `max_keys` a minute with a second's worth of burst, so a flood of new
/// sources turns the key map over no faster than once a minute.
fn default_new_keys(max_keys: u32) -> Rate {
    let per_minute = u64::from(max_keys).max(1);
    let burst = (per_minute / 60).max(1);
    let period = Duration::from_secs(60);
    Rate {
        rate: per_minute,
        period,
        burst,
        gcra: Gcra::new(per_minute, period.as_nanos() as u64, burst)
            .expect("max_keys per minute is within GCRA's range"),
        window: Window::default(),
    }
}

/// No source prefix may be covered by more rules than a trie entry of the
/// kernel holds; the error names the rule whose prefix overflows.
fn fits_the_tries(set: &RuleSet) -> Result<(), InvalidField> {
    for net in matching::all_prefixes(set) {
        let covering = matching::covering_rules(set, net);
        if covering.len() > MAX_CANDIDATES {
            return Err(invalid(
                format!("rules[{}].match", covering[0]),
                format!(
                    "{} rules cover {net}; at most {MAX_CANDIDATES} may cover one prefix",
                    covering.len()
                ),
            ));
        }
    }
    Ok(())
}
