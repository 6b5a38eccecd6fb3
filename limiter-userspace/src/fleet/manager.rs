//! The fleet rules a node runs: one task per rule (its [`Node`]), started
//! when a rule file brings the rule, stopped (its leases given back) when
//! one removes or changes it, each reporting its [`ShareStatus`].

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Instant,
};

use tokio::sync::watch;

use super::{
    Enforcer, FleetConfig,
    node::{Fallback, Node, ShareStatus, Spec},
    share::Budget,
};
use crate::rules::Rule;

/// Each fleet rule's share, by rule name.
pub type FleetStatus = Arc<Mutex<BTreeMap<String, ShareStatus>>>;

/// A rule's loop: told to stop (it then gives its leases back) through
/// `stop`, or when this is dropped.
struct Running {
    fingerprint: u64,
    stop: watch::Sender<bool>,
}

pub struct Fleet {
    config: Option<FleetConfig>,
    enforcer: Arc<dyn Enforcer>,
    running: HashMap<String, Running>,
    status: FleetStatus,
}

impl Fleet {
    /// Shares fleet rules through `config`'s store; without one, fleet
    /// rules keep their reserve (and say so).
    pub fn new(config: Option<FleetConfig>, enforcer: Arc<dyn Enforcer>) -> Self {
        Self {
            config,
            enforcer,
            running: HashMap::new(),
            status: FleetStatus::default(),
        }
    }

    pub fn status(&self) -> FleetStatus {
        Arc::clone(&self.status)
    }

    /// Runs exactly the fleet rules of `rules` (just applied): starts the
    /// new ones, stops those removed or changed (by fingerprint).
    pub fn sync(&mut self, rules: &[Rule]) {
        let wanted: HashMap<&str, &Rule> = rules
            .iter()
            .filter(|r| r.fleet.is_some())
            .map(|r| (r.name.as_str(), r))
            .collect();
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(name, run)| {
                wanted
                    .get(name.as_str())
                    .is_none_or(|r| r.fingerprint() != run.fingerprint)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            if let Some(run) = self.running.remove(&name) {
                let _ = run.stop.send(true);
            }
            self.status.lock().expect("fleet status").remove(&name);
        }
        for (name, rule) in wanted {
            if self.running.contains_key(name) {
                continue;
            }
            let Some(config) = &self.config else {
                tracing::warn!(
                    rule = name,
                    "rule {name:?} is fleet-wide but no fleet store is configured: \
                     it enforces its reserve only"
                );
                continue;
            };
            let spec = spec(rule, config);
            let node = Node::new(spec, config.store.clone(), Arc::clone(&self.enforcer));
            let (stop, stopped) = watch::channel(false);
            tokio::spawn(run(node, stopped, Arc::clone(&self.status)));
            self.running.insert(
                name.to_owned(),
                Running {
                    fingerprint: rule.fingerprint(),
                    stop,
                },
            );
        }
    }
}

fn spec(rule: &Rule, config: &FleetConfig) -> Spec {
    let fleet = rule.fleet.expect("a fleet rule");
    let rate = rule.fleet_rate().expect("a fleet rule");
    Spec {
        rule: super::RuleRef::of(rule),
        budget: Budget {
            global_rate: rate.rate,
            partitions: fleet.partitions,
            reserve_rate: fleet.reserve,
        },
        period: rate.period,
        fallback: match config.fail_open {
            Some(fraction) => Fallback::Open {
                rate: (rate.rate as f64 * fraction).ceil() as u64,
            },
            None => Fallback::Static,
        },
        ttl: config.lease_ttl,
    }
}

async fn run(mut node: Node, mut stopped: watch::Receiver<bool>, status: FleetStatus) {
    let mut ticks = tokio::time::interval(node.spec().tick());
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let retry_at = node.retry_at();
        let retry = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now).into());
        tokio::select! {
            _ = ticks.tick() => {
                node.tick().await;
            }
            _ = retry, if retry_at.is_some() => {
                node.retry().await;
            }
            _ = stopped.changed() => break,
        }
        status
            .lock()
            .expect("fleet status")
            .insert(node.status().rule.clone(), node.status().clone());
    }
    status
        .lock()
        .expect("fleet status")
        .remove(&node.spec().rule.name);
    node.release_all().await;
}
