//! One node's share of one fleet rule, tick by tick: read what the rule's
//! aggregate admitted and refused, renew what it holds, lease or give back
//! toward what its traffic asks ([`share::target`]), and enforce the
//! result with the moment it lapses ([`Grant`]). Partitions are given back
//! only after the lowered share is enforced, and a share always lapses
//! before any lease it counts can expire in the store, so the node never
//! enforces a partition another node may hold, whatever the timing.
//!
//! When the store cannot be reached, the leases still valid keep counting
//! until they lapse, so the share falls to the reserve within one TTL
//! (fail-static), or the node enforces a stated cap (fail-open); it says
//! so once, and leases again by itself once the store answers.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use super::{
    Enforcer, Grant, RuleCounts, RuleRef,
    lease::{LeaseError, Leases},
    share::{self, Budget, Demand},
    store::StoreConfig,
};
use crate::clock::monotonic_ns;

/// The round trips of one exchange with the store, at most: a renewal (or
/// a ping), the report, and an acquisition or a release, one script each.
const EXCHANGE_ROUND_TRIPS: u32 = 3;

/// A retry's delay after an expiry this host's clock expects (the store
/// counted it from a moment a little later), and at the least.
const RETRY_MARGIN: Duration = Duration::from_millis(2);
const RETRY_MIN: Duration = Duration::from_millis(5);

/// What a node enforces while the store cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Its reserve, and the leases it holds until they lapse.
    Static,
    /// This rate, whatever it holds (the fleet may then exceed the global
    /// limit by the nodes' caps).
    Open { rate: u64 },
}

/// One fleet rule as a node shares it.
#[derive(Clone, Debug)]
pub struct Spec {
    pub rule: RuleRef,
    pub budget: Budget,
    /// The unit the budget's rates are per.
    pub period: Duration,
    pub fallback: Fallback,
    pub ttl: Duration,
}

impl Spec {
    /// Ten renewals per TTL.
    pub fn tick(&self) -> Duration {
        self.ttl / 10
    }
}

/// A node's share of a rule as metrics and `rules show` report it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ShareStatus {
    pub rule: String,
    /// The unit the rates are per, in seconds.
    pub unit_seconds: f64,
    pub fleet_rate: u64,
    pub partitions: u32,
    pub partition_rate: u64,
    pub reserve: u64,
    /// Partitions held and counted in the share.
    pub held: u32,
    /// The share enforced now (reserve included).
    pub local_rate: u64,
    pub store_up: bool,
    pub leases_acquired: u64,
    pub leases_renewed: u64,
    pub leases_lost: u64,
    pub leases_released: u64,
    /// The last round trip to the store (a renewal or a ping).
    pub store_rtt_seconds: f64,
    /// Malformed entries found (and deleted) in the store's list of nodes.
    #[serde(default)]
    pub store_malformed_entries: u64,
    /// Partitions held, at the last report, under a token no node of the
    /// fleet reports: a foreign writer's, budget no node can lease.
    #[serde(default)]
    pub store_foreign_partitions: u32,
}

pub struct Node {
    spec: Spec,
    store: StoreConfig,
    /// Connected on first use, so a node starts while the store is down.
    leases: Option<Leases>,
    enforcer: Arc<dyn Enforcer>,
    /// Since when the store has not answered.
    down_since: Option<Instant>,
    last_counts: Option<(Instant, RuleCounts)>,
    /// What the last tick measured, for a retry before the next.
    last_demand: Option<Demand>,
    /// When to try again before the next tick: a lease this node wants is
    /// about to expire in the store.
    retry_at: Option<Instant>,
    status: ShareStatus,
}

