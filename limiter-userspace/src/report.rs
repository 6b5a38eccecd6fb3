//! Plain, aligned terminal output with units.

use std::{fmt::Write, time::Duration};

use crate::{
    config::{Limit, Meter, Rule, RuleSet},
    stats::Snapshot,
};

/// `1234567` -> `1,234,567`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes with a decimal unit: `1.5 MB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A unit of time as a rate's denominator: `s`, `min`, `h`, `day`, or `30s`.
pub fn per(period: Duration) -> String {
    match period.as_secs() {
        1 if period.subsec_nanos() == 0 => "s".into(),
        60 if period.subsec_nanos() == 0 => "min".into(),
        3600 if period.subsec_nanos() == 0 => "h".into(),
        86_400 if period.subsec_nanos() == 0 => "day".into(),
        _ => humantime::format_duration(period).to_string(),
    }
}

/// Renders rows as columns: the first left-aligned, the rest right-aligned.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(out, "{cell:<w$}");
            } else {
                let _ = write!(out, "  {cell:>w$}");
            }
        }
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

pub fn stats_table(snapshot: &Snapshot) -> String {
    let rows: Vec<Vec<String>> = snapshot
        .rules
        .iter()
        .map(|r| {
            let c = &r.counters;
            vec![
                r.name.clone(),
                count(c.passed_packets),
                bytes(c.passed_bytes),
                count(c.dropped_packets),
                bytes(c.dropped_bytes),
                count(c.shadow_packets),
                count(c.new_keys),
            ]
        })
        .collect();
    let g = &snapshot.global;
    let mut out = table(
        &[
            "RULE",
            "PASSED pkts",
            "PASSED",
            "DROPPED pkts",
            "DROPPED",
            "SHADOW pkts",
            "NEW KEYS",
        ],
        &rows,
    );
    let _ = writeln!(
        out,
        "\npackets {}  ipv4 {}  ipv6 {}  non-ip {}  malformed {}  fragments {}  key-alloc-failed {}",
        count(g.packets),
        count(g.ipv4),
        count(g.ipv6),
        count(g.non_ip),
        count(g.malformed),
        count(g.fragments),
        count(g.key_alloc_failed),
    );
    let k = &snapshot.keys;
    let _ = writeln!(
        out,
        "key map: capacity {} keys, {} of kernel memory ({} B per key)",
        count(k.capacity),
        bytes(k.memory_bytes),
        k.memory_bytes.checked_div(k.capacity).unwrap_or(0),
    );
    out
}

/// One line: rates over the last interval, and totals.
pub fn summary_line(previous: &Snapshot, now: &Snapshot, interval: Duration) -> String {
    let total = |s: &Snapshot, f: fn(&limiter_common::abi::RuleCounters) -> u64| {
        s.rules.iter().map(|r| f(&r.counters)).sum::<u64>()
    };
    let rate = |f: fn(&limiter_common::abi::RuleCounters) -> u64| {
        let delta = total(now, f).saturating_sub(total(previous, f));
        count((delta as f64 / interval.as_secs_f64().max(1e-3)).round() as u64)
    };
    format!(
        "passed {} pkt/s  dropped {} pkt/s  shadow {} pkt/s  | totals: passed {} pkts, dropped {} pkts, new keys {}, malformed {}",
        rate(|c| c.passed_packets),
        rate(|c| c.dropped_packets),
        rate(|c| c.shadow_packets),
        count(total(now, |c| c.passed_packets)),
        count(total(now, |c| c.dropped_packets)),
        count(total(now, |c| c.new_keys)),
        count(now.global.malformed),
    )
}

pub fn rules_table(set: &RuleSet) -> String {
    let rows: Vec<Vec<String>> = set.rules.iter().map(rule_row).collect();
    let mut out = table(
        &["RULE", "MATCH", "KEY", "LIMIT", "AGGREGATE", "ON EXCESS"],
        &rows,
    );
    let verdict = |v: crate::config::Verdict| format!("{v:?}").to_lowercase();
    let _ = writeln!(
        out,
        "\nunmatched traffic: {}   malformed frames: {}   key capacity: {} keys",
        verdict(set.default),
        verdict(set.malformed),
        count(u64::from(set.max_keys))
    );
    out
}

fn rule_row(rule: &Rule) -> Vec<String> {
    let d = describe(rule);
    vec![
        rule.name.clone(),
        d.matches,
        d.key,
        d.limit,
        d.aggregate,
        d.action,
    ]
}

