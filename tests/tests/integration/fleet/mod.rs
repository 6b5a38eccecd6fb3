//! Fleet-wide limits on real traffic: three daemons, each in its own
//! network namespace (a host), each flooded from its own sender, share
//! one global budget through a real `redis-server` in a fourth namespace
//! that the hosts reach over links of their own. Admitted traffic is
//! counted at each host's receiver by nftables, independently of the
//! limiter's counters.
//!
//! A file per topic; this one holds the fleet and what the tests share.

mod failures;
mod sharing;
mod store;

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use limiter::lab::{RX_IFACE, fleet::FleetLab};
use limiter_tests::{Daemon, TempDir, ok, sources};

/// 3,000 pkts/s for the fleet in 30 partitions of 100, and 100 pkts/s
/// that each host keeps whatever the store says.
const GLOBAL: f64 = 3000.0;
const RESERVE: f64 = 100.0;
const PARTITIONS: u64 = 30;
const RULES: &str = "rules:
  - name: fleet-udp
    match: { source: 198.18.0.0/15 }
    limit: { rate: 1000000, unit: second }
    aggregate: { rate: 3000, unit: second, burst: 30, scope: fleet, partitions: 30, reserve: 100 }
";
/// Each host's flood: more than the whole budget.
const FLOOD_PPS: u64 = 4000;
const TTL: Duration = Duration::from_secs(2);
/// The one source every flood comes from.
const FLOOD_SOURCE: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));

struct Fleet {
    daemons: Vec<Mutex<Daemon>>,
    // Dropped after the daemons: they stop before their store and hosts.
    lab: FleetLab,
    _dir: TempDir,
}

impl Fleet {
    fn start(name: &str) -> Self {
        let dir = TempDir::new(name);
        let lab = FleetLab::create(name, 3, &dir.0).expect("fleet lab");
        let daemons = (0..3)
            .map(|n| {
                Daemon::start_with(
                    &lab.hosts[n],
                    &format!("{name}{n}"),
                    &[RX_IFACE],
                    RULES,
                    &lab.fleet_section(n, TTL),
                    &[],
                )
                .map(Mutex::new)
                .expect("daemon")
            })
            .collect();
        Self {
            daemons,
            lab,
            _dir: dir,
        }
    }

    /// Packets that arrived at each host so far.
    /// The flood's frames each receiver counted: its source's count alone,
    /// not the IPv6 neighbour discovery and MLD frames the interfaces send
    /// by themselves at moments of their own (which the counters also see).
    fn admitted(&self) -> Vec<u64> {
        self.lab
            .hosts
            .iter()
            .map(|lab| {
                let counts = lab.received().expect("receiver counters");
                counts.get(&FLOOD_SOURCE).copied().unwrap_or(0)
            })
            .collect()
    }

    /// Host `n`'s share of the rule, as `limiter rules show --json` says.
    fn share(&self, n: usize) -> serde_json::Value {
        let out = ok(self.daemons[n]
            .lock()
            .unwrap()
            .cli(&["rules", "show", "--json"]));
        let view: serde_json::Value = serde_json::from_str(&out).expect("rules show --json");
        view["fleet"][0].clone()
    }

    fn held(&self, n: usize) -> u64 {
        self.share(n)["held"].as_u64().unwrap_or(0)
    }

    /// Floods `hosts` for `duration` (each from its own source) while
    /// `during` runs on this thread.
    fn flood<T>(&self, hosts: &[usize], duration: Duration, during: impl FnOnce() -> T) -> T {
        thread::scope(|scope| {
            for &n in hosts {
                let lab = &self.lab.hosts[n];
                let sources = sources(lab, 0, &[FLOOD_SOURCE], FLOOD_PPS, 64);
                scope.spawn(move || {
                    let socket = lab.sender(0).expect("sender");
                    limiter::lab::flood(&socket, &sources, duration, |_| {}).expect("flooding")
                });
            }
            during()
        })
    }
}

/// Admitted per second between two readings, per host.
fn rates(before: &[u64], after: &[u64], over: Duration) -> Vec<f64> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (a - b) as f64 / over.as_secs_f64())
        .collect()
}

/// Measures each host's admitted rate over `window`.
fn measure(fleet: &Fleet, window: Duration) -> Vec<f64> {
    let (before, start) = (fleet.admitted(), Instant::now());
    thread::sleep(window);
    let after = fleet.admitted();
    rates(&before, &after, start.elapsed())
}

#[track_caller]
fn assert_rate(got: f64, expected: f64, percent: f64, what: &str) {
    let off = (got - expected) / expected * 100.0;
    assert!(
        off.abs() <= percent,
        "{what}: {got:.0} pkts/s, expected {expected:.0} ± {percent}% (off by {off:+.1}%)"
    );
}

/// Waits up to `within` for `done`; how long it took.
fn wait_for(within: Duration, done: impl FnMut() -> bool) -> Option<Duration> {
    wait_for_every(within, Duration::from_millis(100), done)
}

/// How long until `done` holds, checked every `period`; `None` if not
/// within `within`.
fn wait_for_every(
    within: Duration,
    period: Duration,
    mut done: impl FnMut() -> bool,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if done() {
            return Some(start.elapsed());
        }
        thread::sleep(period);
    }
    None
}

/// Each partition's lease owner (its token) in the store.
fn lease_owners(store: &mut redis::Connection) -> Vec<Option<String>> {
    let keys: Vec<String> = (0..PARTITIONS)
        .map(|p| format!("limiter:{{fleet-udp}}:{p}"))
        .collect();
    redis::cmd("MGET")
        .arg(&keys)
        .query(store)
        .expect("reading the leases")
}
