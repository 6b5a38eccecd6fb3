//! One rule entry: its match, key and limits checked field by field and
//! against each other (a port needs a protocol, pacing a GCRA packet
//! limit), then put together as a [`Rule`].

use limiter_common::abi::RULE_NAME_LEN;

use super::{
    cost::cost_classes,
    escalation::{escalation, escalation_key},
    fleet::{fleet_share, local_only},
    limits::{key_window_fits, several_limits, soft_limit, validate_rates},
    text::{parse_key, parse_prefix, tcp_flags},
};
use crate::rules::invalid::{InvalidField, invalid};
use crate::{
    rules::{
        raw::{self, Algorithm, EscalateScope},
        request::{self, KeyPart},
        set::{KeyPrefix, Limit, Match, Rule},
    },
    yaml::quoted,
};

pub(super) fn validate_rule(raw: &raw::RuleEntry) -> Result<Rule, InvalidField> {
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
            let m =
                validate_rates(rates, algorithm).map_err(|e| e.within(|f| format!("limit.{f}")))?;
            key_window_fits(&m).map_err(|e| e.within(|f| format!("limit.{f}")))?;
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
        local_only(fields).map_err(|e| e.within(|f| format!("limit.{f}")))?;
    }
    let aggregate = raw
        .aggregate
        .as_ref()
        .map(|rates| validate_rates(rates, algorithm))
        .transpose()
        .map_err(|e| e.within(|f| format!("aggregate.{f}")))?;
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
            fleet_share(fields, &rates).map_err(|e| e.within(|f| format!("aggregate.{f}")))?
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
