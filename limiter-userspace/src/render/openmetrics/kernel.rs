//! The kernel's exposition (`layer="xdp"`), served by the daemon: the XDP
//! program's counters and what the daemon knows beyond them.

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Registry, Unit},
};

use super::common::{Labels, register_build_info, register_fleet, register_rule_file_rejections};
use crate::{
    fleet::node::ShareStatus,
    wire::{InterfaceStats, Mode, Snapshot},
};

/// What the daemon knows beyond the kernel's counters.
#[derive(Clone, Debug, Default)]
pub struct DaemonGauges {
    /// Rule sets applied since the daemon started (the first is 1).
    pub ruleset_generation: u64,
    /// Keys in the state map now (counted with batched reads).
    pub tracked_keys: u64,
    pub blocks: u64,
    /// The pins are gone (bpffs unmounted) and not yet written again.
    pub pins_missing: bool,
    /// Each fleet rule's share.
    pub fleet: Vec<ShareStatus>,
    /// Escalations (`escalate`) per rule name since the daemon started.
    pub escalations: Vec<(String, u64)>,
    /// Escalations left out by the rule file's `escalation`, by reason.
    pub escalations_left_out: Vec<(String, u64)>,
    /// Rule files re-read (SIGHUP, `--watch`) and refused since start.
    pub rule_file_rejections: u64,
}

