//! The checks a rule file must pass before anything is applied: every
//! field, across fields (a port needs a protocol), across rules (unique
//! names and matches) and against the kernel's tables (rules per prefix).
//! Errors name the field (`rules[2].limit.rate`); the caller adds the line.

use std::{collections::HashMap, net::IpAddr, time::Duration};

use ipnet::IpNet;
use limiter_common::{
    abi::{DEFAULT_MAX_KEYS, MAX_CANDIDATES, MAX_COST_CLASSES, MAX_KEYS, MAX_RULES, RULE_NAME_LEN},
    gcra::Gcra,
    keytable::MAX_WINDOW_LIMIT,
    window::Window,
};

use super::{
    Algorithm, CostClass, EscalateScope, EscalationPolicy, FleetShare, KeyPart, KeyPrefix, Limit,
    Match, Rate, Rates, RequestMatch, Rule, RuleSet, TcpFlags, ThirdLimit, matching, raw, request,
    request::HeaderCondition,
};
use crate::yaml::quoted;

type Invalid = (String, String);

fn invalid(field: impl Into<String>, message: impl Into<String>) -> Invalid {
    (field.into(), message.into())
}

pub(super) fn rule_set(file: raw::RuleFile) -> Result<RuleSet, Invalid> {
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
        let rule = validate_rule(raw).map_err(|(field, message)| (at(&field), message))?;
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
        Some(fields) => new_keys(fields).map_err(|(field, m)| (format!("new_keys.{field}"), m))?,
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

fn validate_rule(raw: &raw::RuleEntry) -> Result<Rule, Invalid> {
    if raw.name.is_empty() || raw.name.len() >= RULE_NAME_LEN {
        return Err(invalid(
            "name",
            format!("must be 1 to {} bytes long", RULE_NAME_LEN - 1),
        ));
    }
    let given = raw
        .matches
        .source
        .as_deref()
        .map(parse_prefix)
        .transpose()?;
    let source = given.map(|net| net.trunc());
    if let (Some(given), Some(net)) = (given, source)
        && given != net
    {
        return Err(invalid(
            "match.source",
            format!("{given} has host bits set; did you mean {net}?"),
        ));
    }
    let protocol = raw.matches.protocol.map(|p| p.0);
    if raw.matches.dest_port.is_some() && !matches!(protocol, Some(6 | 17 | 132)) {
        return Err(invalid(
            "match.dest_port",
            "needs protocol tcp, udp or sctp",
        ));
    }
    let tcp_flags = match &raw.matches.tcp_flags {
        None => None,
        Some(_) if protocol != Some(6) => {
            return Err(invalid("match.tcp_flags", "needs protocol tcp"));
        }
        Some(text) => Some(tcp_flags(text).map_err(|m| invalid("match.tcp_flags", m))?),
    };
    let matches = Match {
        source,
        protocol,
        dest_port: raw.matches.dest_port,
        tcp_flags,
    };
    let request = request::request_match(&raw.matches)?;
    let (keyed_by, source_key) = match &raw.key {
        None => (vec![KeyPart::Source], None),
        Some(raw::Strings(parts)) => request::key_parts(parts).map_err(|m| invalid("key", m))?,
    };
    let algorithm = raw.algorithm.unwrap_or_default();
    let mut second_packets = None;
    let mut third = None;
    let limit_field = match (&raw.limit, &raw.limits) {
        (Some(_), Some(_)) => {
            return Err(invalid("limits", "give `limit` or `limits`, not both"));
        }
        (None, None) => {
            return Err(invalid(
                "limit",
                "missing: `limit: { rate: 100, unit: second }`, `limit: unlimited`, or `limits: [...]`",
            ));
        }
        (None, Some(list)) => {
            let several = several_limits(list, algorithm)?;
            second_packets = several.second_packets;
            third = several.third;
            several.limit
        }
        (Some(raw::LimitField::Unlimited), None) => Limit::Unlimited,
        (Some(raw::LimitField::Rates(rates)), None) => {
            let m = validate_rates(rates, algorithm).map_err(|(f, m)| (format!("limit.{f}"), m))?;
            key_window_fits(&m).map_err(|(f, m)| (format!("limit.{f}"), m))?;
            Limit::Metered {
                packets: m.packets,
                bytes: m.bytes,
            }
        }
    };
    let limit = match limit_field {
        Limit::Unlimited => {
            let pointless = [
                // A concurrency limit counts per key.
                ("key", raw.key.is_some() && raw.concurrent.is_none()),
                ("action", raw.action.is_some() && raw.concurrent.is_none()),
                ("aggregate", raw.aggregate.is_some()),
                ("algorithm", raw.algorithm.is_some()),
            ];
            if let Some((field, _)) = pointless.iter().find(|(_, set)| *set) {
                return Err(invalid(*field, "has no effect on an unlimited rule"));
            }
            Limit::Unlimited
        }
        metered => metered,
    };
    let delay = match &raw.limit {
        Some(raw::LimitField::Rates(raw::RateFields {
            delay: Some(delay),
            bytes,
            ..
        })) => {
            let field = "limit.delay";
            if algorithm != Algorithm::Gcra || bytes.is_some() || raw.aggregate.is_some() {
                return Err(invalid(
                    field,
                    "pacing needs a gcra packet limit, without bytes or aggregate",
                ));
            }
            Some(
                humantime::parse_duration(delay)
                    .map_err(|e| invalid(field, format!("{}: {e}", quoted(delay))))?,
            )
        }
        _ => None,
    };
    if let Some(raw::LimitField::Rates(fields)) = &raw.limit {
        local_only(fields).map_err(|(f, m)| (format!("limit.{f}"), m))?;
    }
    let aggregate = raw
        .aggregate
        .as_ref()
        .map(|rates| validate_rates(rates, algorithm))
        .transpose()
        .map_err(|(f, m)| (format!("aggregate.{f}"), m))?;
    let soft = raw
        .soft
        .as_ref()
        .map(|fields| soft_limit(fields, &limit, second_packets.as_ref(), algorithm))
        .transpose()?;
    if soft.is_some() && third.is_some() {
        return Err(invalid(
            "soft",
            "a key with three limits has no room for a soft one (its state holds three meters)",
        ));
    }
    let costs = match &raw.cost {
        None => Vec::new(),
        Some(entries) => cost_classes(
            entries,
            &limit,
            aggregate.as_ref(),
            [
                soft.as_ref(),
                second_packets.as_ref(),
                third.filter(|t| !t.counts_bytes).map(|t| t.rate).as_ref(),
            ],
        )?,
    };
    let escalate = raw
        .escalate
        .as_ref()
        .map(|fields| escalation(fields, &limit))
        .transpose()?;
    if escalate.is_some() && delay.is_some() {
        // A paced request is held, not refused: pacing never goes over.
        return Err(invalid(
            "escalate",
            "has no effect with limit.delay (pacing holds requests instead of refusing them)",
        ));
    }
    let key = if keyed_by.is_empty() {
        // `key: all`: one bucket for every packet (request) the rule matches.
        KeyPrefix { v4: 0, v6: 0 }
    } else {
        parse_key(source_key, source).map_err(|m| invalid("key", m))?
    };
    if escalate.is_some() {
        escalation_key(&keyed_by, key)?;
    }
    let escalate_scope = raw
        .escalate
        .as_ref()
        .and_then(|e| e.scope)
        .unwrap_or_default();
    if escalate.is_some() && escalate_scope == EscalateScope::Key && algorithm != Algorithm::Gcra {
        return Err(invalid(
            "escalate.scope",
            "`key` (the default: the rule's own meter holds the key) needs algorithm gcra; `scope: source` blocks the whole source, which forged packets can make happen",
        ));
    }
    let fleet = match (&raw.aggregate, aggregate) {
        (Some(fields), Some(rates)) => {
            fleet_share(fields, &rates).map_err(|(f, m)| (format!("aggregate.{f}"), m))?
        }
        _ => None,
    };
    Ok(Rule {
        name: raw.name.clone(),
        matches,
        request,
        key,
        keyed_by,
        limit,
        aggregate,
        soft,
        second_packets,
        third,
        costs,
        escalate,
        escalate_scope,
        algorithm,
        delay,
        shadow: raw.action == Some(raw::Excess::Shadow),
        fleet,
        concurrent: match raw.concurrent {
            Some(0) => return Err(invalid("concurrent", "must be at least 1")),
            other => other,
        },
    })
}

/// `syn`, `syn,!ack`, `rst`: each flag named is set, or with `!` clear.
fn tcp_flags(text: &str) -> Result<TcpFlags, String> {
    let mut flags = TcpFlags::default();
    for part in text.split(',').map(str::trim) {
        let (clear, name) = match part.strip_prefix('!') {
            Some(name) => (true, name.trim()),
            None => (false, part),
        };
        let bit = TcpFlags::NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                format!(
                    "{}: {name:?} is not a TCP flag (one of {}, each maybe with `!`, comma-separated)",
                    quoted(text),
                    TcpFlags::NAMES.join(", ")
                )
            })?;
        if flags.mask & (1 << bit) != 0 {
            return Err(format!("{}: {name} named twice", quoted(text)));
        }
        flags.mask |= 1 << bit;
        if !clear {
            flags.value |= 1 << bit;
        }
    }
    Ok(flags)
}

