//! `limiter import envoy FILE [--routes ROUTES]`: converts an envoy
//! ratelimit service config (domain, nested descriptors, `rate_limit: {
//! unit, requests_per_unit }`, `unlimited`, `shadow_mode`) into our rule
//! file.
//!
//! A descriptor's keys mean what the route configuration's `rate_limits`
//! actions make them mean ([`routes`]): given it, each descriptor that a
//! list of actions produces becomes a rule whose match is that route's
//! match plus what the entries with values ask (a header equal to a value,
//! a method, a path, a host, a source) and whose key is made of the
//! entries without values (a header, the client address, the path). A
//! descriptor whose every entry has a value is one bucket for all its
//! requests (`key: all`). Without the routes, only `remote_address`
//! descriptors convert. Everything else is listed, with the reason.
//!
//! envoy meters in fixed windows aligned to the epoch, so every converted
//! rule says `algorithm: fixed_window`.

pub mod routes;

use std::{collections::HashSet, path::Path};

use anyhow::{Context, Result};
use ipnet::IpNet;
use serde::Deserialize;

use self::routes::{ActionList, Condition, Entry, RouteConfig};
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

pub fn envoy(path: &Path, routes: Option<&Path>) -> Result<Conversion> {
    let routes = routes
        .map(|p| anyhow::Ok((crate::yaml::read(p)?, p)))
        .transpose()?;
    envoy_text(
        &crate::yaml::read(path)?,
        path,
        routes.as_ref().map(|(text, p)| (text.as_str(), *p)),
    )
}

/// [`envoy`] on text already read; `origin` names it in errors.
pub fn envoy_text(text: &str, origin: &Path, routes: Option<(&str, &Path)>) -> Result<Conversion> {
    let config: EnvoyConfig = crate::yaml::parse(text, origin)?;
    let routes = routes
        .map(|(text, path)| crate::yaml::parse::<RouteConfig>(text, path))
        .transpose()?;
    let mut converter = Converter {
        lists: routes.as_ref().map(routes::action_lists),
        rules: Vec::new(),
        skipped: routes
            .as_ref()
            .map(routes::domain_notes)
            .unwrap_or_default(),
        names: HashSet::new(),
    };
    for descriptor in &config.descriptors {
        converter.descriptor(descriptor, &[]);
    }
    let mut text = format!(
        "# Converted from {} (envoy ratelimit domain {:?}) by `limiter import envoy`.\n\
         # envoy counts in fixed windows aligned to the epoch: so do these rules.\n\
         # envoy checks every descriptor a request produces; a rule file applies\n\
         # one rule to a request: the most specific that matches.\n\
         default: pass\nrules:\n",
        origin.display(),
        config.domain
    );
    if converter.rules.is_empty() {
        text = text.replace("rules:\n", "rules: []\n");
    }
    for rule in &converter.rules {
        text.push_str(rule);
    }
    // What we print must be a rule file we accept.
    RuleSet::parse(&text, Path::new("converted rules"))
        .context("the converted rules do not validate")?;
    Ok(Conversion {
        rules: text,
        skipped: converter.skipped,
    })
}

struct Converter {
    /// The route configuration's action lists, if given.
    lists: Option<Vec<ActionList>>,
    rules: Vec<String>,
    skipped: Vec<String>,
    names: HashSet<String>,
}

/// A descriptor entry of the service's config: its key and value.
type Step<'a> = (&'a str, Option<&'a str>);

/// A rule being drafted from a descriptor and the actions that produce it.
#[derive(Default)]
struct Draft {
    source: Option<IpNet>,
    conditions: Vec<Condition>,
    key: Vec<String>,
}