impl Node {
    pub fn new(spec: Spec, store: StoreConfig, enforcer: Arc<dyn Enforcer>) -> Self {
        let budget = spec.budget;
        let status = ShareStatus {
            rule: spec.rule.name.clone(),
            unit_seconds: spec.period.as_secs_f64(),
            fleet_rate: budget.global_rate,
            partitions: budget.partitions,
            partition_rate: budget.partition_rate(),
            reserve: budget.reserve_rate,
            local_rate: budget.reserve_rate,
            ..ShareStatus::default()
        };
        Self {
            spec,
            store,
            leases: None,
            enforcer,
            down_since: None,
            last_counts: None,
            last_demand: None,
            retry_at: None,
            status,
        }
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    pub fn status(&self) -> &ShareStatus {
        &self.status
    }

    /// Whether the store answered the last tick.
    pub fn store_up(&self) -> bool {
        self.down_since.is_none()
    }

    /// When to [`Node::retry`] before the next tick, if at all: a node
    /// that wants partitions others hold takes them the moment they expire
    /// (their owner died), not up to a tick later.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// One tick: the share to enforce until the next, enforced.
    pub async fn tick(&mut self) -> Grant {
        self.last_demand = self.demand().await;
        self.step(self.last_demand).await
    }

    /// Between ticks: what the last tick did, on the demand it measured
    /// (a few milliseconds of traffic would tell nothing).
    pub async fn retry(&mut self) -> Grant {
        self.step(self.last_demand).await
    }

    async fn step(&mut self, demand: Option<Demand>) -> Grant {
        self.retry_at = None;
        // Safety does not depend on this limit (shares lapse by
        // themselves); it keeps a store that hangs from stalling the loop.
        // A store slower than a tick but within its response timeout is
        // waited for: an exchange is at most `EXCHANGE_ROUND_TRIPS`, and
        // the leases, valid for most of a TTL from each renewal, outlast
        // ticks that run late.
        let limit = (self.spec.tick() * 2).max(self.store.response_timeout * EXCHANGE_ROUND_TRIPS);
        let outcome = match tokio::time::timeout(limit, self.exchange(demand)).await {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err(format!(
                "no answer within {}",
                humantime::format_duration(limit)
            )),
        };
        match outcome {
            Ok(()) => {
                if let Some(since) = self.down_since.take() {
                    tracing::info!(
                        rule = %self.spec.rule.name,
                        "fleet store reachable again after {:.1} s: leasing",
                        since.elapsed().as_secs_f64()
                    );
                }
            }
            Err(e) => {
                if self.down_since.is_none() {
                    tracing::warn!(
                        rule = %self.spec.rule.name,
                        "fleet store unreachable ({e}); enforcing {}",
                        match self.spec.fallback {
                            Fallback::Static =>
                                "the reserve and the leases held until they lapse".to_owned(),
                            Fallback::Open { rate } => format!("{rate}/unit (fail-open)"),
                        }
                    );
                    self.down_since = Some(Instant::now());
                } else {
                    tracing::debug!(rule = %self.spec.rule.name, "fleet store unreachable: {e}");
                }
            }
        }
        let grant = self.grant();
        self.enforce(grant).await;
        self.status.store_up = self.store_up();
        grant
    }

    /// The share to enforce until the next tick: the fail-open cap while
    /// the store is down (if so configured), else what the leases allow.
    fn grant(&self) -> Grant {
        match (self.down_since, self.spec.fallback) {
            (Some(_), Fallback::Open { rate }) => {
                let now = Instant::now();
                Grant {
                    local: rate,
                    until_ns: at_ns(now + self.spec.tick() * 3),
                }
            }
            _ => self.lease_grant(),
        }
    }

    /// The share the leases valid now allow, until the first of them
    /// lapses. Leases that lapse before the next tick are not counted.
    fn lease_grant(&self) -> Grant {
        let horizon = Instant::now() + self.spec.tick() * 2;
        let (held, lapse) = self
            .leases
            .as_ref()
            .map_or((0, None), |l| l.valid_beyond(horizon));
        Grant {
            local: self.spec.budget.local_rate(held),
            until_ns: lapse.map_or(1, at_ns),
        }
    }

    /// Runs `f` on the enforcer off the runtime's threads (it may wait for
    /// the engine's lock); `None`, logged as `what`, when it fails.
    async fn on_enforcer<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(&dyn Enforcer, &RuleRef) -> anyhow::Result<T> + Send + 'static,
    ) -> Option<T> {
        let enforcer = Arc::clone(&self.enforcer);
        let rule = self.spec.rule.clone();
        let result = tokio::task::spawn_blocking(move || f(enforcer.as_ref(), &rule))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r);
        result
            .map_err(|e| tracing::warn!(rule = %self.spec.rule.name, "{what}: {e:#}"))
            .ok()
    }

    async fn enforce(&mut self, grant: Grant) -> bool {
        let enforced = self
            .on_enforcer("enforcing the fleet share", move |e, rule| {
                e.enforce(rule, grant)
            })
            .await
            .is_some();
        if enforced {
            self.status.local_rate = grant.local;
            self.status.held = self
                .leases
                .as_ref()
                .map_or(0, |l| l.valid_beyond(Instant::now()).0);
        }
        enforced
    }

    /// What the rule admitted and refused since the last tick, per unit;
    /// `None` when it cannot be told (keep what is held then).
    async fn demand(&mut self) -> Option<Demand> {
        let counts = self
            .on_enforcer("reading the rule's counters", |e, rule| e.counts(rule))
            .await?;
        let now = Instant::now();
        let (then, last) = self.last_counts.replace((now, counts))?;
        let per_unit = |n: u64| share::per_unit(n, self.spec.period, now.duration_since(then));
        Some(Demand {
            // A rule whose counters restarted (a new id) starts over.
            admitted_rate: per_unit(counts.admitted.saturating_sub(last.admitted)),
            refused_rate: per_unit(counts.refused.saturating_sub(last.refused)),
        })
    }

    async fn exchange(&mut self, demand: Option<Demand>) -> Result<(), LeaseError> {
        if self.leases.is_none() {
            let leases = Leases::new(
                &self.store,
                &self.spec.rule.name,
                self.spec.budget.partitions,
                self.spec.ttl,
            )
            .await?;
            self.leases = Some(leases);
        }
        let leases = self.leases.as_mut().expect("connected");
        let sent = Instant::now();
        let renewing = leases.partitions().len() as u64;
        if renewing == 0 {
            leases.ping().await?;
        } else {
            let lost = leases.renew().await?.len() as u64;
            self.status.leases_lost += lost;
            self.status.leases_renewed += renewing - lost;
        }
        self.status.store_rtt_seconds = sent.elapsed().as_secs_f64();
        let held = leases.held(Instant::now()) as u32;
        let hungry = demand.is_some_and(|d| d.refused_rate > 0);
        let peers = leases.report(hungry).await?;
        if foreign_appeared(self.status.store_foreign_partitions, peers.foreign) {
            tracing::warn!(
                event = "fleet_store_foreign_leases",
                rule = %self.spec.rule.name,
                partitions = peers.foreign,
                "fleet rule {:?}: {} partitions are leased under a token no node reports (another writer on the store's keys)",
                self.spec.rule.name,
                peers.foreign
            );
        }
        self.status.store_foreign_partitions = peers.foreign;
        if peers.malformed > 0 {
            self.status.store_malformed_entries += u64::from(peers.malformed);
            tracing::warn!(
                event = "fleet_store_malformed",
                rule = %self.spec.rule.name,
                entries = peers.malformed,
                "fleet rule {:?}: {} malformed entries in the store's list of nodes, deleted and left out",
                self.spec.rule.name,
                peers.malformed
            );
        }
        let mut target = demand.map_or(held, |d| share::target(&self.spec.budget, held, d));
        if let Some(cap) = share::fair_cap(&self.spec.budget, hungry, peers) {
            target = target.min(cap);
        }
        if peers.memory < self.spec.ttl {
            // A store that lost its memory: wait until every lease it may
            // have forgotten has lapsed wherever it is enforced.
            target = target.min(held);
        }
        if target > held {
            let gained = leases.acquire(target - held).await?;
            self.status.leases_acquired += gained.len() as u64;
            self.retry_at = retry_at(leases.next_free(), Instant::now(), sent + self.spec.tick());
        } else if target < held {
            // Lowered first, given back after: never two nodes on one
            // partition. If the lower share cannot be enforced, the
            // partitions are not renewed and lapse by themselves.
            let given = leases.forget(held - target);
            // What the leases allow, even if the store was down a moment
            // ago under fail-open: the cap is no share of these partitions.
            if self.enforce(self.lease_grant()).await {
                let leases = self.leases.as_mut().expect("connected");
                leases.free(&given).await?;
            }
            self.status.leases_released += given.len() as u64;
        }
        Ok(())
    }

    /// Gives back every partition, once nothing enforces them (the rule is
    /// gone from the kernel or the limiter).
    pub async fn release_all(&mut self) {
        if let Some(leases) = self.leases.as_mut() {
            let all = leases.forget(u32::MAX);
            let _ = tokio::time::timeout(self.spec.tick(), leases.free(&all)).await;
        }
    }
}

