//! What envoy's route configuration says a descriptor entry is: the
//! `rate_limits` actions of each virtual host and route (`remote_address`,
//! `masked_remote_address`, `request_headers`, `generic_key`,
//! `header_value_match`), and the route's own match (path, prefix,
//! headers) and domains, as conditions the rule file can state.

use serde::Deserialize;

/// A `RouteConfiguration`, as much of it as limits need.
#[derive(Debug, Default, Deserialize)]
pub struct RouteConfig {
    #[serde(default)]
    pub virtual_hosts: Vec<VirtualHost>,
}

#[derive(Debug, Deserialize)]
pub struct VirtualHost {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub domains: Vec<String>,
    #[serde(default)]
    pub rate_limits: Vec<RateLimitActions>,
    #[serde(default)]
    pub routes: Vec<Route>,
}

#[derive(Debug, Deserialize)]
pub struct Route {
    #[serde(rename = "match", default)]
    pub matches: RouteMatch,
    pub route: Option<RouteAction>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RouteMatch {
    pub prefix: Option<String>,
    pub path: Option<String>,
    pub safe_regex: Option<serde_json::Value>,
    pub path_separated_prefix: Option<String>,
    #[serde(default)]
    pub headers: Vec<HeaderMatcher>,
    /// Envoy's default; `false` asks for what a rule cannot.
    pub case_sensitive: Option<bool>,
    /// Any other way a route matches (`query_parameters`, `grpc`,
    /// `runtime_fraction`, ...): a rule without it would match more.
    #[serde(flatten)]
    pub other: std::collections::BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub struct RouteAction {
    #[serde(default)]
    pub rate_limits: Vec<RateLimitActions>,
}

#[derive(Debug, Deserialize)]
pub struct RateLimitActions {
    #[serde(default)]
    pub actions: Vec<serde_json::Value>,
}

/// Envoy's `HeaderMatcher`, the forms that convert (and enough to say
/// which do not).
#[derive(Debug, Deserialize)]
pub struct HeaderMatcher {
    pub name: String,
    pub exact_match: Option<String>,
    pub prefix_match: Option<String>,
    pub string_match: Option<StringMatch>,
    pub present_match: Option<bool>,
    #[serde(default)]
    pub invert_match: bool,
}

#[derive(Debug, Deserialize)]
pub struct StringMatch {
    pub exact: Option<String>,
    pub prefix: Option<String>,
    #[serde(default)]
    pub ignore_case: bool,
}

/// A condition on a request, in the rule file's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Condition {
    Method(String),
    Host(String),
    Path(String),
    PathPrefix(String),
    HeaderEquals(String, String),
    HeaderPresent(String, bool),
}

/// What one action puts in a descriptor, as the rule file can say it.
#[derive(Clone, Debug)]
pub enum Entry {
    /// `remote_address`: the client's address (a key part, or a source
    /// when the descriptor gives a value).
    RemoteAddress,
    /// `request_headers`: the header's value under `key`.
    Header { key: String, header: String },
    /// `generic_key`: always `value` under `key`.
    Generic { key: String, value: String },
    /// `header_value_match`: `value` under `key` when the conditions hold.
    Matched {
        key: String,
        value: String,
        conditions: Vec<Condition>,
    },
    /// What does not convert, and why (the descriptor key it would give,
    /// if known).
    Unsupported { key: Option<String>, why: String },
}

impl Entry {
    /// The descriptor key this entry gives.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::RemoteAddress => Some("remote_address"),
            Self::Header { key, .. } | Self::Generic { key, .. } | Self::Matched { key, .. } => {
                Some(key)
            }
            Self::Unsupported { key, .. } => key.as_deref(),
        }
    }

    /// Whether a descriptor entry `(key, value)` of the service's config
    /// is one this action can give.
    pub fn gives(&self, key: &str, value: Option<&str>) -> bool {
        if self.key() != Some(key) {
            return false;
        }
        match self {
            Self::Generic { value: v, .. } | Self::Matched { value: v, .. } => {
                value.is_none_or(|value| value == v)
            }
            _ => true,
        }
    }
}