impl Converter {
    fn descriptor<'a>(&mut self, d: &'a Descriptor, parents: &[Step<'a>]) {
        let path: Vec<Step<'a>> = parents
            .iter()
            .copied()
            .chain([(d.key.as_str(), d.value.as_deref())])
            .collect();
        let shown = path
            .iter()
            .map(|(k, v)| v.map_or(k.to_string(), |v| format!("{k}={v}")))
            .collect::<Vec<_>>()
            .join(" > ");
        for child in &d.descriptors {
            self.descriptor(child, &path);
        }
        let Some(limit) = &d.rate_limit else {
            if d.descriptors.is_empty() {
                self.skipped.push(format!("{shown}: no rate_limit"));
            }
            return;
        };
        let limit = match limit_fields(limit, d.shadow_mode) {
            Ok(limit) => limit,
            Err(why) => return self.skipped.push(format!("{shown}: {why}")),
        };
        let drafts: Vec<(String, Result<Draft, String>)> = match &self.lists {
            None => vec![(String::new(), address_only(&path))],
            Some(lists) => {
                let producing: Vec<&ActionList> = lists
                    .iter()
                    .filter(|l| {
                        l.entries.len() == path.len()
                            && l.entries
                                .iter()
                                .zip(&path)
                                .all(|(e, (k, v))| e.gives(k, *v))
                    })
                    .collect();
                if producing.is_empty() {
                    return self.skipped.push(format!(
                        "{shown}: no rate_limits actions in the routes produce these keys"
                    ));
                }
                producing
                    .into_iter()
                    .map(|l| (format!(" ({})", l.origin), draft(l, &path)))
                    .collect()
            }
        };
        for (origin, draft) in drafts {
            let rule = draft.and_then(|draft| {
                let name = unique_name(&shown, &mut self.names);
                let text = rule_text(&name, &draft, &limit);
                // With the rules before it, so one that does not validate
                // (or could never apply) is listed, not the whole
                // conversion lost.
                let file = format!("rules:\n{}{text}", self.rules.concat());
                let taken = RuleSet::parse(&file, Path::new("rules"))
                    .map_err(|e| format!("{}: {}", e.field, e.message))
                    .and_then(|set| match same_match_before_last(&set) {
                        // A rule file allows it (the later one takes what
                        // the first cannot key), but envoy would charge
                        // both descriptors.
                        Some(first) => Err(format!(
                            "the same match as {:?}: envoy charges a request to both descriptors, a rule file to one rule",
                            set.rules[first].name
                        )),
                        None => Ok(text),
                    });
                if taken.is_err() {
                    // Not taken: free for the next rule.
                    self.names.remove(&name);
                }
                taken
            });
            match rule {
                Ok(text) => self.rules.push(text),
                Err(why) => self.skipped.push(format!("{shown}{origin}: {why}")),
            }
        }
    }
}

/// The rule before the last of `set` that has the same match as the last.
fn same_match_before_last(set: &RuleSet) -> Option<usize> {
    let (last, before) = set.rules.split_last()?;
    before
        .iter()
        .position(|r| r.matches == last.matches && r.request == last.request)
}

