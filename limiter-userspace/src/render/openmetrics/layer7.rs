//! The exposition of a layer-7 limiter (`layer="http"`), served by
//! `limiter proxy --metrics`: the kernel's names, from the limiter's own
//! counters.

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::common::{Labels, register_build_info, register_fleet, register_rule_file_rejections};
use crate::fleet::node::ShareStatus;

/// The exposition of a layer-7 limiter (`limiter proxy --metrics`): the
/// kernel's names, with `layer="http"`.
/// `rule_file_rejections`: rule files re-read and refused since start;
/// `trace_lines_dropped`: with `--trace`, its lines dropped.
pub fn render_http(
    limiter: &crate::http::Limiter,
    fleet: &[ShareStatus],
    rule_file_rejections: u64,
    trace_lines_dropped: Option<u64>,
) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let mut registry = Registry::default();
    let packets = Family::<Labels, Counter>::default();
    let bodies = Family::<Labels, Counter>::default();
    let in_flight = Family::<Labels, Counter>::default();
    let over_soft = Family::<Labels, Counter>::default();
    let escalations = Family::<Labels, Counter>::default();
    for (rule, counters) in limiter.rules().rules.iter().zip(&limiter.counters) {
        let labels = |name: &str, value: &str| {
            vec![
                ("layer".to_owned(), "http".to_owned()),
                ("rule".to_owned(), rule.name.clone()),
                (name.to_owned(), value.to_owned()),
            ]
        };
        for (verdict, value) in [
            ("passed", counters.passed.get()),
            ("dropped", counters.dropped.get()),
            ("shadow_dropped", counters.shadow.get()),
        ] {
            packets
                .get_or_create(&labels("verdict", verdict))
                .inc_by(value);
        }
        for (action, value) in [
            ("cut", counters.bodies_cut.load(Relaxed)),
            ("shadow", counters.shadow_bodies.load(Relaxed)),
        ] {
            bodies
                .get_or_create(&labels("action", action))
                .inc_by(value);
        }
        if rule.escalate.is_some() {
            escalations
                .get_or_create(&vec![
                    ("layer".to_owned(), "http".to_owned()),
                    ("rule".to_owned(), rule.name.clone()),
                ])
                .inc_by(counters.escalations.load(Relaxed));
        }
        if rule.soft.is_some() {
            over_soft
                .get_or_create(&vec![
                    ("layer".to_owned(), "http".to_owned()),
                    ("rule".to_owned(), rule.name.clone()),
                ])
                .inc_by(counters.over_soft.load(Relaxed));
        }
        if rule.concurrent.is_some() {
            in_flight
                .get_or_create(&vec![
                    ("layer".to_owned(), "http".to_owned()),
                    ("rule".to_owned(), rule.name.clone()),
                ])
                .inc_by(counters.in_flight_excess.load(Relaxed));
        }
    }
    registry.register(
        "limiter_packets",
        "Requests judged, by rule and verdict",
        packets,
    );
    registry.register(
        "limiter_over_soft_packets",
        "Requests served over the rule's soft limit (counted, not refused)",
        over_soft,
    );
    registry.register(
        "limiter_escalations",
        "Keys blocked (or, under a dry run, counted) for staying over their rule's limit longer than its `escalate.after`",
        escalations,
    );
    registry.register(
        "limiter_body_over_limit_requests",
        "Admitted requests whose streaming (chunked) body went over the rule's byte limit: cut short, or counted under a dry run",
        bodies,
    );
    registry.register(
        "limiter_in_flight_refused_requests",
        "Requests refused (or let through by a dry run) because their key had as many requests in flight as the rule's `concurrent` allows",
        in_flight,
    );
    let refused = Family::<Labels, Counter>::default();
    refused
        .get_or_create(&vec![("layer".to_owned(), "http".to_owned())])
        .inc_by(limiter.key_alloc_failures());
    registry.register(
        "limiter_key_alloc_failures",
        "Requests of new keys refused: every key kept was still in debt to its limit",
        refused,
    );
    let keys = Gauge::<i64>::default();
    keys.set(i64::try_from(limiter.tracked_keys()).unwrap_or(i64::MAX));
    registry.register(
        "limiter_tracked_keys",
        "Keys with state in the layer-7 limiter",
        keys,
    );
    register_fleet(&mut registry, fleet, "http");
    register_rule_file_rejections(&mut registry, "http", rule_file_rejections);
    if let Some(dropped) = trace_lines_dropped {
        let counter = Counter::<u64>::default();
        counter.inc_by(dropped);
        registry.register(
            "limiter_trace_lines_dropped",
            "Lines of `limiter proxy --trace` dropped because stdout was not read fast enough",
            counter,
        );
    }
    register_build_info(&mut registry);
    let mut out = String::new();
    encode(&mut out, &registry).expect("writing to a String cannot fail");
    out
}
