//! Prometheus (OpenMetrics) exposition of the counters, of the kernel
//! (`layer="xdp"`) and of a layer-7 limiter (`layer="http"`, the same
//! names). Names follow the conventions: `_total` counters, base units
//! (bytes), and the labels `layer`, `interface`, `rule` and `verdict`.
//! Served in the format the scraper's `Accept` asks for ([`Format`]):
//! OpenMetrics on request, else the classic text format that every reader
//! of Prometheus metrics takes.

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge, info::Info},
    registry::{Registry, Unit},
};

use std::sync::atomic::AtomicU64;

use crate::{fleet::node::ShareStatus, kernel::counters::Snapshot};

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

type Labels = Vec<(String, String)>;

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
    let used = |iface: &&crate::kernel::counters::InterfaceStats| {
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
                crate::kernel::Mode::Skb => "skb",
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

/// Each fleet rule's share and leases, by layer and rule.
fn register_fleet(registry: &mut Registry, shares: &[ShareStatus], layer: &str) {
    if shares.is_empty() {
        return;
    }
    let labels = |rule: &str| {
        vec![
            ("layer".to_owned(), layer.to_owned()),
            ("rule".to_owned(), rule.to_owned()),
        ]
    };
    let held = Family::<Labels, Gauge>::default();
    let up = Family::<Labels, Gauge>::default();
    let local = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let fleet = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let rtt = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let foreign = Family::<Labels, Gauge>::default();
    let leases = Family::<Labels, Counter>::default();
    for share in shares {
        let at = labels(&share.rule);
        let per_second = |rate: u64| rate as f64 / share.unit_seconds.max(f64::MIN_POSITIVE);
        held.get_or_create(&at).set(i64::from(share.held));
        up.get_or_create(&at).set(i64::from(share.store_up));
        local.get_or_create(&at).set(per_second(share.local_rate));
        fleet.get_or_create(&at).set(per_second(share.fleet_rate));
        rtt.get_or_create(&at).set(share.store_rtt_seconds);
        foreign
            .get_or_create(&at)
            .set(i64::from(share.store_foreign_partitions));
        for (event, n) in [
            ("acquired", share.leases_acquired),
            ("renewed", share.leases_renewed),
            ("lost", share.leases_lost),
            ("released", share.leases_released),
            ("malformed", share.store_malformed_entries),
        ] {
            let mut with_event = at.clone();
            with_event.push(("event".to_owned(), event.to_owned()));
            leases.get_or_create(&with_event).inc_by(n);
        }
    }
    registry.register(
        "limiter_fleet_partitions_held",
        "Partitions of a fleet rule's budget this node holds and enforces",
        held,
    );
    registry.register(
        "limiter_fleet_store_up",
        "1 while the fleet store answers; 0: this node enforces its fallback (reserve, or the fail-open cap)",
        up,
    );
    registry.register(
        "limiter_fleet_local_rate",
        "This node's share of a fleet rule, its reserve included, per second",
        local,
    );
    registry.register(
        "limiter_fleet_rate",
        "A fleet rule's whole budget (every node together), per second",
        fleet,
    );
    registry.register_with_unit(
        "limiter_fleet_store_rtt",
        "The last round trip to the fleet store",
        Unit::Seconds,
        rtt,
    );
    registry.register(
        "limiter_fleet_foreign_partitions",
        "Partitions of a fleet rule's budget leased under a token no node reports (another writer on the store's keys), at this node's last report",
        foreign,
    );
    registry.register(
        "limiter_fleet_leases",
        "Leases on a fleet rule's partitions: acquired, renewed, lost (expired or taken before renewal), released; malformed: entries of the store's list of nodes deleted as malformed",
        leases,
    );
}

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

/// A re-read rule file that was refused is only logged otherwise, and
/// the old rules go on in force: what an alert on a failed reload reads.
fn register_rule_file_rejections(registry: &mut Registry, layer: &str, n: u64) {
    let rejections = Family::<Labels, Counter>::default();
    rejections
        .get_or_create(&vec![("layer".to_owned(), layer.to_owned())])
        .inc_by(n);
    registry.register(
        "limiter_rule_file_rejections",
        "Rule files re-read (SIGHUP or a change on disk) and refused: the rules in force were kept",
        rejections,
    );
}

/// `limiter_build_info{version="..."} 1`.
fn register_build_info(registry: &mut Registry) {
    registry.register(
        "limiter_build",
        "The running limiter's version",
        Info::new(vec![(
            "version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        )]),
    );
}

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format 0.0.4: what `curl`, `promtool check
    /// metrics` and most scrapers read.
    Classic,
    OpenMetrics,
}

impl Format {
    /// What an `Accept` header asks for: OpenMetrics when it ranks
    /// `application/openmetrics-text` at least as high as any other type it
    /// accepts (as Prometheus does), the classic format otherwise.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut other) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut params = range.split(';').map(str::trim);
            let media = params.next().unwrap_or("").to_ascii_lowercase();
            let q = params
                .filter_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            if media == "application/openmetrics-text" {
                openmetrics = openmetrics.max(q);
            } else if !media.is_empty() {
                other = other.max(q);
            }
        }
        if openmetrics > 0.0 && openmetrics >= other {
            Self::OpenMetrics
        } else {
            Self::Classic
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Classic => "text/plain; version=0.0.4; charset=utf-8",
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// An exposition rendered by this module, in this format.
    pub fn encode(self, openmetrics: String) -> String {
        match self {
            Self::OpenMetrics => openmetrics,
            Self::Classic => to_classic(&openmetrics),
        }
    }
}

/// Rewrites an OpenMetrics exposition, as prometheus-client writes it, in
/// the classic text format: no `# UNIT` or `# EOF`, each counter declared
/// under its `_total` samples' name, each info family as an `_info` gauge.
/// (prometheus-client writes a family's `# HELP` before its `# TYPE`, so the
/// help waits for the type that decides its name.)
fn to_classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                _ => (name.to_owned(), "untyped"),
            };
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if !(line.starts_with("# UNIT ") || line == "# EOF") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{Format, to_classic};

    #[test]
    fn accept_chooses_the_format() {
        assert_eq!(Format::negotiate(None), Format::Classic);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Classic);
        assert_eq!(
            Format::negotiate(Some("text/plain;version=0.0.4")),
            Format::Classic
        );
        // What Prometheus 2.x sends.
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
            )),
            Format::OpenMetrics
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0.2, text/plain")),
            Format::Classic
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Classic
        );
    }

    #[test]
    fn classic_names_counters_and_info_by_their_samples() {
        let openmetrics = "# HELP limiter_packets Packets judged.\n# TYPE limiter_packets counter\nlimiter_packets_total{rule=\"a\"} 3\n# HELP limiter_bytes Bytes judged.\n# TYPE limiter_bytes counter\n# UNIT limiter_bytes bytes\nlimiter_bytes_total 9\n# HELP limiter_blocks Blocks.\n# TYPE limiter_blocks gauge\nlimiter_blocks 1\n# HELP limiter_build Version.\n# TYPE limiter_build info\nlimiter_build_info{version=\"1\"} 1\n# EOF\n";
        assert_eq!(
            to_classic(openmetrics),
            "# HELP limiter_packets_total Packets judged.\n# TYPE limiter_packets_total counter\nlimiter_packets_total{rule=\"a\"} 3\n# HELP limiter_bytes_total Bytes judged.\n# TYPE limiter_bytes_total counter\nlimiter_bytes_total 9\n# HELP limiter_blocks Blocks.\n# TYPE limiter_blocks gauge\nlimiter_blocks 1\n# HELP limiter_build_info Version.\n# TYPE limiter_build_info gauge\nlimiter_build_info{version=\"1\"} 1\n"
        );
    }
}
