//! The fleet manager driven whole from the daemon's configuration: a
//! `daemon.yaml` whose `fleet:` section names every store field, loaded as
//! the daemon loads it, and a rule file with a fleet rule, run by
//! [`Fleet`] against real `redis-server`s the tests start on loopback
//! (plain with an ACL user and a password from a file or the environment,
//! TLS with a client certificate, a three-master cluster). What the
//! manager enforced is read from the enforcer it drives.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use limiter::{
    daemon::DaemonConfig,
    fleet::{
        Enforcer, Fleet, FleetConfig, Grant, RuleCounts, RuleRef, lease::Leases, node::ShareStatus,
        store::StoreConfig,
    },
    lab::store::{RedisCluster, RedisServer, certificates},
    rules::RuleSet,
};

/// 8,000 a second in 8 partitions of 1,000, a reserve of 100.
const RULES: &str = "rules:
  - name: edge-fleet
    match: { source: 198.18.0.0/15 }
    limit: { rate: 5000, unit: second }
    aggregate: { rate: 8000, unit: second, burst: 800, scope: fleet, partitions: 8, reserve: 100 }
";
const RESERVE: u64 = 100;
const EVERYTHING: u64 = 8_100;

/// The longest a test waits for the manager to lease everything: a fresh
/// store hands out nothing for one TTL, and a machine busy with other
/// tests' servers may take several ticks more.
const SETTLE: Duration = Duration::from_secs(10);

/// A rule's traffic: always more than it is allowed (its aggregate refuses
/// some of it every tick), and every grant the manager enforced, when.
#[derive(Default)]
struct Flooded {
    refused: AtomicU64,
    grants: Mutex<Vec<(Instant, Grant)>>,
}

impl Flooded {
    fn last(&self) -> Option<Grant> {
        self.grants.lock().unwrap().last().map(|(_, g)| *g)
    }

    fn since(&self, at: Instant) -> Vec<u64> {
        let grants = self.grants.lock().unwrap();
        grants
            .iter()
            .filter(|(t, _)| *t >= at)
            .map(|(_, g)| g.local)
            .collect()
    }

    async fn wait_for(&self, within: Duration, what: impl Fn(u64) -> bool) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.last().is_some_and(|g| what(g.local)) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }
}

impl Enforcer for Flooded {
    fn counts(&self, rule: &RuleRef) -> anyhow::Result<RuleCounts> {
        assert_eq!(rule.name, "edge-fleet");
        Ok(RuleCounts {
            admitted: 0,
            refused: self.refused.fetch_add(10_000, Ordering::Relaxed),
        })
    }

