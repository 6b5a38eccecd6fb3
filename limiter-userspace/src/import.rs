//! `limiter import envoy FILE`: converts an envoy ratelimit service config
//! (domain, descriptors, `rate_limit: { unit, requests_per_unit }`,
//! `unlimited`, `shadow_mode`) into our rule file.
//!
//! envoy meters in fixed windows aligned to the epoch, so every converted
//! rule says `algorithm: fixed_window`. The rule file describes sources
//! (addresses), so only `remote_address` descriptors convert: without a
//! value they limit every client address, with one (an address or prefix)
//! that source. Everything else is listed as not converted, with the reason.

use std::{collections::HashSet, path::Path};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::rules::{RuleSet, parse_net};

#[derive(Debug, Deserialize)]
struct EnvoyConfig {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct Descriptor {
    key: String,
    value: Option<String>,
    rate_limit: Option<EnvoyLimit>,
    #[serde(default)]
    descriptors: Vec<Descriptor>,
    #[serde(default)]
    shadow_mode: bool,
}

#[derive(Debug, Deserialize)]
struct EnvoyLimit {
    unit: Option<String>,
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
}

/// The converted rule file, and what could not be converted (one line each).
pub struct Conversion {
    pub rules: String,
    pub skipped: Vec<String>,
}

pub fn envoy(path: &Path) -> Result<Conversion> {
    envoy_text(&crate::yaml::read(path)?, path)
}

/// [`envoy`] on text already read; `origin` names it in errors.
pub fn envoy_text(text: &str, origin: &Path) -> Result<Conversion> {
    let path = origin;
    let config: EnvoyConfig = crate::yaml::parse(text, origin)?;
    let mut rules = Vec::new();
    let mut skipped = Vec::new();
    let mut names = HashSet::new();
    for descriptor in &config.descriptors {
        convert(descriptor, &[], &mut rules, &mut skipped, &mut names);
    }
    let mut text = format!(
        "# Converted from {} (envoy ratelimit domain {:?}) by `limiter import envoy`.\n\
         # envoy counts in fixed windows aligned to the epoch: so do these rules.\n\
         default: pass\nrules:\n",
        path.display(),
        config.domain
    );
    if rules.is_empty() {
        text = text.replace("rules:\n", "rules: []\n");
    }
    for rule in &rules {
        text.push_str(rule);
    }
    // What we print must be a rule file we accept.
    RuleSet::parse(&text, Path::new("converted rules"))
        .context("the converted rules do not validate")?;
    Ok(Conversion {
        rules: text,
        skipped,
    })
}

fn convert(
    d: &Descriptor,
    parents: &[String],
    rules: &mut Vec<String>,
    skipped: &mut Vec<String>,
    names: &mut HashSet<String>,
) {
    let here = match &d.value {
        Some(value) => format!("{}={value}", d.key),
        None => d.key.clone(),
    };
    let path: Vec<String> = parents.iter().cloned().chain([here.clone()]).collect();
    let shown = path.join(" > ");
    for child in &d.descriptors {
        convert(child, &path, rules, skipped, names);
    }
    let Some(limit) = &d.rate_limit else {
        if d.descriptors.is_empty() {
            skipped.push(format!("{shown}: no rate_limit"));
        }
        return;
    };
    if !parents.is_empty() {
        skipped.push(format!("{shown}: nested descriptors match several request attributes at once; a rule matches sources only"));
        return;
    }
    if d.key != "remote_address" {
        skipped.push(format!("{shown}: key {} is not the client address (remote_address); use the L7 library's key extractor", crate::yaml::quoted(&d.key)));
        return;
    }
    let source = match &d.value {
        None => None,
        Some(value) => match parse_net(value) {
            Ok(net) => Some(net.trunc()),
            Err(e) => {
                skipped.push(format!("{shown}: {e}"));
                return;
            }
        },
    };
    let name = unique_name(&here, names);
    let matches = source.map_or(String::new(), |s| format!(", match: {{ source: \"{s}\" }}"));
    let action = if d.shadow_mode {
        ", action: shadow"
    } else {
        ""
    };
    if limit.unlimited {
        if d.shadow_mode {
            skipped.push(format!(
                "{shown}: shadow_mode has no effect on an unlimited descriptor (dropped)"
            ));
        }
        rules.push(format!(
            "  - {{ name: {name}{matches}, limit: unlimited }}\n"
        ));
        return;
    }
    let (Some(unit), Some(rate)) = (&limit.unit, limit.requests_per_unit) else {
        skipped.push(format!(
            "{shown}: rate_limit needs unit and requests_per_unit"
        ));
        return;
    };
    let unit = unit.to_ascii_lowercase();
    if !["second", "minute", "hour", "day"].contains(&unit.as_str()) {
        skipped.push(format!(
            "{shown}: unit {} (only second, minute, hour and day convert)",
            crate::yaml::quoted(&unit)
        ));
        return;
    }
    rules.push(format!(
        "  - {{ name: {name}{matches}, key: source, algorithm: fixed_window, limit: {{ rate: {rate}, unit: {unit} }}{action} }}\n"
    ));
}

/// A rule name from a descriptor: letters, digits, `-`; at most 31 bytes; unique.
fn unique_name(descriptor: &str, names: &mut HashSet<String>) -> String {
    let base: String = descriptor
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(26)
        .collect();
    let mut name = base.clone();
    let mut n = 2;
    while !names.insert(name.clone()) {
        name = format!("{base}-{n}");
        n += 1;
    }
    name
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::rules::{Algorithm, Limit, RuleSet};

    #[test]
    fn converts_what_it_can_and_says_what_it_cannot() {
        let example =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/envoy-ratelimit.yaml");
        let conversion = super::envoy(&example).unwrap();
        let set = RuleSet::parse(&conversion.rules, Path::new("converted")).unwrap();
        assert_eq!(set.rules.len(), 3);
        let all = &set.rules[0];
        assert_eq!(
            (all.matches.source, all.algorithm),
            (None, Algorithm::FixedWindow)
        );
        let Limit::Metered {
            packets: Some(m), ..
        } = all.limit
        else {
            panic!("metered")
        };
        assert_eq!((m.rate, m.period.as_secs()), (10, 1));
        assert_eq!(set.rules[1].limit, Limit::Unlimited);
        assert!(set.rules[2].shadow);
        assert_eq!(conversion.skipped.len(), 3, "{:?}", conversion.skipped);
        assert!(conversion.skipped[0].contains("\"header_match\" is not the client address"));
        assert!(conversion.skipped[1].contains("nested descriptors"));
        assert!(conversion.skipped[2].contains("unit \"month\""));
    }
}
