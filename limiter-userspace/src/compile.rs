//! Compiles a validated rule set into the kernel's tables: one rule slot per
//! rule (slot 0 is the default) and, per source prefix, the rules that may
//! apply to it in the order [`crate::rules::matching`] defines.

pub mod v4_table;

use std::net::IpAddr;

use ipnet::IpNet;
use limiter_common::{
    abi::{
        Candidate, Candidates, CostClass, Costs, DEFAULT_RULE, MAX_CANDIDATES, MeterConfig,
        PrefixKey, RULE_NAME_LEN, RuleConfig, UNKNOWN_PROTOCOL, action, algorithm, candidate_flag,
        rule_flag, unknown_port,
    },
    gcra::Gcra,
};

use crate::rules::{
    Algorithm, Fallback, FragmentPolicy, Limit, Rate, Rule, RuleSet,
    matching::{all_prefixes, covering_rules, key_masks},
};
use v4_table::V4Table;

/// Everything the kernel needs for one generation of a rule set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    /// `action` for malformed frames.
    pub malformed_action: u32,
    /// `fragments: drop`: later fragments whose first was not seen are
    /// dropped (`GlobalConfig::flags`).
    pub drop_orphan_fragments: bool,
    /// (rule id, config); id [`DEFAULT_RULE`] is the default.
    pub rules: Vec<(u32, RuleConfig)>,
    /// IPv4: the generation's table, whole.
    pub v4: V4Table,
    /// IPv6: (LPM prefix length, key, value), the generation in the key's
    /// first byte.
    pub v6: Vec<(u32, PrefixKey<16>, Candidates)>,
    /// (rule id, meter of the key state's third word) of the rules with a
    /// soft limit or a third limit (`SOFT_LIMITS`).
    pub third_word: Vec<(u32, Gcra)>,
    /// (rule id, packet classes and their credits) of the rules with a
    /// `cost` by TCP flags.
    pub costs: Vec<(u32, Costs)>,
}

/// Builds generation `generation` of `set`, whose rule `i` has id `ids[i]`.
pub fn build(set: &RuleSet, ids: &[u32], generation: u8) -> Tables {
    assert_eq!(ids.len(), set.rules.len(), "one id per rule");
    let default = RuleConfig {
        flags: match set.default {
            Fallback::Pass => rule_flag::UNLIMITED,
            Fallback::Drop => rule_flag::BLOCK,
        },
        name: name_bytes("default"),
        ..RuleConfig::default()
    };
    let mut rules = vec![(DEFAULT_RULE, default)];
    rules.extend(
        set.rules
            .iter()
            .zip(ids)
            .map(|(rule, &id)| (id, rule_config(rule, &set.new_keys))),
    );
    let mut tables = Tables {
        malformed_action: match set.malformed {
            Fallback::Pass => action::PASS,
            Fallback::Drop => action::DROP,
        },
        drop_orphan_fragments: set.fragments == FragmentPolicy::Drop,
        rules,
        v4: V4Table::default(),
        v6: Vec::new(),
        third_word: set
            .rules
            .iter()
            .zip(ids)
            .filter_map(|(rule, &id)| {
                let meter = rule.soft.or(rule.third.map(|t| t.rate))?;
                Some((id, meter.gcra))
            })
            .collect(),
        costs: set
            .rules
            .iter()
            .zip(ids)
            .filter_map(|(rule, &id)| Some((id, kernel_costs(rule)?)))
            .collect(),
    };
    let mut v4 = Vec::new();
    for (net, candidates) in prefixes(set, ids) {
        // The generation goes first in the key: 8 more bits to match.
        let prefix_len = 8 + u32::from(net.prefix_len());
        match net.addr() {
            IpAddr::V4(a) => v4.push((a.octets(), net.prefix_len(), candidates)),
            IpAddr::V6(a) => {
                let key = PrefixKey {
                    generation,
                    addr: a.octets(),
                };
                tables.v6.push((prefix_len, key, candidates));
            }
        }
    }
    tables.v4 = V4Table::build(u32::from(generation), &v4);
    tables
}