/// The exposition text for one scrape.
pub fn render(snapshot: &Snapshot, facts: DaemonGauges) -> String {
    let mut registry = Registry::default();
    let layer = || ("layer".to_owned(), "xdp".to_owned());

    let packets = Family::<Labels, Counter>::default();
    let bytes = Family::<Labels, Counter>::default();
    let new_keys = Family::<Labels, Counter>::default();
    let aggregate = Family::<Labels, Counter>::default();
    let contended = Family::<Labels, Counter>::default();
    let unadmitted = Family::<Labels, Counter>::default();
    let over_soft = Family::<Labels, Counter>::default();
    // Slot 0 ("other": unregistered interfaces, test runs) only when used.
    let used = |iface: &&InterfaceStats| {
        iface.ifindex != 0 || iface.rules.iter().any(|r| r.counters != Default::default())
    };
    for iface in snapshot.interfaces.iter().filter(used) {
        for rule in &iface.rules {
            let base = vec![
                layer(),
                ("interface".to_owned(), iface.name.clone()),
                ("rule".to_owned(), rule.name.clone()),
            ];
            let c = &rule.counters;
            // Shadow-dropped packets were passed too: `passed` counts only
            // those that conformed, so the three verdicts add up to all.
            let conforming = c.passed_packets - c.shadow_packets;
            let conforming_bytes = c.passed_bytes - c.shadow_bytes;
            for (verdict, n, b) in [
                ("passed", conforming, conforming_bytes),
                ("dropped", c.dropped_packets, c.dropped_bytes),
                ("shadow_dropped", c.shadow_packets, c.shadow_bytes),
            ] {
                let mut labels = base.clone();
                labels.push(("verdict".to_owned(), verdict.to_owned()));
                packets.get_or_create(&labels).inc_by(n);
                bytes.get_or_create(&labels).inc_by(b);
            }
            new_keys.get_or_create(&base).inc_by(c.new_keys);
            aggregate.get_or_create(&base).inc_by(c.aggregate_excess);
            contended.get_or_create(&base).inc_by(c.contended);
            unadmitted.get_or_create(&base).inc_by(c.unadmitted);
            over_soft.get_or_create(&base).inc_by(rule.over_soft);
        }
    }
    registry.register(
        "limiter_packets",
        "Packets judged, by rule, interface and verdict",
        packets,
    );
    registry.register_with_unit(
        "limiter",
        "Bytes judged (whole frames), by rule, interface and verdict",
        Unit::Bytes,
        bytes,
    );
    registry.register(
        "limiter_new_keys",
        "Keys a rule added to the state map",
        new_keys,
    );
    registry.register(
        "limiter_aggregate_refused_packets",
        "Packets refused by a rule's aggregate limit although their key's budget allowed them",
        aggregate,
    );
    registry.register(
        "limiter_contended_packets",
        "Packets treated as excess because every compare-and-swap lost the race",
        contended,
    );
    registry.register(
        "limiter_over_soft_packets",
        "Packets passed over the rule's soft limit (counted, not refused)",
        over_soft,
    );
    let escalations = Family::<Labels, Counter>::default();
    for (rule, n) in &facts.escalations {
        escalations
            .get_or_create(&vec![layer(), ("rule".to_owned(), rule.clone())])
            .inc_by(*n);
    }
    registry.register(
        "limiter_escalations",
        "Keys blocked (or, under a dry run, counted) for staying over their rule's limit longer than its `escalate.after`",
        escalations,
    );
    let left_out = Family::<Labels, Counter>::default();
    for (reason, n) in &facts.escalations_left_out {
        left_out
            .get_or_create(&vec![layer(), ("reason".to_owned(), reason.clone())])
            .inc_by(*n);
    }
    registry.register(
        "limiter_escalations_left_out",
        "Escalations not made: the prefix is in escalation.never_block, or escalation.max_per_minute was reached",
        left_out,
    );
    registry.register(
        "limiter_unadmitted_packets",
        "Packets of sources not yet tracked, refused because the rule's key-creation budget was spent",
        unadmitted,
    );

    let g = &snapshot.global;
    for (name, help, value) in [
        (
            "limiter_parse_failures",
            "Frames whose source could not be read (link or network header truncated or malformed)",
            g.malformed,
        ),
        (
            "limiter_non_ip_packets",
            "Non-IP frames, passed untouched",
            g.non_ip,
        ),
        (
            "limiter_fragments",
            "Non-first and first IP fragments seen",
            g.fragments,
        ),
        (
            "limiter_tiny_fragments",
            "First fragments too short for their transport header, dropped (RFC 1858)",
            g.tiny_fragments,
        ),
        (
            "limiter_unreadable_transport_packets",
            "Packets whose transport header could not be read, charged as if any port",
            g.unreadable_transport,
        ),
        (
            "limiter_blocked_packets",
            "Packets dropped by manual blocks",
            g.blocked,
        ),
        (
            "limiter_key_alloc_failures",
            "Packets of new sources refused a slot in the key table: their bucket held only keys in debt (or another CPU claimed the slot first)",
            g.key_alloc_failed,
        ),
        (
            "limiter_key_evictions",
            "Keys at rest whose slot went to a new key",
            g.key_evictions,
        ),
    ] {
        let family = Family::<Labels, Counter>::default();
        family.get_or_create(&vec![layer()]).inc_by(value);
        registry.register(name, help, family);
    }

    let attached = Family::<Labels, Gauge>::default();
    for iface in &snapshot.interfaces {
        if let Some(mode) = iface.xdp_mode {
            let mode = match mode {
                Mode::Skb => "skb",
                _ => "native",
            };
            attached
                .get_or_create(&vec![
                    layer(),
                    ("interface".to_owned(), iface.name.clone()),
                    ("mode".to_owned(), mode.to_owned()),
                ])
                .set(1);
        }
    }
    registry.register(
        "limiter_xdp_attached",
        "1 for each interface the program is attached to, by XDP mode: skb (generic) is what `auto` falls back to where native fails, slower, and after GRO",
        attached,
    );

    let orphans = Family::<Labels, Counter>::default();
    let o = &snapshot.orphan_fragments;
    for (fate, value) in [("charged", o.charged), ("dropped", o.dropped)] {
        orphans
            .get_or_create(&vec![layer(), ("fate".to_owned(), fate.to_owned())])
            .inc_by(value);
    }
    registry.register(
        "limiter_orphan_fragments",
        "Later fragments whose first fragment was not seen: charged to the strictest rule they may belong to, or dropped (the rule file's fragments)",
        orphans,
    );

    for (name, help, value, unit) in [
        (
            "limiter_tracked_keys",
            "Keys in the per-key state map",
            facts.tracked_keys,
            None,
        ),
        (
            "limiter_key_capacity",
            "Capacity of the per-key state table (slots)",
            snapshot.keys.capacity,
            None,
        ),
        (
            "limiter_key_map",
            "Kernel memory of the per-key state map",
            snapshot.keys.memory_bytes,
            Some(Unit::Bytes),
        ),
        (
            "limiter_ruleset_generation",
            "Rule sets applied since the daemon started",
            facts.ruleset_generation,
            None,
        ),
        (
            "limiter_blocks",
            "Manual blocks in force or awaiting removal",
            facts.blocks,
            None,
        ),
        (
            "limiter_pins_missing",
            "1 while the pinned maps and links are gone (bpffs unmounted) and not yet pinned again",
            u64::from(facts.pins_missing),
            None,
        ),
        (
            "limiter_rules",
            "Rules in the active rule set (the default included)",
            snapshot.rules.len() as u64,
            None,
        ),
    ] {
        let gauge = Gauge::<i64>::default();
        gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
        match unit {
            Some(unit) => registry.register_with_unit(name, help, unit, gauge),
            None => registry.register(name, help, gauge),
        }
    }
    register_fleet(&mut registry, &facts.fleet, "xdp");
    register_rule_file_rejections(&mut registry, "xdp", facts.rule_file_rejections);
    register_build_info(&mut registry);

    let mut out = String::new();
    encode(&mut out, &registry).expect("writing to a String cannot fail");
    out
}