/// When to ask again for partitions the store said would be free at
/// `next_free`: a little after, since the store may expire a key a little
/// after this host's clock says, and not within a few milliseconds of
/// `now`; not at all if the next tick comes first.
fn retry_at(next_free: Option<Instant>, now: Instant, next_tick: Instant) -> Option<Instant> {
    next_free
        .map(|at| (at + RETRY_MARGIN).max(now + RETRY_MIN))
        .filter(|&at| at < next_tick)
}

/// Foreign leases are warned of as they appear, not at every tick they
/// stay.
fn foreign_appeared(before: u32, now: u32) -> bool {
    now > 0 && before == 0
}

/// `at` on the monotonic clock the kernel and layer 7 keep time in. The
/// clock is read before the instant is, so the result errs early, never
/// late.
fn at_ns(at: Instant) -> u64 {
    let monotonic = monotonic_ns();
    let ahead =
        u64::try_from(at.saturating_duration_since(Instant::now()).as_nanos()).unwrap_or(u64::MAX);
    monotonic.saturating_add(ahead)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{RETRY_MARGIN, RETRY_MIN, foreign_appeared, retry_at};

    #[test]
    fn a_retry_follows_the_freed_partitions_before_the_next_tick() {
        let now = Instant::now();
        let tick = now + Duration::from_millis(200);
        let ms = Duration::from_millis;
        assert_eq!(retry_at(None, now, tick), None);
        assert_eq!(
            retry_at(Some(now + ms(50)), now, tick),
            Some(now + ms(50) + RETRY_MARGIN)
        );
        // Free already (or the store's clock ahead): a few ms from now.
        assert_eq!(retry_at(Some(now), now, tick), Some(now + RETRY_MIN));
        // After the next tick, which asks anyway.
        assert_eq!(retry_at(Some(now + ms(300)), now, tick), None);
        assert_eq!(retry_at(Some(tick - RETRY_MARGIN), now, tick), None);
    }

    #[test]
    fn foreign_leases_are_warned_of_once() {
        assert!(foreign_appeared(0, 3));
        assert!(!foreign_appeared(3, 3), "still there");
        assert!(!foreign_appeared(3, 5), "more of them");
        assert!(!foreign_appeared(0, 0));
        assert!(!foreign_appeared(3, 0), "gone");
    }
}