fn rule_config(rule: &Rule, new_keys: &Rate) -> RuleConfig {
    let (v4_key_mask, v6_key_mask) = key_masks(rule);
    let mut config = RuleConfig {
        name: name_bytes(&rule.name),
        fingerprint: rule.fingerprint(),
        identity: rule.identity(),
        v4_key_mask,
        v6_key_mask,
        admission: new_keys.gcra,
        ..RuleConfig::default()
    };
    if rule.shadow {
        config.flags |= rule_flag::SHADOW;
    }
    config.algorithm = match rule.algorithm {
        Algorithm::Gcra => algorithm::GCRA,
        Algorithm::FixedWindow => algorithm::FIXED_WINDOW,
        // Layer 7 only: `Engine::apply` refuses it before building tables.
        Algorithm::SlidingLog => algorithm::SLIDING_WINDOW,
        Algorithm::SlidingWindow => algorithm::SLIDING_WINDOW,
    };
    let meter = |m: Rate| MeterConfig {
        gcra: m.gcra,
        window: m.window,
    };
    match rule.limit {
        Limit::Unlimited => config.flags |= rule_flag::UNLIMITED,
        Limit::Metered { packets, bytes } => {
            if let Some(m) = packets {
                config.flags |= rule_flag::LIMIT_PACKETS;
                config.packets = meter(m);
            }
            if let Some(m) = bytes {
                config.flags |= rule_flag::LIMIT_BYTES;
                config.bytes = meter(m);
            }
        }
    }
    if rule.soft.is_some() {
        // Its meter is in `Tables::third_word`.
        config.flags |= rule_flag::SOFT;
    }
    if let Some(third) = rule.third {
        // Its meter is in `Tables::third_word` too (never with `soft`).
        config.flags |= rule_flag::THIRD_LIMIT;
        if third.counts_bytes {
            config.flags |= rule_flag::THIRD_COUNTS_BYTES;
        }
    }
    if let Some(second) = rule.second_packets {
        // In the byte meter's place, counting packets (validation keeps a
        // rule with a second packet limit from having a byte limit).
        config.flags |= rule_flag::LIMIT_BYTES | rule_flag::BYTES_COUNT_PACKETS;
        config.bytes = meter(second);
    }
    if rule.costs.iter().any(|c| c.tcp_flags.is_some()) {
        // Its classes are in `Tables::costs`.
        config.flags |= rule_flag::COSTS;
    }
    if let Some(aggregate) = rule.aggregate {
        if let Some(m) = aggregate.packets {
            config.flags |= rule_flag::AGGREGATE_PACKETS;
            config.aggregate_packets = meter(m);
            if let Some(fleet) = rule.fleet {
                // The reserve until leases say more (`Engine::set_fleet_share`).
                config.fleet_reserve = meter(m.share(fleet.reserve));
                config.aggregate_packets = config.fleet_reserve;
                config.fleet_until_ns = 1;
            }
        }
        if let Some(m) = aggregate.bytes {
            config.flags |= rule_flag::AGGREGATE_BYTES;
            config.aggregate_bytes = meter(m);
        }
    }
    config
}

/// A rule's classes by TCP flags, as the kernel reads them; `None` when it
/// has none (its classes of requests are layer 7's).
fn kernel_costs(rule: &Rule) -> Option<Costs> {
    let mut costs = Costs::default();
    for class in &rule.costs {
        let Some(flags) = class.tcp_flags else {
            continue;
        };
        costs.classes[costs.len as usize] = CostClass {
            credits: u32::try_from(class.credits).unwrap_or(u32::MAX),
            tcp_flags_mask: flags.mask,
            tcp_flags_value: flags.value,
            _pad: [0; 2],
        };
        costs.len += 1;
    }
    (costs.len > 0).then_some(costs)
}

fn name_bytes(name: &str) -> [u8; RULE_NAME_LEN] {
    let mut bytes = [0; RULE_NAME_LEN];
    let len = name.len().min(RULE_NAME_LEN - 1);
    bytes[..len].copy_from_slice(&name.as_bytes()[..len]);
    bytes
}