/// Without the routes: a lone `remote_address` descriptor, every client
/// (a key per address) or the one its value names.
fn address_only(path: &[Step<'_>]) -> Result<Draft, String> {
    match path {
        [("remote_address", value)] => Ok(Draft {
            source: value.map(parse_source).transpose()?,
            conditions: Vec::new(),
            key: vec!["source".into()],
        }),
        [(key, _)] => Err(format!(
            "key {} means what the route's rate_limits actions say: give them (--routes FILE)",
            crate::yaml::quoted(key)
        )),
        _ => Err(
            "nested descriptors mean what the route's rate_limits actions say: give them (--routes FILE)"
                .into(),
        ),
    }
}

fn parse_source(value: &str) -> Result<IpNet, String> {
    parse_net(value)
        .map(|net| net.trunc())
        .map_err(|e| e.to_string())
}

/// The rule that the action list `list` and the descriptor `path` (which
/// it produces) make.
fn draft(list: &ActionList, path: &[Step<'_>]) -> Result<Draft, String> {
    let mut draft = Draft {
        conditions: list.conditions.clone()?,
        ..Draft::default()
    };
    for (entry, (_, value)) in list.entries.iter().zip(path) {
        match (entry, value) {
            (Entry::Unsupported { why, .. }, _) => return Err(why.clone()),
            // envoy's value is one address; a prefix (ours) is each of its
            // addresses, as without the routes.
            (Entry::RemoteAddress, value) => {
                draft.source = value.map(parse_source).transpose()?;
                draft.key.push("source".into());
            }
            (Entry::Header { header, .. }, Some(v)) => {
                draft.conditions.push(equals(header, v));
            }
            (Entry::Header { header, .. }, None) => draft.key.push(match header.as_str() {
                ":path" => "path".into(),
                ":method" => "method".into(),
                ":authority" | "host" => "host".into(),
                other => format!("header:{other}"),
            }),
            (Entry::Generic { .. }, _) => {}
            (Entry::Matched { conditions, .. }, _) => {
                draft.conditions.extend(conditions.iter().cloned());
            }
        }
    }
    if draft.key.is_empty() {
        draft.key.push("all".into());
    }
    draft.conditions = consistent(draft.conditions)?;
    Ok(draft)
}

/// The conditions a route and its actions ask together, as one rule can
/// state them (an exact path under a prefix is the exact path); an error
/// when no request could meet them all.
fn consistent(conditions: Vec<Condition>) -> Result<Vec<Condition>, String> {
    let mut kept: Vec<Condition> = Vec::new();
    for condition in conditions {
        if kept.contains(&condition) {
            continue;
        }
        let clash = kept.iter().find_map(|k| match (k, &condition) {
            (Condition::Method(a), Condition::Method(b)) => Some(format!("methods {a} and {b}")),
            (Condition::Host(a), Condition::Host(b)) => Some(format!("hosts {a} and {b}")),
            (Condition::Path(a), Condition::Path(b)) => Some(format!("paths {a} and {b}")),
            (Condition::Path(p), Condition::PathPrefix(pre))
            | (Condition::PathPrefix(pre), Condition::Path(p))
                if !p.starts_with(pre.as_str()) =>
            {
                Some(format!("path {p} and prefix {pre}"))
            }
            (Condition::PathPrefix(a), Condition::PathPrefix(b))
                if !a.starts_with(b.as_str()) && !b.starts_with(a.as_str()) =>
            {
                Some(format!("prefixes {a} and {b}"))
            }
            _ => None,
        });
        if let Some(clash) = clash {
            return Err(format!(
                "no request matches both {clash} (the route's and an action's)"
            ));
        }
        kept.push(condition);
    }
    // The narrower of two path conditions says it all.
    let narrowest = |c: &Condition| match c {
        Condition::Path(p) => Some((1, p.len())),
        Condition::PathPrefix(p) => Some((0, p.len())),
        _ => None,
    };
    if let Some(best) = kept.iter().filter_map(narrowest).max() {
        kept.retain(|c| narrowest(c).is_none_or(|n| n == best));
    }
    Ok(kept)
}

/// A header equal to `value`, as a condition (`:method`, `:path` and
/// `:authority` as the method, path and host).
fn equals(header: &str, value: &str) -> Condition {
    match header {
        ":method" => Condition::Method(value.into()),
        ":path" => Condition::Path(value.into()),
        ":authority" | "host" => Condition::Host(value.to_ascii_lowercase()),
        other => Condition::HeaderEquals(other.into(), value.into()),
    }
}

/// The rule's `limit` (and `algorithm`, `action`), or why not.
fn limit_fields(limit: &EnvoyLimit, shadow: bool) -> Result<Option<String>, String> {
    if limit.unlimited {
        if shadow {
            return Err("shadow_mode has no effect on an unlimited descriptor".into());
        }
        return Ok(None);
    }
    let (Some(unit), Some(rate)) = (&limit.unit, limit.requests_per_unit) else {
        return Err("rate_limit needs unit and requests_per_unit".into());
    };
    let unit = unit.to_ascii_lowercase();
    if !["second", "minute", "hour", "day"].contains(&unit.as_str()) {
        return Err(format!(
            "unit {} (only second, minute, hour and day convert)",
            crate::yaml::quoted(&unit)
        ));
    }
    let action = if shadow { ", action: shadow" } else { "" };
    Ok(Some(format!(
        "algorithm: fixed_window, limit: {{ rate: {rate}, unit: {unit} }}{action}"
    )))
}

/// A YAML string (JSON's quoting is YAML's).
fn q(text: &str) -> String {
    serde_json::to_string(text).expect("a string serialises")
}

/// One rule, in flow style.
fn rule_text(name: &str, draft: &Draft, limit: &Option<String>) -> String {
    let mut matches = Vec::new();
    if let Some(source) = draft.source {
        matches.push(format!("source: {}", q(&source.to_string())));
    }
    let mut methods = Vec::new();
    let mut headers = Vec::new();
    for condition in &draft.conditions {
        match condition {
            Condition::Method(m) => methods.push(q(m)),
            Condition::Host(h) => matches.push(format!("host: {}", q(h))),
            Condition::Path(p) => matches.push(format!("path: {}", q(p))),
            Condition::PathPrefix(p) => matches.push(format!("path_prefix: {}", q(p))),
            Condition::HeaderEquals(n, v) => {
                headers.push(format!("{{ name: {}, equals: {} }}", q(n), q(v)))
            }
            Condition::HeaderPresent(n, present) => {
                headers.push(format!("{{ name: {}, present: {present} }}", q(n)))
            }
        }
    }
    if !methods.is_empty() {
        matches.push(format!("method: [{}]", methods.join(", ")));
    }
    if !headers.is_empty() {
        matches.push(format!("headers: [{}]", headers.join(", ")));
    }
    // Two conditions on one field (a route's and an action's) are two keys
    // of the flow mapping: the rule then fails to parse, and is listed.
    let matches = if matches.is_empty() {
        String::new()
    } else {
        format!(", match: {{ {} }}", matches.join(", "))
    };
    match limit {
        None => format!("  - {{ name: {name}{matches}, limit: unlimited }}\n"),
        Some(limit) => {
            let key: Vec<String> = draft.key.iter().map(|k| q(k)).collect();
            format!(
                "  - {{ name: {name}{matches}, key: [{}], {limit} }}\n",
                key.join(", ")
            )
        }
    }
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
mod tests;