/// A `soft` limit: a packet rate, on a GCRA rule, below a hard packet
/// limit (at most its rate and its burst, and not both the same); with
/// two, below either (`second`: the second).
fn soft_limit(
    fields: &raw::RateFields,
    limit: &Limit,
    second: Option<&Rate>,
    algorithm: Algorithm,
) -> Result<Rate, Invalid> {
    if algorithm != Algorithm::Gcra {
        return Err(invalid(
            "soft",
            "needs algorithm gcra (a window key's state has no room for a third meter)",
        ));
    }
    let Limit::Metered {
        packets: Some(hard),
        ..
    } = limit
    else {
        return Err(invalid(
            "soft",
            "needs a hard packet limit to be below: `limit: { rate: ... }`",
        ));
    };
    let stray = [
        ("bytes", fields.bytes.is_some()),
        ("burst_bytes", fields.burst_bytes.is_some()),
        ("delay", fields.delay.is_some()),
    ];
    if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
        return Err(invalid(
            format!("soft.{field}"),
            "a soft limit is a packet (request) rate: `rate`, `unit` and `burst`",
        ));
    }
    local_only(fields).map_err(|(f, m)| (format!("soft.{f}"), m))?;
    let rates = validate_rates(fields, algorithm).map_err(|(f, m)| (format!("soft.{f}"), m))?;
    let soft = rates
        .packets
        .ok_or_else(|| invalid("soft.rate", "a soft limit needs `rate`"))?;
    // A longer emission interval is a lower rate.
    let below = |hard: &Rate| {
        soft.gcra.emission_ns >= hard.gcra.emission_ns
            && soft.burst <= hard.burst
            && (soft.gcra.emission_ns, soft.burst) != (hard.gcra.emission_ns, hard.burst)
    };
    if !below(hard) && !second.is_some_and(below) {
        return Err(invalid(
            "soft",
            format!(
                "{} per {} with a burst of {} is not below the hard limit ({} per {}, burst {})",
                soft.rate,
                humantime::format_duration(soft.period),
                soft.burst,
                hard.rate,
                humantime::format_duration(hard.period),
                hard.burst
            ),
        ));
    }
    Ok(soft)
}

