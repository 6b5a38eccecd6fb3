//! `limiter top`: the keys (sources) with the most drops and their current
//! rates, from two batched reads of the state map an interval apart.

use std::{
    collections::HashMap,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use limiter::{
    kernel::{Maps, keys::KeyTable, maps::named_rules, require_root},
    render::text,
    units,
};
use limiter_common::abi::{FlowKey, KeyState, RuleConfig};
use serde::Serialize;

#[derive(Serialize)]
struct Row {
    source: String,
    rule: String,
    dropped_per_sec: f64,
    passed_per_sec: f64,
    dropped_total: u64,
    passed_total: u64,
    /// A block (`limiter block`, or escalation) covers the key's source:
    /// its packets are dropped before any rule, and no longer counted here.
    blocked: bool,
}

pub fn run(pin_dir: &Path, count: usize, interval: Duration, once: bool, json: bool) -> Result<()> {
    require_root()?;
    let maps = Maps::open_pinned(pin_dir)?;
    let (config, rules) = (&maps.config, &maps.rules);
    let mut previous: HashMap<FlowKey, KeyState> = maps.keys.dump().into_iter().collect();
    // A key's counters are 32-bit (`KeyState::passed_packets`): its totals
    // are summed here from one reading to the next.
    let mut totals: HashMap<FlowKey, (u64, u64)> = previous
        .iter()
        .map(|(key, state)| {
            let counts = (state.passed_packets.into(), state.dropped_packets.into());
            (*key, counts)
        })
        .collect();
    let mut at = Instant::now();
    loop {
        thread::sleep(interval);
        let now: HashMap<FlowKey, KeyState> = maps.keys.dump().into_iter().collect();
        let elapsed = at.elapsed().as_secs_f64();
        at = Instant::now();
        let generation = config.get(&0, 0)?.generation;
        let names: HashMap<u32, RuleConfig> = named_rules(rules, generation)?.into_iter().collect();
        let mut rows: Vec<Row> = now
            .iter()
            .map(|(key, state)| {
                let before = previous.get(key).copied().unwrap_or_default();
                let rule = names.get(&key.rule_id());
                let passed = counted_since(before.passed_packets, state.passed_packets);
                let dropped = counted_since(before.dropped_packets, state.dropped_packets);
                let total = totals.entry(*key).or_default();
                total.0 += passed;
                total.1 += dropped;
                Row {
                    blocked: blocked(&maps, &KeyTable::prefix_of(key, rule)),
                    source: source(key, rule),
                    rule: rule.map_or(format!("#{} (removed)", key.rule_id()), name),
                    dropped_per_sec: dropped as f64 / elapsed,
                    passed_per_sec: passed as f64 / elapsed,
                    dropped_total: total.1,
                    passed_total: total.0,
                }
            })
            .collect();
        rows.sort_by(|a, b| {
            b.dropped_per_sec
                .total_cmp(&a.dropped_per_sec)
                .then(b.dropped_total.cmp(&a.dropped_total))
        });
        let tracked = rows.len();
        rows.truncate(count);
        if json {
            println!(
                "{}",
                serde_json::json!({ "tracked_keys": tracked, "top": rows })
            );
        } else {
            if !once {
                // Clear the screen and go home, like top(1).
                print!("\x1b[2J\x1b[H");
            }
            println!(
                "{tracked} tracked keys; top {} by drops over the last {elapsed:.1} s\n",
                rows.len()
            );
            let table: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        if r.blocked {
                            format!("{} (blocked)", r.source)
                        } else {
                            r.source.clone()
                        },
                        r.rule.clone(),
                        units::count(r.dropped_per_sec.round() as u64),
                        units::count(r.passed_per_sec.round() as u64),
                        units::count(r.dropped_total),
                        units::count(r.passed_total),
                    ]
                })
                .collect();
            print!(
                "{}",
                text::table(
                    &[
                        "SOURCE",
                        "RULE",
                        "DROPPED pkt/s",
                        "PASSED pkt/s",
                        "DROPPED",
                        "PASSED"
                    ],
                    &table
                )
            );
        }
        if once {
            return Ok(());
        }
        totals.retain(|key, _| now.contains_key(key));
        previous = now;
    }
}

fn name(rule: &RuleConfig) -> String {
    String::from_utf8_lossy(rule.name()).into_owned()
}

/// Whether a block covers the prefix's first address.
fn blocked(maps: &Maps, net: &ipnet::IpNet) -> bool {
    use aya::maps::lpm_trie::Key;
    let block = match net.network() {
        std::net::IpAddr::V4(a) => maps.blocks_v4.get(&Key::new(32, a.octets()), 0),
        std::net::IpAddr::V6(a) => maps.blocks_v6.get(&Key::new(128, a.octets()), 0),
    };
    let now = limiter::clock::monotonic_ns();
    block.is_ok_and(|b| b.expires_ns == 0 || b.expires_ns > now)
}

/// The key as a prefix: `198.18.0.1`, or `2001:db8:1::/64` for a /64 key.
fn source(key: &FlowKey, rule: Option<&RuleConfig>) -> String {
    let net = KeyTable::prefix_of(key, rule);
    if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.to_string()
    }
}

/// What a key's 32-bit counter counted between two readings: the wrapping
/// difference, unless that is implausible for one interval (more than
/// 2^31), which means the key was forgotten and created again: then all
/// it counted since.
fn counted_since(before: u32, now: u32) -> u64 {
    let difference = now.wrapping_sub(before);
    if difference > 1 << 31 {
        now.into()
    } else {
        difference.into()
    }
}

#[cfg(test)]
mod tests {
    use super::counted_since;

    #[test]
    fn counters_wrap_and_keys_come_back() {
        assert_eq!(counted_since(10, 25), 15);
        assert_eq!(counted_since(u32::MAX - 4, 5), 10);
        // Created again with 7 counted: not 2^32 - 93.
        assert_eq!(counted_since(100, 7), 7);
    }
}
