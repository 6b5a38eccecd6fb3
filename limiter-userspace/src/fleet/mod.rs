//! Fleet-wide limits: one rule's aggregate budget shared by every node
//! that has the rule, split into equal partitions that nodes lease from
//! Redis ahead of time, so a packet or a request only ever checks local
//! state. The store's settings ([`store`]), the leases ([`lease`]), how
//! many to hold ([`share`]), one node's share of one rule tick by tick,
//! the store being down included ([`node`]), and the rules a node runs
//! ([`manager`]). Where the share is enforced (the kernel for the daemon,
//! layer 7 for the proxy) is behind [`Enforcer`].

pub mod lease;
pub mod manager;
pub mod node;
pub mod share;
pub mod store;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use manager::{Fleet, FleetStatus};
pub use store::StoreConfig;

/// A node's share of a fleet rule's aggregate: `local` per the rule's unit
/// until `until_ns` (monotonic), after which its reserve applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub local: u64,
    pub until_ns: u64,
}

/// What a fleet rule's aggregate admitted and refused, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleCounts {
    pub admitted: u64,
    pub refused: u64,
}

/// A fleet rule as its loop knows it: the name (its key in the store) and
/// the fingerprint of what its buckets mean, so a share never lands on a
/// rule that a reload changed or renamed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RuleRef {
    pub name: String,
    pub fingerprint: u64,
}

impl RuleRef {
    pub fn of(rule: &crate::rules::Rule) -> Self {
        Self {
            name: rule.name.clone(),
            fingerprint: rule.fingerprint(),
        }
    }
}

/// Where a node enforces its shares and reads its demand. Both refuse a
/// rule whose fingerprint is no longer the one in force.
pub trait Enforcer: Send + Sync + 'static {
    fn counts(&self, rule: &RuleRef) -> anyhow::Result<RuleCounts>;
    fn enforce(&self, rule: &RuleRef, grant: Grant) -> anyhow::Result<()>;
}

/// The `fleet:` section of the daemon's configuration (and the file
/// `limiter proxy --fleet` reads).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    pub store: StoreConfig,
    /// How long a lease lasts without renewal: a dead node's partitions
    /// are free again after it; shares are renewed ten times within it.
    #[serde(default = "default_ttl", with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// While the store cannot be reached, each node allows this fraction
    /// of each fleet rule's rate (fail-open); absent, only its reserve and
    /// the leases it holds until they lapse (fail-static).
    #[serde(default)]
    pub fail_open: Option<f64>,
}

fn default_ttl() -> Duration {
    Duration::from_secs(2)
}

impl FleetConfig {
    /// Checks what serde cannot; `section` names it in errors.
    pub fn validate(&self, section: &str) -> anyhow::Result<()> {
        if self.lease_ttl < lease::MIN_TTL {
            anyhow::bail!(
                "{section}.lease_ttl: {} is shorter than {}",
                humantime::format_duration(self.lease_ttl),
                humantime::format_duration(lease::MIN_TTL)
            );
        }
        if let Some(f) = self.fail_open
            && !(f > 0.0 && f <= 1.0)
        {
            anyhow::bail!("{section}.fail_open: {f} is not a fraction in (0, 1]");
        }
        self.store
            .check()
            .map_err(|e| anyhow::anyhow!("{section}.{e}"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::{path::Path, time::Duration};

    use super::FleetConfig;

    fn config(text: &str) -> FleetConfig {
        crate::yaml::parse(text, Path::new("fleet.yaml")).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Guards the `fleet:` section's defaults and bounds: a lease lasts 2 s
    /// unless told, at least 100 ms; `fail_open` is a fraction in (0, 1];
    /// the store's own checks run too, each error naming its field.
    #[test]
    fn the_fleet_section_is_checked() {
        let url = "store: { url: \"redis://127.0.0.1:6379/\" }\n";
        let plain = config(url);
        assert_eq!(plain.lease_ttl, Duration::from_secs(2));
        assert_eq!(plain.fail_open, None);
        plain.validate("fleet").expect("the defaults");
        for ok in ["lease_ttl: 100ms", "fail_open: 1.0", "fail_open: 0.25"] {
            config(&format!("{url}{ok}\n"))
                .validate("fleet")
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (wrong, says) in [
            (
                "lease_ttl: 99ms",
                "fleet.lease_ttl: 99ms is shorter than 100ms",
            ),
            (
                "fail_open: 0",
                "fleet.fail_open: 0 is not a fraction in (0, 1]",
            ),
            ("fail_open: 1.5", "fleet.fail_open: 1.5 is not a fraction"),
            ("fail_open: -0.5", "fleet.fail_open: -0.5 is not a fraction"),
        ] {
            let e = config(&format!("{url}{wrong}\n"))
                .validate("fleet")
                .expect_err(wrong)
                .to_string();
            assert!(e.contains(says), "{wrong}: {e}");
        }
        let e = config("store: { url: \"redis://:pw@127.0.0.1/\" }\n")
            .validate("fleet")
            .expect_err("a password in the URL")
            .to_string();
        assert!(e.contains("fleet.store.url: the password belongs"), "{e}");
    }
}