    fn enforce(&self, rule: &RuleRef, grant: Grant) -> anyhow::Result<()> {
        assert_eq!(rule.name, "edge-fleet");
        self.grants.lock().unwrap().push((Instant::now(), grant));
        Ok(())
    }
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("limiter-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The daemon's configuration with `fleet` (a `fleet:` section's body,
/// indented by two), loaded as `limiter daemon --config` loads it.
fn daemon_config(dir: &Dir, fleet: &str) -> FleetConfig {
    dir.write("rules.yaml", RULES);
    let path = dir.write(
        "daemon.yaml",
        &format!("rules: rules.yaml\ninterfaces:\n  - {{ name: lo }}\nfleet:\n{fleet}"),
    );
    DaemonConfig::load(&path)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .fleet
        .expect("a fleet section")
}

fn rules() -> RuleSet {
    RuleSet::parse(RULES, Path::new("rules.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

/// Starts the manager on the rule file's fleet rule.
fn manage(config: FleetConfig, traffic: &Arc<Flooded>) -> Fleet {
    let mut fleet = Fleet::new(Some(config), traffic.clone());
    fleet.sync(&rules().rules);
    fleet
}

/// The rule's status once `what` holds of it, or after a second (a tick
/// publishes it after enforcing what the traffic sees).
async fn status_when(fleet: &Fleet, what: impl Fn(&ShareStatus) -> bool) -> ShareStatus {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let status = fleet.status().lock().unwrap()["edge-fleet"].clone();
        if what(&status) || Instant::now() >= deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn redis(password: Option<&str>) -> RedisServer {
    RedisServer::start(None, &[Ipv4Addr::LOCALHOST.into()], 0, password)
        .expect("redis-server (cargo xtask setup installs it)")
}

/// Guards the fallbacks as configured: with the store gone, `fail_open:
/// 0.25` enforces a quarter of the fleet's rate (2,000 of 8,000, not the
/// whole rate nor what it held), and without `fail_open` the share falls
/// to the reserve within the configured `lease_ttl`; with the store back
/// (empty), leasing resumes; a rule file without the rule gives its
/// partitions back at once (free for another node before they could have
/// expired).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_down_falls_back_as_the_configuration_says() {
    for fail_open in [Some(0.25), None] {
        let dir = Dir::new("fleet-fallback");
        let password = format!("fleet-{}", std::process::id());
        let mut redis = redis(Some(&password));
        let password_file = dir.write("password", &format!("{password}\n"));
        let ttl = Duration::from_millis(1500);
        let config = daemon_config(
            &dir,
            &format!(
                "  store:\n    url: {}\n    user: default\n    password_file: {}\n    \
                 connect_timeout: 200ms\n    response_timeout: 200ms\n  lease_ttl: 1500ms\n{}",
                redis.url(),
                password_file.display(),
                fail_open.map_or(String::new(), |f| format!("  fail_open: {f}\n")),
            ),
        );
        assert_eq!(config.lease_ttl, ttl);
        assert_eq!(config.fail_open, fail_open);
        let traffic = Arc::new(Flooded::default());
        let mut fleet = manage(config, &traffic);
        assert!(
            traffic.wait_for(SETTLE, |local| local == EVERYTHING).await,
            "{fail_open:?}: did not lease every partition: {:?}",
            fleet.status()
        );
        // The status is published after the tick that enforced the share.
        let status = status_when(&fleet, |s| s.held == 8).await;
        assert!(status.store_up && status.held == 8, "{status:?}");

        redis.stop();
        let stopped = Instant::now();
        let stopped_ns = limiter::clock::monotonic_ns();
        let expected = match fail_open {
            Some(_) => 2_000,
            None => RESERVE,
        };
        // Fail-open: at the first tick that finds the store gone (a tick
        // is 150 ms; the commands time out after 200 ms). Fail-static: once
        // the last renewal's 0.9 TTL has passed.
        assert!(
            traffic.wait_for(ttl * 2, |local| local == expected).await,
            "{fail_open:?}: enforced {:?} with the store down",
            traffic.since(stopped)
        );
        println!(
            "{fail_open:?}: {expected} in force {:?} after the store stopped",
            stopped.elapsed()
        );
        // A share counting leases lapses by itself 0.9 TTL after the last
        // renewal was sent, before the store can give them to another.
        let lapse_ns = stopped_ns + ttl.mul_f64(0.9).as_nanos() as u64;
        let grants = traffic.grants.lock().unwrap().clone();
        assert!(
            grants
                .iter()
                .filter(|(t, g)| *t >= stopped && g.local > expected)
                .all(|(_, g)| g.until_ns <= lapse_ns),
            "a share outlived its leases: {grants:?}"
        );
        // Nothing above what it held, and once fallen back, it stays.
        tokio::time::sleep(ttl / 2).await;
        let after = traffic.since(stopped);
        assert!(after.iter().all(|&local| local <= EVERYTHING), "{after:?}");
        assert_eq!(traffic.last().map(|g| g.local), Some(expected));
        assert!(!status_when(&fleet, |s| !s.store_up).await.store_up);

        redis.resume().expect("redis-server again");
        assert!(
            traffic.wait_for(SETTLE, |local| local == EVERYTHING).await,
            "{fail_open:?}: leasing did not resume: {:?}",
            traffic.since(stopped)
        );
        // The rule gone from the rule file: its partitions are given back.
        fleet.sync(&[]);
        let mut other = Leases::new(
            &StoreConfig {
                password_file: Some(password_file.clone()),
                ..StoreConfig::at(redis.url())
            },
            "edge-fleet",
            8,
            ttl,
        )
        .await
        .unwrap();
        let synced = Instant::now();
        let mut taken = 0;
        while taken < 8 && synced.elapsed() < ttl / 2 {
            taken += other.acquire(8).await.unwrap().len();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(taken, 8, "not given back within half a TTL");
        assert!(fleet.status().lock().unwrap().is_empty());
    }
}

/// Guards the store fields end to end: the manager leases every partition
/// with a password from the environment, over TLS with the configured CA
/// and client certificate, and on a Redis Cluster (`cluster: true`); a
/// wrong password or a missing client certificate leases nothing and
/// leaves the rule at its reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manager_leases_through_every_kind_of_store() {
    let dir = Dir::new("fleet-stores");
    async fn leases_everything(config: FleetConfig) -> bool {
        let traffic = Arc::new(Flooded::default());
        let _fleet = manage(config, &traffic);
        traffic.wait_for(SETTLE, |local| local == EVERYTHING).await
    }
    async fn stays_at_the_reserve(config: FleetConfig) {
        let traffic = Arc::new(Flooded::default());
        let fleet = manage(config, &traffic);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let status = fleet.status().lock().unwrap()["edge-fleet"].clone();
        assert!(!status.store_up, "{status:?}");
        let grants = traffic.grants.lock().unwrap().clone();
        assert!(
            !grants.is_empty() && grants.iter().all(|(_, g)| g.local == RESERVE),
            "{grants:?}"
        );
    }

    // The environment's PATH is the password: a variable that is there,
    // without setting one in a test process that runs threads.
    let secret = std::env::var("PATH").expect("PATH");
    let redis_env = redis(Some(&secret));
    let store = |url: String, extra: &str| {
        format!(
            "  store:\n    url: {url}\n{extra}    connect_timeout: 300ms\n    \
             response_timeout: 300ms\n  lease_ttl: 1s\n"
        )
    };
    let env = daemon_config(&dir, &store(redis_env.url(), "    password_env: PATH\n"));
    assert!(leases_everything(env).await, "password_env");
    let wrong = dir.write("wrong", "wrong\n");
    let wrong = daemon_config(
        &dir,
        &store(
            redis_env.url(),
            &format!("    password_file: {}\n", wrong.display()),
        ),
    );
    stays_at_the_reserve(wrong).await;
    drop(redis_env);

    let (tls, cert, key) = certificates(&dir.0).expect("openssl (cargo xtask setup installs it)");
    let ca = tls.ca.clone();
    let redis_tls = RedisServer::start_tls(None, &[Ipv4Addr::LOCALHOST.into()], 0, None, Some(tls))
        .expect("redis-server with TLS");
    let tls = daemon_config(
        &dir,
        &store(
            redis_tls.url(),
            &format!(
                "    ca_file: {}\n    cert_file: {}\n    key_file: {}\n",
                ca.display(),
                cert.display(),
                key.display()
            ),
        ),
    );
    assert!(leases_everything(tls).await, "TLS");
    let no_client_cert = daemon_config(
        &dir,
        &store(redis_tls.url(), &format!("    ca_file: {}\n", ca.display())),
    );
    stays_at_the_reserve(no_client_cert).await;
    drop(redis_tls);

    let cluster_dir = Dir::new("fleet-cluster");
    let cluster = RedisCluster::start(3, &cluster_dir.0).expect("a redis cluster");
    let clustered = daemon_config(&dir, &store(cluster.url(), "    cluster: true\n"));
    assert!(clustered.store.cluster);
    assert!(leases_everything(clustered).await, "cluster");
}
