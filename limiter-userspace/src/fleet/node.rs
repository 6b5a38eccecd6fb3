//! One node's share of one global rule, tick by tick: renew what it holds,
//! lease or give back toward what its traffic asks ([`share::target`]),
//! and say what rate to enforce until the next tick. When Redis cannot be
//! reached, the node keeps only leases still valid, so its rate falls to
//! its reserve within one TTL (fail-static), or enforces a stated cap
//! (fail-open); it says so once, and leases again by itself once Redis
//! answers.

use std::time::Instant;

use super::{
    lease::{LeaseError, Leases},
    share::{self, Budget, Demand},
};

/// What a node enforces while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Its reserve, and the leases it holds until they run out.
    Static,
    /// This rate, whatever it holds (the fleet may then exceed the global
    /// limit by the nodes' caps).
    Open { rate: u64 },
}

pub struct Node {
    leases: Leases,
    budget: Budget,
    fallback: Fallback,
    /// Since when Redis has not answered.
    down_since: Option<Instant>,
}

impl Node {
    pub fn new(leases: Leases, budget: Budget, fallback: Fallback) -> Self {
        Self {
            leases,
            budget,
            fallback,
            down_since: None,
        }
    }

    /// Whether Redis answered the last tick.
    pub fn store_up(&self) -> bool {
        self.down_since.is_none()
    }

    /// Partitions held and valid now.
    pub fn held(&self) -> u32 {
        self.leases.held(Instant::now()) as u32
    }

    /// One tick, with the demand since the last one: returns the rate to
    /// enforce until the next tick.
    pub async fn tick(&mut self, demand: Demand) -> u64 {
        match self.exchange(demand).await {
            Ok(()) => {
                if let Some(since) = self.down_since.take() {
                    tracing::info!(
                        "fleet store reachable again after {:.1} s: leasing",
                        since.elapsed().as_secs_f64()
                    );
                }
            }
            Err(e) => {
                if self.down_since.is_none() {
                    tracing::warn!(
                        "fleet store unreachable ({e}); enforcing {}",
                        match self.fallback {
                            Fallback::Static =>
                                "the reserve and the leases held until they run out".to_owned(),
                            Fallback::Open { rate } => format!("{rate}/s (fail-open)"),
                        }
                    );
                    self.down_since = Some(Instant::now());
                }
            }
        }
        match (self.down_since, self.fallback) {
            (Some(_), Fallback::Open { rate }) => rate,
            _ => self.budget.local_rate(self.held()),
        }
    }

    async fn exchange(&mut self, demand: Demand) -> Result<(), LeaseError> {
        self.leases.renew().await?;
        let held = self.held();
        let target = share::target(&self.budget, held, demand);
        if target > held {
            self.leases.acquire(target - held).await?;
        } else if target < held {
            self.leases.release(held - target).await?;
        }
        Ok(())
    }
}