/// One list of actions (one descriptor a request may produce), with the
/// conditions of the route it is on and where it is, for messages.
#[derive(Clone, Debug)]
pub struct ActionList {
    pub origin: String,
    /// The route's match, or why it cannot be stated.
    pub conditions: Result<Vec<Condition>, String>,
    pub entries: Vec<Entry>,
}

/// Every action list of the route configuration.
pub fn action_lists(config: &RouteConfig) -> Vec<ActionList> {
    let mut lists = Vec::new();
    for host in &config.virtual_hosts {
        let vhost_origin = format!("virtual host {:?}", host.name);
        let host_conditions = match host.domains.as_slice() {
            [domain] if !domain.contains('*') => {
                vec![Condition::Host(strip_port(domain).to_ascii_lowercase())]
            }
            _ => Vec::new(),
        };
        let add = |lists: &mut Vec<ActionList>,
                   origin: &str,
                   conditions: Result<Vec<Condition>, String>,
                   limits: &[RateLimitActions]| {
            for (i, limit) in limits.iter().enumerate() {
                lists.push(ActionList {
                    origin: format!("{origin}, rate_limits[{i}]"),
                    conditions: conditions.clone(),
                    entries: limit.actions.iter().map(entry).collect(),
                });
            }
        };
        add(
            &mut lists,
            &vhost_origin,
            Ok(host_conditions.clone()),
            &host.rate_limits,
        );
        for (r, route) in host.routes.iter().enumerate() {
            let Some(action) = &route.route else { continue };
            let conditions = route_conditions(&route.matches).map(|mut conditions| {
                conditions.extend(host_conditions.iter().cloned());
                conditions
            });
            let origin = format!("{vhost_origin}, routes[{r}]");
            add(&mut lists, &origin, conditions, &action.rate_limits);
        }
    }
    lists
}

/// Domains that are not one host name, for a note.
pub fn domain_notes(config: &RouteConfig) -> Vec<String> {
    config
        .virtual_hosts
        .iter()
        .filter(|h| {
            h.domains.len() > 1 || h.domains.iter().any(|d| d.contains('*') && d != "*")
        })
        .map(|h| {
            format!(
                "virtual host {:?}: domains {:?} are not one host name: its rules apply to any host",
                h.name, h.domains
            )
        })
        .collect()
}

fn strip_port(domain: &str) -> &str {
    domain.split(':').next().unwrap_or(domain)
}

fn route_conditions(m: &RouteMatch) -> Result<Vec<Condition>, String> {
    if m.safe_regex.is_some() {
        return Err("its route matches paths by regex, which a rule cannot".into());
    }
    // What a rule cannot say is refused, never dropped: a rule without it
    // would apply to more requests than the route.
    if m.path_separated_prefix.is_some() {
        return Err(
            "its route matches path_separated_prefix (the path or below it), which one rule cannot (path_prefix would also match /apix for /api)".into(),
        );
    }
    if m.case_sensitive == Some(false) {
        return Err("its route matches paths without case, which a rule cannot".into());
    }
    if let Some(field) = m.other.keys().next() {
        return Err(format!(
            "its route also matches on {field}, which a rule cannot"
        ));
    }
    let mut conditions = Vec::new();
    match (&m.path, m.prefix.as_ref()) {
        (Some(path), _) => conditions.push(Condition::Path(path.clone())),
        (None, Some(prefix)) if prefix != "/" => {
            conditions.push(Condition::PathPrefix(prefix.clone()))
        }
        _ => {}
    }
    for header in &m.headers {
        conditions.push(header_condition(header)?);
    }
    Ok(conditions)
}