/// What `limits: [...]` asks of a key's meters.
struct SeveralLimits {
    limit: Limit,
    second_packets: Option<Rate>,
    third: Option<ThirdLimit>,
}

/// `limits: [...]`: every packet must pass them all, kept shortest unit
/// first (the first is the one `RateLimit-Policy` names). Three at most, as a
/// key's state holds three meters: the first packet rate in the packet
/// meter, the first byte rate (or else the second packet rate) in the
/// byte meter, any third in the state's third word (GCRA only: a window
/// key's state is full with two). No pacing (`delay`) and no fleet fields.
fn several_limits(
    list: &[raw::RateFields],
    algorithm: Algorithm,
) -> Result<SeveralLimits, Invalid> {
    let mut packets: Vec<Rate> = Vec::new();
    let mut bytes: Vec<Rate> = Vec::new();
    for (i, fields) in list.iter().enumerate() {
        let at = |f: &str| format!("limits[{i}].{f}");
        if fields.delay.is_some() {
            return Err(invalid(
                at("delay"),
                "pacing takes one `limit`, not `limits`",
            ));
        }
        local_only(fields).map_err(|(f, m)| (at(&f), m))?;
        let m = validate_rates(fields, algorithm).map_err(|(f, m)| (at(&f), m))?;
        key_window_fits(&m).map_err(|(f, m)| (at(&f), m))?;
        packets.extend(m.packets);
        bytes.extend(m.bytes);
    }
    // Shortest unit first, whatever the file's order: each limit keeps
    // its meter word when the list is reordered (a limit change carries
    // each word's state over to the limit now in it).
    for rates in [&mut packets, &mut bytes] {
        rates.sort_by_key(|r| (r.period, r.rate, r.burst));
    }
    let count = packets.len() + bytes.len();
    if list.is_empty() || count > 3 || bytes.len() > 2 {
        return Err(invalid(
            "limits",
            "one to three limits per key, two byte rates at most: a key's state holds three meters",
        ));
    }
    if algorithm != Algorithm::Gcra && (count > 2 || bytes.len() > 1) {
        return Err(invalid(
            "limits",
            "a window key holds two meters (two packet rates, or a packet and a byte rate); three limits need algorithm gcra",
        ));
    }
    // A window key keeps one window start for its two meters.
    let units: Vec<std::time::Duration> = packets.iter().chain(&bytes).map(|r| r.period).collect();
    if algorithm != Algorithm::Gcra && units.windows(2).any(|w| w[0] != w[1]) {
        return Err(invalid(
            "limits",
            "limits of different units need algorithm gcra (a window key keeps one window start for both)",
        ));
    }
    // The byte meter holds the first byte rate, else the second packet
    // rate; the third word whatever is left.
    let second_packets = if bytes.is_empty() {
        packets.get(1).copied()
    } else {
        None
    };
    let placed = usize::from(!packets.is_empty())
        + usize::from(!bytes.is_empty() || second_packets.is_some());
    let third = (count > placed).then(|| match bytes.get(1) {
        Some(&rate) => ThirdLimit {
            rate,
            counts_bytes: true,
        },
        None => ThirdLimit {
            rate: *packets.last().expect("a third limit"),
            counts_bytes: false,
        },
    });
    Ok(SeveralLimits {
        limit: Limit::Metered {
            packets: packets.first().copied(),
            bytes: bytes.first().copied(),
        },
        second_packets,
        third,
    })
}