/// A rule in words, one field per column.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Description {
    pub matches: String,
    pub key: String,
    pub limit: String,
    pub aggregate: String,
    pub action: String,
}

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
    let meters = |packets: Option<Meter>, bytes: Option<Meter>| {
        // Windows and logs admit `rate` per window: no burst to show.
        let meter = |m: Meter, what: &str| match rule.algorithm {
            crate::config::Algorithm::Gcra => {
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
            packets.map(|m| meter(m, "pkts")),
            bytes.map(|m| meter(m, "bytes")),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" + ")
    };
    Description {
        matches: matches.join(" "),
        key: format!("/{} v4, /{} v6", rule.key.v4, rule.key.v6),
        limit: match rule.limit {
            Limit::Unlimited => "unlimited".to_owned(),
            Limit::Metered { packets, bytes } => meters(packets, bytes),
        },
        aggregate: rule
            .aggregate
            .map_or("-".into(), |a| meters(a.packets, a.bytes)),
        action: match (rule.limit, rule.shadow) {
            (Limit::Unlimited, _) => "-".into(),
            (_, true) => "shadow".into(),
            (_, false) => "drop".into(),
        },
    }
}

/// `limiter rules show`: the active rules with ids and counters, and blocks.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RulesView {
    pub generation: u32,
    /// Global dry run.
    pub shadow: bool,
    pub rules: Vec<RuleView>,
    pub blocks: Vec<crate::engine::BlockView>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RuleView {
    pub id: u32,
    pub name: String,
    #[serde(flatten)]
    pub description: Description,
    pub passed_packets: u64,
    pub dropped_packets: u64,
    pub shadow_packets: u64,
    pub new_keys: u64,
}

pub fn rules_view(engine: &crate::engine::Engine) -> anyhow::Result<RulesView> {
    let snapshot = engine.snapshot()?;
    let (set, ids) = engine
        .applied()
        .ok_or_else(|| anyhow::anyhow!("no rules applied yet"))?;
    let rules = set
        .rules
        .iter()
        .zip(ids)
        .map(|(rule, &id)| {
            let c = snapshot
                .rules
                .iter()
                .find(|r| r.id == id)
                .map(|r| r.counters)
                .unwrap_or_default();
            RuleView {
                id,
                name: rule.name.clone(),
                description: describe(rule),
                passed_packets: c.passed_packets,
                dropped_packets: c.dropped_packets,
                shadow_packets: c.shadow_packets,
                new_keys: c.new_keys,
            }
        })
        .collect();
    Ok(RulesView {
        generation: snapshot.generation,
        shadow: snapshot.shadow,
        rules,
        blocks: engine.blocks()?,
    })
}

pub fn rules_view_text(view: &RulesView) -> String {
    let rows: Vec<Vec<String>> = view
        .rules
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                r.id.to_string(),
                r.description.matches.clone(),
                r.description.limit.clone(),
                r.description.aggregate.clone(),
                r.description.action.clone(),
                count(r.passed_packets),
                count(r.dropped_packets),
                count(r.shadow_packets),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "RULE",
            "ID",
            "MATCH",
            "LIMIT",
            "AGGREGATE",
            "ON EXCESS",
            "PASSED pkts",
            "DROPPED pkts",
            "SHADOW pkts",
        ],
        &rows,
    );
    let _ = writeln!(
        out,
        "\ngeneration {}   global dry run: {}",
        view.generation,
        if view.shadow { "on" } else { "off" }
    );
    if view.blocks.is_empty() {
        out.push_str("blocks: none\n");
    } else {
        let rows: Vec<Vec<String>> = view
            .blocks
            .iter()
            .map(|b| {
                vec![
                    b.prefix.clone(),
                    match (b.expired, b.expires_in_secs) {
                        (true, _) => "expired".into(),
                        (_, None) => "never".into(),
                        (_, Some(s)) => format!("in {s:.0} s"),
                    },
                    count(b.dropped_packets),
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&table(
            &["BLOCKED PREFIX", "EXPIRES", "DROPPED pkts"],
            &rows,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_have_units_and_separators() {
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(1_500_000), "1.5 MB");
        assert_eq!(per(Duration::from_secs(60)), "min");
        assert_eq!(per(Duration::from_secs(30)), "30s");
    }

    #[test]
    fn tables_align() {
        let t = table(&["A", "BB"], &[vec!["long".into(), "1".into()]]);
        assert_eq!(t, "A     BB\nlong   1\n");
    }
}
