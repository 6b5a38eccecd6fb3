//! What both layers' expositions register the same way: the fleet rules'
//! shares, the rule files refused, the build's version; and their labels.

use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge, info::Info},
    registry::{Registry, Unit},
};

use std::sync::atomic::AtomicU64;

use crate::fleet::node::ShareStatus;

pub type Labels = Vec<(String, String)>;

/// Each fleet rule's share and leases, by layer and rule.
pub fn register_fleet(registry: &mut Registry, shares: &[ShareStatus], layer: &str) {
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

/// A re-read rule file that was refused is only logged otherwise, and
/// the old rules go on in force: what an alert on a failed reload reads.
pub fn register_rule_file_rejections(registry: &mut Registry, layer: &str, n: u64) {
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
pub fn register_build_info(registry: &mut Registry) {
    registry.register(
        "limiter_build",
        "The running limiter's version",
        Info::new(vec![(
            "version".to_owned(),
            env!("CARGO_PKG_VERSION").to_owned(),
        )]),
    );
}