/// `cost`: classes of segments (`tcp_flags`) or of requests (method,
/// host, path, headers), each costing 1 or more credits, no more than the
/// packet limit's burst (a packet of the class could never pass).
fn cost_classes(
    entries: &[raw::CostEntry],
    limit: &Limit,
    aggregate: Option<&Rates>,
    // The soft limit, the second and third packet limits, if any.
    others: [Option<&Rate>; 3],
) -> Result<Vec<CostClass>, Invalid> {
    let Limit::Metered {
        packets: Some(packets),
        ..
    } = limit
    else {
        return Err(invalid(
            "cost",
            "needs a packet limit (`limit: { rate: ... }`), which then counts credits",
        ));
    };
    if entries.is_empty() || entries.len() > MAX_COST_CLASSES {
        return Err(invalid(
            "cost",
            format!("1 to {MAX_COST_CLASSES} classes, each {{ match: {{...}}, credits: N }}"),
        ));
    }
    // The most a packet may cost: what a whole budget holds.
    let budget = |rate: &Rate| {
        if rate.window.length_ns != 0 {
            rate.window.limit
        } else {
            rate.burst
        }
    };
    // (The kernel keeps credits in 32 bits.)
    let most = std::iter::once(packets)
        .chain(aggregate.and_then(|a| a.packets.as_ref()))
        .chain(others.into_iter().flatten())
        .map(budget)
        .chain([u64::from(u32::MAX)])
        .min()
        .unwrap_or(u64::MAX);
    let mut classes = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let at = |field: &str| format!("cost[{i}].{field}");
        let m = &entry.matches;
        let addresses = [
            ("match.source", m.source.is_some()),
            ("match.protocol", m.protocol.is_some()),
            ("match.dest_port", m.dest_port.is_some()),
        ];
        if let Some((field, _)) = addresses.iter().find(|(_, set)| *set) {
            return Err(invalid(
                at(field),
                "a class is told by tcp_flags (layer 3/4) or by method, host, path, path_prefix, headers (layer 7); the rule's match picks the traffic",
            ));
        }
        let tcp_flags = m
            .tcp_flags
            .as_deref()
            .map(tcp_flags)
            .transpose()
            .map_err(|e| invalid(at("match.tcp_flags"), e))?;
        let request = request::request_match(m).map_err(|(f, e)| (at(&f), e))?;
        match (tcp_flags.is_some(), request.is_empty()) {
            (true, false) => {
                return Err(invalid(
                    at("match"),
                    "a class is of segments (tcp_flags) or of requests, not both",
                ));
            }
            (false, true) => {
                return Err(invalid(
                    at("match"),
                    "names no class: give tcp_flags, or method, host, path, path_prefix, headers",
                ));
            }
            _ => {}
        }
        if entry.credits == 0 || entry.credits > most {
            return Err(invalid(
                at("credits"),
                format!(
                    "{}: from 1 to {most} (a packet costing more than a whole budget could never pass)",
                    entry.credits
                ),
            ));
        }
        classes.push(CostClass {
            tcp_flags,
            request,
            credits: entry.credits,
        });
    }
    Ok(classes)
}

