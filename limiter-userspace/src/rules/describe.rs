//! A rule in words (`10.0.0.0/8 udp port 53`, `1,000 pkts/s, burst 100`),
//! as `limiter check`, `rules show` and the lab print it.

use super::{
    raw::Algorithm,
    request::{HeaderCondition, KeyPart, PathMatch, RequestMatch},
    set::{Limit, Rate, Rule},
};
use crate::units::{count, per};

/// A rule in words, one field per column.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Description {
    pub matches: String,
    pub key: String,
    pub limit: String,
    pub aggregate: String,
    pub action: String,
}

/// Describes `rule`, one field per column.
pub fn describe(rule: &Rule) -> Description {
    let m = &rule.matches;
    let mut matches = vec![m.source.map_or("any source".into(), |s| s.to_string())];
    if let Some(p) = m.protocol {
        matches.push(match p {
            6 => "tcp".into(),
            17 => "udp".into(),
            1 => "icmp".into(),
            58 => "icmpv6".into(),
            132 => "sctp".into(),
            other => format!("proto {other}"),
        });
    }
    if let Some(port) = m.dest_port {
        matches.push(format!("port {port}"));
    }
    if let Some(flags) = m.tcp_flags {
        matches.push(format!("flags {}", flags.text()));
    }
    matches.extend(describe_request(&rule.request));
    let rates = |packets: Option<Rate>, bytes: Option<Rate>| {
        // Windows and logs admit `rate` per window: no burst to show.
        let rate = |m: Rate, what: &str| match rule.algorithm {
            Algorithm::Gcra => {
                format!(
                    "{} {what}/{}, burst {}",
                    count(m.rate),
                    per(m.period),
                    count(m.burst)
                )
            }
            other => {
                let name = serde_json::to_value(other)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned));
                format!(
                    "{} {what}/{} ({})",
                    count(m.rate),
                    per(m.period),
                    name.unwrap_or_default()
                )
            }
        };
        [
            packets.map(|m| rate(m, "pkts")),
            bytes.map(|m| rate(m, "bytes")),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" + ")
    };
    Description {
        matches: matches.join(" "),
        key: if rule.keyed_by.is_empty() {
            "one for all".to_owned()
        } else {
            rule.keyed_by
                .iter()
                .map(|part| match part {
                    KeyPart::Source => format!("/{} v4, /{} v6", rule.key.v4, rule.key.v6),
                    other => other.name(),
                })
                .collect::<Vec<_>>()
                .join(" + ")
        },
        limit: {
            let limit = match rule.limit {
                Limit::Unlimited => "unlimited".to_owned(),
                Limit::Metered { packets, bytes } => rates(packets, bytes),
            };
            let limit = match rule.second_packets {
                Some(second) => format!("{limit} + {}", rates(Some(second), None)),
                None => limit,
            };
            let limit = match rule.third {
                Some(t) if t.counts_bytes => format!("{limit} + {}", rates(None, Some(t.rate))),
                Some(t) => format!("{limit} + {}", rates(Some(t.rate), None)),
                None => limit,
            };
            let limit = match rule.soft {
                Some(soft) => format!("{limit} (soft {})", rates(Some(soft), None)),
                None => limit,
            };
            let limit = if rule.costs.is_empty() {
                limit
            } else {
                let classes: Vec<String> = rule
                    .costs
                    .iter()
                    .map(|c| {
                        let what = match c.tcp_flags {
                            Some(flags) => format!("flags {}", flags.text()),
                            None => describe_request(&c.request).join(" "),
                        };
                        format!("{what} = {}", count(c.credits))
                    })
                    .collect();
                format!("{limit} (credits: {}, else 1)", classes.join(", "))
            };
            let limit = match rule.escalate {
                Some(e) => format!(
                    "{limit}; over it {} {} {}",
                    humantime::format_duration(std::time::Duration::from_nanos(e.after_ns)),
                    match rule.escalate_scope {
                        super::raw::EscalateScope::Key => "holds the key",
                        super::raw::EscalateScope::Source => "blocks the source",
                    },
                    humantime::format_duration(std::time::Duration::from_nanos(e.block_ns))
                ),
                None => limit,
            };
            match (rule.concurrent, rule.limit) {
                (None, _) => limit,
                (Some(n), Limit::Unlimited) => format!("{} in flight", count(n.into())),
                (Some(n), _) => format!("{limit}, {} in flight", count(n.into())),
            }
        },
        aggregate: match (rule.aggregate, rule.fleet) {
            (None, _) => "-".into(),
            (Some(a), None) => rates(a.packets, a.bytes),
            (Some(a), Some(fleet)) => format!(
                "fleet {} in {} partitions, reserve {}",
                rates(a.packets, a.bytes),
                fleet.partitions,
                count(fleet.reserve)
            ),
        },
        action: match (rule.limit, rule.shadow) {
            (Limit::Unlimited, _) if rule.concurrent.is_none() => "-".into(),
            (_, true) => "shadow".into(),
            (_, false) => "drop".into(),
        },
    }
}