/// Trie entries: each source prefix and the rules that may apply under it.
fn prefixes(set: &RuleSet, ids: &[u32]) -> Vec<(IpNet, Candidates)> {
    let entries = all_prefixes(set).into_iter().map(|net| {
        let mut candidates = Candidates::default();
        let covering: Vec<usize> = covering_rules(set, net)
            .into_iter()
            .take(MAX_CANDIDATES)
            .collect();
        for (slot, &i) in covering.iter().enumerate() {
            candidates.entries[slot] = candidate(ids[i], &set.rules[i]);
            candidates.len = slot as u32 + 1;
        }
        for (class, protocol) in unknown_port::CLASSES {
            candidates.unknown_port[class] = strictest(set, &covering, &candidates, protocol);
        }
        (net, candidates)
    });
    entries.collect()
}

/// The strictest rule a packet of `protocol` whose port is unknown may
/// belong to, as `Candidates::unknown_port` encodes it: the candidates it
/// may match up to the first it surely matches (the default rule too if
/// none), the one of least `Rule::bytes_per_second_bound`, the most
/// specific of equals. Charging the first it may match instead let a
/// datagram sent first fragment last put its bulk on a looser rule than
/// its port's.
fn strictest(set: &RuleSet, covering: &[usize], candidates: &Candidates, protocol: u8) -> u8 {
    let mut best: Option<(u8, f64)> = None;
    let mut consider = |choice: u8, bound: f64| {
        // Strictly less: the earlier (more specific) of equals stays.
        if best.is_none_or(|(_, least)| bound < least) {
            best = Some((choice, bound));
        }
    };
    for (slot, (&i, c)) in covering.iter().zip(&candidates.entries).enumerate() {
        if !c.may_match_unknown_port(protocol) {
            continue;
        }
        consider(slot as u8 + 1, set.rules[i].bytes_per_second_bound());
        let names = |flag| c.flags & flag != 0;
        let protocol_matches = !names(candidate_flag::MATCH_PROTOCOL)
            || (protocol != UNKNOWN_PROTOCOL && c.protocol == protocol);
        if protocol_matches
            && !names(candidate_flag::MATCH_DEST_PORT)
            && !names(candidate_flag::MATCH_TCP_FLAGS)
        {
            // Surely this one's, if no earlier one's: the rest never apply.
            return best.map_or(unknown_port::DEFAULT, |(choice, _)| choice);
        }
    }
    consider(
        unknown_port::DEFAULT,
        match set.default {
            Fallback::Pass => f64::INFINITY,
            Fallback::Drop => 0.0,
        },
    );
    best.map_or(unknown_port::DEFAULT, |(choice, _)| choice)
}