/// `escalation: { never_block, max_per_minute }`.
fn escalation_policy(fields: &raw::EscalationPolicyFields) -> Result<EscalationPolicy, Invalid> {
    let mut policy = EscalationPolicy::default();
    for (i, text) in fields.never_block.iter().flatten().enumerate() {
        let net =
            parse_net(text).map_err(|m| invalid(format!("escalation.never_block[{i}]"), m))?;
        policy.never_block.push(net.trunc());
    }
    match fields.max_per_minute {
        Some(0) => {
            return Err(invalid(
                "escalation.max_per_minute",
                "must be at least 1 (a rule without `escalate` blocks nothing)",
            ));
        }
        Some(n) => policy.max_per_minute = n,
        None => {}
    }
    Ok(policy)
}

/// The widest source prefix escalation blocks: a key's refusals are
/// evidence any forger can produce (a spoofed UDP packet, a SYN), so a
/// wider key would let one forged address block its neighbours.
const ESCALATE_WIDEST_V4: u8 = 24;
const ESCALATE_WIDEST_V6: u8 = 48;

/// Refuses `escalate` on a key that blocks more than a /24 (IPv4) or a
/// /48 (IPv6): `key: all`, or a `source/N` that wide.
fn escalation_key(keyed_by: &[KeyPart], key: KeyPrefix) -> Result<(), Invalid> {
    if keyed_by.is_empty() {
        return Err(invalid(
            "escalate",
            "not with `key: all`: one source over the limit would block every source",
        ));
    }
    if keyed_by.contains(&KeyPart::Source)
        && (key.v4 < ESCALATE_WIDEST_V4 || key.v6 < ESCALATE_WIDEST_V6)
    {
        let (bits, widest) = if key.v4 < ESCALATE_WIDEST_V4 {
            (key.v4, format!("/{ESCALATE_WIDEST_V4} for IPv4"))
        } else {
            (key.v6, format!("/{ESCALATE_WIDEST_V6} for IPv6"))
        };
        return Err(invalid(
            "escalate",
            format!(
                "not with keys of /{bits}: a block covers the whole key, and one forged address would block its neighbours; escalation needs keys of {widest} or longer"
            ),
        ));
    }
    Ok(())
}

