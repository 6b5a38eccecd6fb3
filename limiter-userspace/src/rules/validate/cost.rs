//! A rule's `cost`: classes of segments or of requests, and the credits
//! each costs, bounded by the budgets it is charged to.

use limiter_common::abi::MAX_COST_CLASSES;

use super::text::tcp_flags;
use crate::rules::invalid::{InvalidField, invalid};
use crate::rules::{
    raw, request,
    set::{CostClass, Limit, Rate, Rates},
};

/// `cost`: classes of segments (`tcp_flags`) or of requests (method,
/// host, path, headers), each costing 1 or more credits, no more than the
/// packet limit's burst (a packet of the class could never pass).
pub(super) fn cost_classes(
    entries: &[raw::CostEntry],
    limit: &Limit,
    aggregate: Option<&Rates>,
    // The soft limit, the second and third packet limits, if any.
    others: [Option<&Rate>; 3],
) -> Result<Vec<CostClass>, InvalidField> {
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
        let request = request::request_match(m).map_err(|e| e.within(at))?;
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