fn candidate(id: u32, rule: &Rule) -> Candidate {
    let mut flags = 0;
    if rule.matches.protocol.is_some() {
        flags |= candidate_flag::MATCH_PROTOCOL;
    }
    if rule.matches.dest_port.is_some() {
        flags |= candidate_flag::MATCH_DEST_PORT;
    }
    if matches!(rule.limit, Limit::Unlimited) {
        flags |= candidate_flag::UNLIMITED;
    }
    let tcp = rule.matches.tcp_flags.unwrap_or_default();
    if rule.matches.tcp_flags.is_some() {
        flags |= candidate_flag::MATCH_TCP_FLAGS;
    }
    Candidate {
        rule: u16::try_from(id).expect("rule ids are below MAX_RULES"),
        dest_port: rule.matches.dest_port.unwrap_or(0),
        protocol: rule.matches.protocol.unwrap_or(0),
        flags,
        tcp_flags_mask: tcp.mask,
        tcp_flags_value: tcp.value,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// Generation 1, rule i with id 10 + i.
    fn tables(text: &str) -> Tables {
        let set = RuleSet::parse(text, Path::new("t.yaml")).unwrap();
        let ids: Vec<u32> = (0..set.rules.len() as u32).map(|i| 10 + i).collect();
        build(&set, &ids, 1)
    }

    #[test]
    fn most_specific_candidate_first() {
        let t = tables(
            "rules:
  - { name: all, limit: { rate: 1, unit: second } }
  - { name: net8, match: { source: 10.0.0.0/8 }, limit: { rate: 2, unit: second } }
  - { name: dns, match: { source: 10.0.0.0/8, protocol: udp, dest_port: 53 }, limit: { rate: 3, unit: second } }
  - { name: udp, match: { source: 10.0.0.0/8, protocol: udp }, limit: { rate: 4, unit: second } }
  - { name: net16, match: { source: 10.1.0.0/16 }, limit: unlimited }
",
        );
        let net16 = t.v4.candidates([10, 1, 0, 0]);
        let order: Vec<u16> = net16.entries[..net16.len as usize]
            .iter()
            .map(|c| c.rule)
            .collect();
        // net16, then dns, udp, net8 of the covering /8, then the catch-all.
        assert_eq!(order, vec![14, 12, 13, 11, 10]);
        // The catch-all is in the IPv6 table too, alone.
        assert_eq!(t.v6.len(), 1);
        assert_eq!(t.v6[0].2.len, 1);
        assert_eq!(t.rules[5].0, 14);
        assert_eq!(t.rules[5].1.flags, rule_flag::UNLIMITED);
        assert_eq!(t.rules[0].1.flags, rule_flag::UNLIMITED);
    }

    /// A packet whose port is unknown is charged to the strictest rule it
    /// may belong to: not past the first it surely matches, never to an
    /// exemption on a guess, the default when no candidate surely applies.
    #[test]
    fn unknown_ports_go_to_the_strictest_candidate() {
        let text = |default: &str| {
            format!(
                "default: {default}
rules:
  - {{ name: web, match: {{ source: 10.0.0.0/8, protocol: tcp, dest_port: 443 }}, limit: unlimited }}
  - {{ name: dns, match: {{ source: 10.0.0.0/8, protocol: udp, dest_port: 53 }}, limit: {{ rate: 1000, unit: second }} }}
  - {{ name: ssh, match: {{ source: 10.0.0.0/8, protocol: tcp, dest_port: 22 }}, limit: {{ rate: 10, unit: minute }} }}
  - {{ name: discard, match: {{ source: 10.0.0.0/8, protocol: udp, dest_port: 9 }}, limit: {{ bytes: 20000, unit: second }} }}
  - {{ name: udp, match: {{ source: 10.0.0.0/8, protocol: udp }}, limit: {{ rate: 100, unit: second }} }}
  - {{ name: tcp, match: {{ source: 10.0.0.0/8, protocol: tcp }}, limit: {{ rate: 5000, unit: second }} }}
"
            )
        };
        let t = tables(&text("pass"));
        let list = t.v4.candidates([10, 0, 0, 1]);
        let rule_of = |choice: u8| match choice {
            unknown_port::DEFAULT => "default".to_owned(),
            0 => "none".to_owned(),
            i => {
                let id = u32::from(list.entries[usize::from(i) - 1].rule);
                let (_, config) = t.rules.iter().find(|(rid, _)| *rid == id).unwrap();
                String::from_utf8_lossy(config.name())
                    .trim_end_matches('\0')
                    .to_owned()
            }
        };
        let chosen: Vec<String> = list.unknown_port.iter().map(|&c| rule_of(c)).collect();
        // TCP: ssh (250 B/s), not web (an exemption by port) nor tcp (where
        // the search ends). UDP: discard (20 kB/s) over dns and udp (150
        // kB/s). SCTP: no rule names it and none surely matches: the
        // default. An unknown protocol: every candidate but the exemption
        // may be its, none surely: ssh.
        assert_eq!(chosen, ["ssh", "discard", "default", "ssh"]);
        // A default that drops is the strictest of all where it may apply.
        let t = tables(&text("drop"));
        let list = t.v4.candidates([10, 0, 0, 1]);
        assert_eq!(
            list.unknown_port,
            [3, 4, unknown_port::DEFAULT, unknown_port::DEFAULT]
        );
        // Orphans follow the rule file's `fragments`.
        assert!(!t.drop_orphan_fragments);
        assert!(tables("fragments: drop\nrules: []\n").drop_orphan_fragments);
    }

    #[test]
    fn key_masks_follow_the_key() {
        let t = tables(
            "rules:
  - { name: a, match: { source: 2001:db8::/32 }, limit: { rate: 1, unit: second } }
  - { name: b, match: { source: 10.0.0.0/8 }, key: source/24, limit: { rate: 1, unit: second } }
",
        );
        assert_eq!(
            t.rules[1].1.v6_key_mask,
            u128::from(u64::MAX).rotate_left(64).to_be_bytes()
        );
        assert_eq!(t.rules[2].1.v4_key_mask, [255, 255, 255, 0]);
    }
}
