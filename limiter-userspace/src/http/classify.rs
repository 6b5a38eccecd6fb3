//! What the limiter needs to know of a rule before any request: whether
//! its plain shortcut judges it, and how long its keys take to rest.

use crate::rules::{Algorithm, Limit, Rule};

/// Whether `rule` is plain: one GCRA request limit per key, charged a
/// credit a request, and nothing besides (no pacing, byte or second or
/// third limit, aggregate, fleet share, in-flight cap, escalation, soft
/// limit, dry run or credit classes).
pub(super) fn is_plain(rule: &Rule) -> bool {
    let [packets, second, _] = rule.key_meters();
    rule.algorithm == Algorithm::Gcra
        && packets.is_some()
        && second.is_none()
        && rule.delay.is_none()
        && rule.third.is_none()
        && rule.aggregate.is_none()
        && rule.fleet.is_none()
        && rule.concurrent.is_none()
        && rule.escalate.is_none()
        && rule.soft.is_none()
        && !rule.shadow
        && rule.costs.is_empty()
}

/// How long a key of `rule` must go unseen before its state is what a new
/// key starts with: a window's counts expire within two windows, a log's
/// entries within one. `None` for GCRA, whose state says it exactly.
pub(super) fn rest_ns(rule: &Rule) -> Option<u64> {
    if matches!(rule.limit, Limit::Unlimited) {
        return Some(0);
    }
    if rule.algorithm == Algorithm::Gcra {
        return None;
    }
    Some(
        rule.key_meters()
            .into_iter()
            .flatten()
            .map(|m| match rule.algorithm {
                Algorithm::SlidingLog => m.window.length_ns,
                _ => m.window.length_ns.saturating_mul(2),
            })
            .max()
            .unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    /// A rule with anything besides one GCRA request limit is not plain:
    /// the shortcut would skip it.
    #[test]
    fn a_rule_with_more_than_one_request_limit_is_not_plain() {
        let limit = "limit: { rate: 10, unit: second, burst: 5 }";
        let rule = |rest: &str| {
            let text = format!("rules:\n  - {{ name: r, {rest} }}\n");
            let rules = crate::rules::RuleSet::parse(&text, std::path::Path::new("t.yaml"))
                .unwrap_or_else(|e| panic!("{rest}: {e}"));
            super::is_plain(&rules.rules[0])
        };
        assert!(rule(limit), "{limit}");
        for rest in [
            "limit: unlimited".to_owned(),
            "limit: { bytes: 1000, unit: second, burst_bytes: 1000 }".to_owned(),
            "limits: [{ rate: 10, unit: second, burst: 5 }, { rate: 100, unit: minute }]".to_owned(),
            "limits: [{ rate: 10, unit: second, burst: 5 }, { bytes: 1000, unit: second, burst_bytes: 1000 }]".to_owned(),
            "limits: [{ rate: 10, unit: second, burst: 5 }, { rate: 100, unit: minute }, { rate: 1000, unit: hour }]".to_owned(),
            "limit: { rate: 10, unit: second }, algorithm: fixed_window".to_owned(),
            "limit: { rate: 10, unit: second, burst: 5, delay: 100ms }".to_owned(),
            format!("{limit}, soft: {{ rate: 5, unit: second, burst: 2 }}"),
            format!("{limit}, escalate: {{ after: 1s, block: 2s }}"),
            format!("{limit}, action: shadow"),
            format!("{limit}, concurrent: 4"),
            format!("{limit}, aggregate: {{ rate: 100, unit: second, burst: 10 }}"),
            format!("{limit}, cost: [{{ match: {{ method: POST }}, credits: 5 }}]"),
        ] {
            assert!(!rule(&rest), "{rest} was taken for plain");
        }
    }
}
