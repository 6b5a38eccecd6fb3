//! Plain, aligned terminal output with units.

use std::{fmt::Write, time::Duration};

use crate::{
    fleet::node::ShareStatus,
    rules::{Rule, RuleSet, describe::describe},
    units::{bytes, count, per},
    wire::{Mode, RulesView, Snapshot},
};

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
                count(r.over_soft),
                count(c.new_keys),
                count(c.unadmitted),
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
            "OVER SOFT pkts",
            "NEW KEYS",
            "UNADMITTED pkts",
        ],
        &rows,
    );
    let _ = writeln!(
        out,
        "\npackets {}  ipv4 {}  ipv6 {}  non-ip {}  malformed {}  fragments {}  tiny-fragments {}  orphan-fragments {} charged, {} dropped  unreadable-transport {}  key-alloc-failed {}  key-evictions {}",
        count(g.packets),
        count(g.ipv4),
        count(g.ipv6),
        count(g.non_ip),
        count(g.malformed),
        count(g.fragments),
        count(g.tiny_fragments),
        count(snapshot.orphan_fragments.charged),
        count(snapshot.orphan_fragments.dropped),
        count(g.unreadable_transport),
        count(g.key_alloc_failed),
        count(g.key_evictions),
    );
    let attached: Vec<String> = snapshot
        .interfaces
        .iter()
        .filter_map(|i| {
            Some(match i.xdp_mode? {
                Mode::Skb => format!(
                    "{} skb mode (generic: slower than native; sees packets after GRO, which the limiter turns off there)",
                    i.name
                ),
                _ => format!("{} native", i.name),
            })
        })
        .collect();
    if !attached.is_empty() {
        let _ = writeln!(out, "attached: {}", attached.join(", "));
    }
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
    let verdict = |v: crate::rules::Fallback| format!("{v:?}").to_lowercase();
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
    if !view.fleet.is_empty() {
        out.push('\n');
        out.push_str(&fleet_table(&view.fleet));
    }
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
                    b.escalated_by
                        .as_ref()
                        .map_or("limiter block".into(), |rule| {
                            format!("escalated by {rule}")
                        }),
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&table(
            &["BLOCKED PREFIX", "EXPIRES", "DROPPED pkts", "BY"],
            &rows,
        ));
    }
    out
}

/// Each fleet rule's share: this node's and the fleet's.
pub fn fleet_table(shares: &[ShareStatus]) -> String {
    let rows: Vec<Vec<String>> = shares
        .iter()
        .map(|s| {
            let unit = per(Duration::from_secs_f64(s.unit_seconds));
            vec![
                s.rule.clone(),
                format!("{} /{unit}", count(s.local_rate)),
                format!("{} /{unit}", count(s.fleet_rate)),
                format!("{} of {}", s.held, s.partitions),
                format!("{} /{unit}", count(s.reserve)),
                if s.store_up { "up" } else { "down: fallback" }.into(),
                format!("{:.1}", s.store_rtt_seconds * 1e3),
            ]
        })
        .collect();
    table(
        &[
            "FLEET RULE",
            "THIS NODE",
            "FLEET",
            "PARTITIONS",
            "RESERVE",
            "STORE",
            "RTT ms",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let t = table(&["A", "BB"], &[vec!["long".into(), "1".into()]]);
        assert_eq!(t, "A     BB\nlong   1\n");
    }
}