/// `escalate: { after, block }`: both at least a second (the daemon looks
/// at every key once a second), on a rule with a limit.
fn escalation(
    fields: &raw::EscalateFields,
    limit: &Limit,
) -> Result<limiter_common::escalation::Escalation, Invalid> {
    if matches!(limit, Limit::Unlimited) {
        return Err(invalid("escalate", "has no effect on an unlimited rule"));
    }
    let duration = |field: &str, text: &str| {
        let d = humantime::parse_duration(text).map_err(|e| {
            invalid(
                format!("escalate.{field}"),
                format!("{}: {e}", quoted(text)),
            )
        })?;
        if d < std::time::Duration::from_secs(1) {
            return Err(invalid(
                format!("escalate.{field}"),
                format!(
                    "{}: at least 1s (keys are looked at once a second)",
                    quoted(text)
                ),
            ));
        }
        if d > std::time::Duration::from_secs(365 * 86_400) {
            return Err(invalid(
                format!("escalate.{field}"),
                format!(
                    "{}: at most a year (`limiter block` blocks for ever)",
                    quoted(text)
                ),
            ));
        }
        Ok(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    };
    Ok(limiter_common::escalation::Escalation {
        after_ns: duration("after", &fields.after)?,
        block_ns: duration("block", &fields.block)?,
    })
}

/// `scope`, `partitions` and `reserve` belong to an aggregate.
fn local_only(fields: &raw::RateFields) -> Result<(), Invalid> {
    let given = [
        ("scope", fields.scope.is_some()),
        ("partitions", fields.partitions.is_some()),
        ("reserve", fields.reserve.is_some()),
    ];
    match given.iter().find(|(_, set)| *set) {
        Some((field, _)) => Err(invalid(
            *field,
            "applies to `aggregate` only: a fleet shares the rule's one budget, not each key's",
        )),
        None => Ok(()),
    }
}

/// The most partitions a fleet budget may have: one key each in the store,
/// renewed together.
pub const MAX_PARTITIONS: u32 = 1000;

/// An aggregate's `scope: fleet` and how it is shared.
fn fleet_share(fields: &raw::RateFields, rates: &Rates) -> Result<Option<FleetShare>, Invalid> {
    if fields.scope != Some(raw::Scope::Fleet) {
        let stray = [
            ("partitions", fields.partitions.is_some()),
            ("reserve", fields.reserve.is_some()),
        ];
        if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
            return Err(invalid(*field, "needs `scope: fleet`"));
        }
        return Ok(None);
    }
    let Some(packets) = rates.packets else {
        return Err(invalid(
            "scope",
            "a fleet budget is in packets (requests): give `rate`",
        ));
    };
    if packets.window.length_ns != 0 {
        return Err(invalid(
            "scope",
            "a fleet budget needs algorithm gcra: a window's count cannot move between hosts \
             with the partitions, so a partition moved within a window would count twice",
        ));
    }
    if rates.bytes.is_some() {
        return Err(invalid(
            "bytes",
            "a fleet budget is in packets (requests) only; limit bytes in a rule of its own",
        ));
    }
    let partitions = fields.partitions.unwrap_or(packets.rate.min(50) as u32);
    if partitions == 0 || partitions > MAX_PARTITIONS || u64::from(partitions) > packets.rate {
        return Err(invalid(
            "partitions",
            format!(
                "{partitions}: must be 1 to {} (at most {MAX_PARTITIONS}, and each worth at least 1 per unit)",
                packets.rate.min(u64::from(MAX_PARTITIONS))
            ),
        ));
    }
    let reserve = fields.reserve.unwrap_or(0);
    if reserve > packets.rate {
        return Err(invalid(
            "reserve",
            format!(
                "{reserve} per unit is more than the fleet's whole rate ({})",
                packets.rate
            ),
        ));
    }
    // A node's share goes up to reserve + rate: it must be a valid meter.
    let most = packets.rate + reserve;
    let period_ns = u64::try_from(packets.period.as_nanos()).unwrap_or(u64::MAX);
    // (A GCRA meter: a window's budget was refused above.)
    Gcra::new(most, period_ns, packets.burst).map_err(|e| invalid("reserve", e.to_string()))?;
    Ok(Some(FleetShare {
        partitions,
        reserve,
    }))
}

