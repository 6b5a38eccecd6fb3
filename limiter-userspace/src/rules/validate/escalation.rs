//! Escalation: a rule's `escalate` (its durations, and keys narrow
//! enough that a forger cannot block a neighbour) and the file's
//! `escalation` policy (prefixes never blocked, blocks a minute).

use super::text::parse_net;
use crate::rules::invalid::{InvalidField, invalid};
use crate::{
    rules::{
        raw,
        request::KeyPart,
        set::{EscalationPolicy, KeyPrefix, Limit},
    },
    yaml::quoted,
};

/// `escalation: { never_block, max_per_minute }`.
pub(super) fn escalation_policy(
    fields: &raw::EscalationPolicyFields,
) -> Result<EscalationPolicy, InvalidField> {
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
pub(super) fn escalation_key(keyed_by: &[KeyPart], key: KeyPrefix) -> Result<(), InvalidField> {
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
pub(super) fn escalation(
    fields: &raw::EscalateFields,
    limit: &Limit,
) -> Result<limiter_common::escalation::Escalation, InvalidField> {
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