/// A rule's layer-7 conditions in words (`GET|HEAD host api.example.com
/// path /v1/* x-tier=free`).
fn describe_request(request: &RequestMatch) -> Vec<String> {
    let mut words = Vec::new();
    if !request.methods.is_empty() {
        let methods: Vec<&str> = request.methods.iter().map(|m| m.as_str()).collect();
        words.push(methods.join("|"));
    }
    if let Some(host) = &request.host {
        words.push(format!("host {host}"));
    }
    match &request.path {
        Some(PathMatch::Exact(path)) => words.push(format!("path {path}")),
        Some(PathMatch::Prefix(prefix)) => words.push(format!("path {prefix}*")),
        None => {}
    }
    for header in &request.headers {
        words.push(match &header.condition {
            HeaderCondition::Equals(value) => format!("{}={value}", header.name),
            HeaderCondition::Present => format!("{} present", header.name),
            HeaderCondition::Absent => format!("no {}", header.name),
        });
    }
    words
}

/// A rule's limits and policies as a script reads them (`limiter check
/// --json`): every per-key limit with the unit it counts, in the order
/// the key's meters hold them (packets, then bytes, then the third; each
/// kind shortest unit first), the soft limit, the credit classes, the
/// escalation.
pub fn policies_json(rule: &Rule) -> serde_json::Value {
    let rate = |r: &Rate, counts: &str| {
        serde_json::json!({
            "rate": r.rate,
            "period_ns": u64::try_from(r.period.as_nanos()).unwrap_or(u64::MAX),
            "burst": r.burst,
            "counts": counts,
        })
    };
    let mut limits = Vec::new();
    if let Limit::Metered { packets, bytes } = rule.limit {
        limits.extend(packets.map(|r| rate(&r, "packets")));
        limits.extend(rule.second_packets.map(|r| rate(&r, "packets")));
        limits.extend(bytes.map(|r| rate(&r, "bytes")));
    }
    limits.extend(rule.third.map(|t| {
        let counts = if t.counts_bytes { "bytes" } else { "packets" };
        rate(&t.rate, counts)
    }));
    serde_json::json!({
        "unlimited": matches!(rule.limit, Limit::Unlimited),
        "limits": limits,
        "soft": rule.soft.map(|r| rate(&r, "packets")),
        "costs": rule.costs.iter().map(|c| serde_json::json!({
            "tcp_flags": c.tcp_flags.map(|f| f.text()),
            "request": describe_request(&c.request).join(" "),
            "credits": c.credits,
        })).collect::<Vec<_>>(),
        "escalate": rule.escalate.map(|e| serde_json::json!({
            "after_ns": e.after_ns,
            "block_ns": e.block_ns,
        })),
    })
}