/// A key-creation budget: keys per unit, with a burst.
fn new_keys(fields: &raw::RateFields) -> Result<Rate, Invalid> {
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

/// A key's window counts are 31-bit (`keytable::MAX_WINDOW_LIMIT`: 60
/// bytes a key); a rule's aggregate has no such bound.
fn key_window_fits(rates: &Rates) -> Result<(), Invalid> {
    for (field, rate) in [("rate", &rates.packets), ("bytes", &rates.bytes)] {
        if let Some(rate) = rate
            && rate.window.length_ns != 0
            && rate.rate > MAX_WINDOW_LIMIT
        {
            return Err(invalid(
                field,
                format!(
                    "{}: a window counts at most {} per key; use a shorter unit, or gcra",
                    rate.rate, MAX_WINDOW_LIMIT
                ),
            ));
        }
    }
    Ok(())
}

fn validate_rates(rates: &raw::RateFields, algorithm: Algorithm) -> Result<Rates, Invalid> {
    let period = parse_unit(&rates.unit).map_err(|m| invalid("unit", m))?;
    let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX);
    let meter = |rate_field: &str, rate: Option<u64>, burst_field: &str, burst: Option<u64>| {
        let Some(rate) = rate else {
            return match burst {
                Some(_) => Err(invalid(
                    burst_field,
                    format!("given without `{rate_field}`"),
                )),
                None => Ok(None),
            };
        };
        if algorithm != Algorithm::Gcra && burst.is_some() {
            return Err(invalid(
                burst_field,
                "applies to gcra only: a window admits `rate` per window",
            ));
        }
        let burst = burst.unwrap_or(rate);
        let gcra =
            Gcra::new(rate, period_ns, burst).map_err(|e| invalid(rate_field, e.to_string()))?;
        let window = match algorithm {
            Algorithm::Gcra => Window::default(),
            _ => Window::new(rate, period_ns).map_err(|e| invalid(rate_field, e.to_string()))?,
        };
        Ok(Some(Rate {
            rate,
            period,
            burst,
            gcra,
            window,
        }))
    };
    let packets = meter("rate", rates.rate, "burst", rates.burst)?;
    let bytes = meter("bytes", rates.bytes, "burst_bytes", rates.burst_bytes)?;
    if packets.is_none() && bytes.is_none() {
        return Err(invalid(
            "rate",
            "a limit needs `rate` (packets), `bytes`, or both",
        ));
    }
    Ok(Rates { packets, bytes })
}

fn parse_prefix(text: &str) -> Result<IpNet, Invalid> {
    parse_net(text).map_err(|message| invalid("match.source", message))
}

/// An address prefix (`10.0.0.0/8`), or a single address (`/32`, `/128`).
pub fn parse_net(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| {
            format!(
                "{} is not an address prefix such as 10.0.0.0/8 or 2001:db8::/32",
                quoted(text)
            )
        })
}

/// `second`, `minute`, `hour`, `day`, or a duration such as `30s` or `250ms`.
pub fn parse_unit(unit: &str) -> Result<Duration, String> {
    let period = match unit {
        "second" => Duration::from_secs(1),
        "minute" => Duration::from_secs(60),
        "hour" => Duration::from_secs(3600),
        "day" => Duration::from_secs(86_400),
        other => humantime::parse_duration(other).map_err(|e| {
            format!(
                "{}: expected second, minute, hour, day or a duration like 30s ({e})",
                quoted(other)
            )
        })?,
    };
    if period.is_zero() {
        return Err("must be longer than zero".into());
    }
    Ok(period)
}

/// `source` (whole address), `source/N`, or absent (the default: /32 for
/// IPv4, /64 for IPv6).
fn parse_key(key: Option<&str>, source: Option<IpNet>) -> Result<KeyPrefix, String> {
    let Some(key) = key else {
        return Ok(KeyPrefix::DEFAULT);
    };
    if key == "source" {
        return Ok(KeyPrefix { v4: 32, v6: 128 });
    }
    let bits = key
        .strip_prefix("source/")
        .and_then(|n| n.parse::<u8>().ok())
        .ok_or_else(|| format!("{}: expected `source` or `source/N`", quoted(key)))?;
    if bits == 0 {
        return Err(
            "source/0 makes one bucket of every source: write `key: all` if that is meant".into(),
        );
    }
    match source.map(|net| net.addr()) {
        Some(IpAddr::V4(_)) if bits <= 32 => Ok(KeyPrefix {
            v4: bits,
            v6: KeyPrefix::DEFAULT.v6,
        }),
        Some(IpAddr::V6(_)) if bits <= 128 => Ok(KeyPrefix {
            v4: KeyPrefix::DEFAULT.v4,
            v6: bits,
        }),
        Some(IpAddr::V4(_)) => Err(format!("/{bits} is longer than an IPv4 address")),
        Some(IpAddr::V6(_)) => Err(format!("/{bits} is longer than an IPv6 address")),
        None => Err(format!(
            "source/{bits} needs match.source to tell whether it is an IPv4 or IPv6 prefix"
        )),
    }
}

/// No source prefix may be covered by more rules than a trie entry of the
/// kernel holds; the error names the rule whose prefix overflows.
fn fits_the_tries(set: &RuleSet) -> Result<(), Invalid> {
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