/// A `HeaderMatcher` as a condition (`:method`, `:path`, `:authority` as
/// the method, path and host).
fn header_condition(h: &HeaderMatcher) -> Result<Condition, String> {
    let exact = h
        .exact_match
        .as_ref()
        .or(h.string_match.as_ref().and_then(|s| s.exact.as_ref()));
    let prefix = h
        .prefix_match
        .as_ref()
        .or(h.string_match.as_ref().and_then(|s| s.prefix.as_ref()));
    let unsupported = || {
        format!(
            "header matcher on {:?}: only exact values, a :path prefix and presence convert",
            h.name
        )
    };
    if h.string_match.as_ref().is_some_and(|s| s.ignore_case) {
        return Err(format!(
            "header matcher on {:?} ignores case; a rule compares exactly",
            h.name
        ));
    }
    let name = h.name.to_ascii_lowercase();
    match (exact, prefix, h.present_match, h.invert_match) {
        (Some(v), None, None, false) => Ok(match name.as_str() {
            ":method" => Condition::Method(v.clone()),
            ":path" => Condition::Path(v.clone()),
            ":authority" | "host" => Condition::Host(strip_port(v).to_ascii_lowercase()),
            _ => Condition::HeaderEquals(name, v.clone()),
        }),
        (None, Some(p), None, false) if name == ":path" => Ok(Condition::PathPrefix(p.clone())),
        (None, None, Some(present), invert) if !name.starts_with(':') => {
            Ok(Condition::HeaderPresent(name, present != invert))
        }
        _ => Err(unsupported()),
    }
}

/// One action as an entry.
fn entry(action: &serde_json::Value) -> Entry {
    let Some((kind, body)) = action.as_object().and_then(|o| o.iter().next()) else {
        return Entry::Unsupported {
            key: None,
            why: "an action that is not a mapping".into(),
        };
    };
    let text = |field: &str| body.get(field).and_then(|v| v.as_str()).map(str::to_owned);
    match kind.as_str() {
        "remote_address" => Entry::RemoteAddress,
        "request_headers" => match (text("header_name"), text("descriptor_key")) {
            (Some(header), Some(key)) => {
                if body.get("skip_if_absent").and_then(|v| v.as_bool()) == Some(true) {
                    Entry::Unsupported {
                        key: Some(key),
                        why: "skip_if_absent: a rule keyed by a header does not apply without it"
                            .into(),
                    }
                } else {
                    Entry::Header {
                        key,
                        header: header.to_ascii_lowercase(),
                    }
                }
            }
            _ => Entry::Unsupported {
                key: text("descriptor_key"),
                why: "request_headers needs header_name and descriptor_key".into(),
            },
        },
        "generic_key" => match text("descriptor_value") {
            Some(value) => Entry::Generic {
                key: text("descriptor_key").unwrap_or_else(|| "generic_key".into()),
                value,
            },
            None => Entry::Unsupported {
                key: text("descriptor_key"),
                why: "generic_key needs descriptor_value".into(),
            },
        },
        "header_value_match" => {
            let key = text("descriptor_key").unwrap_or_else(|| "header_match".into());
            let Some(value) = text("descriptor_value") else {
                return Entry::Unsupported {
                    key: Some(key),
                    why: "header_value_match needs descriptor_value".into(),
                };
            };
            if body.get("expect_match").and_then(|v| v.as_bool()) == Some(false) {
                return Entry::Unsupported {
                    key: Some(key),
                    why: "header_value_match with expect_match: false (a rule cannot say \"not all of\")"
                        .into(),
                };
            }
            let headers: Result<Vec<HeaderMatcher>, _> = serde_json::from_value(
                body.get("headers")
                    .cloned()
                    .unwrap_or(serde_json::json!([])),
            );
            let conditions = headers
                .map_err(|e| format!("header_value_match headers: {e}"))
                .and_then(|hs| hs.iter().map(header_condition).collect());
            match conditions {
                Ok(conditions) => Entry::Matched {
                    key,
                    value,
                    conditions,
                },
                Err(why) => Entry::Unsupported {
                    key: Some(key),
                    why,
                },
            }
        }
        "masked_remote_address" => Entry::Unsupported {
            key: Some("masked_remote_address".into()),
            why: "masked_remote_address: a rule's key prefix is per address family (key: source/N \
                  with match.source); write one rule per family"
                .into(),
        },
        other => Entry::Unsupported {
            key: Some(other.to_owned()),
            why: format!("action {other}: no request field a rule can state"),
        },
    }
}
