//! Fleet-wide limits on real traffic: three daemons, each in its own
//! network namespace (a host), each flooded from its own sender, share
//! one global budget through a real `redis-server` in a fourth namespace
//! that the hosts reach over links of their own. Admitted traffic is
//! counted at each host's receiver by nftables, independently of the
//! limiter's counters.

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

/// Three hosts flooded at once admit the global rate plus their reserves
/// together, counted at their receivers; when the flood moves to one
/// host, the capacity follows it within a few seconds.
#[test]
fn three_hosts_share_one_budget_and_capacity_follows_the_flood() {
    let fleet = Fleet::start("fs");
    let bound = GLOBAL + 3.0 * RESERVE;
    let (all, held) = fleet.flood(&[0, 1, 2], Duration::from_secs(9), || {
        thread::sleep(Duration::from_millis(2500));
        let rates = measure(&fleet, Duration::from_secs(5));
        // Read while all three are still flooded: once the flood stops,
        // an idle host gives its partitions back.
        let held: u64 = (0..3).map(|n| fleet.held(n)).sum();
        (rates, held)
    });
    let total: f64 = all.iter().sum();
    println!("three hosts flooded: {all:.0?} pkts/s, {total:.0} together (bound {bound})");
    assert_rate(total, bound, 5.0, "the fleet's admitted total");
    assert!(
        all.iter().all(|&r| r >= RESERVE * 0.9),
        "a host got less than its reserve: {all:.0?}"
    );
    assert_eq!(held, PARTITIONS, "every partition held, none twice");

    // The flood moves to host 1 alone.
    let (followed, alone) = fleet.flood(&[1], Duration::from_secs(8), || {
        let followed = wait_for(Duration::from_secs(5), || fleet.held(1) == PARTITIONS);
        thread::sleep(Duration::from_millis(500));
        (followed, measure(&fleet, Duration::from_secs(3)))
    });
    let followed = followed.expect("host 1 did not get every partition within 5 s");
    println!("capacity followed the flood to host 1 in {followed:?}: {alone:.0?} pkts/s");
    assert!(
        followed < Duration::from_secs(3),
        "followed in {followed:?}"
    );
    assert_rate(
        alone[1],
        GLOBAL + RESERVE,
        5.0,
        "host 1 holding the whole budget",
    );
    assert_eq!(alone[0] + alone[2], 0.0, "hosts 0 and 2 were not flooded");
}

/// A host killed with -9 keeps enforcing in its kernel, but its share
/// lapses there by itself before its leases expire in the store, and the
/// others take them within a TTL; with the store gone every host falls
/// back to its reserve within a TTL, the fleet never above its budget;
/// with the store back, leasing resumes.
#[test]
fn a_dead_host_and_a_dead_store_never_let_the_fleet_over_its_budget() {
    let fleet = Fleet::start("fd");
    let bound = GLOBAL + 3.0 * RESERVE;
    let mut store = fleet.lab.store_connection().expect("watching the store");
    let (taken, after_kill) = fleet.flood(&[0, 1, 2], Duration::from_secs(10), || {
        thread::sleep(Duration::from_secs(2));
        assert!(fleet.held(1) > 0, "host 1 held nothing before the kill");
        let mut host1 = fleet.daemons[1].lock().unwrap();
        // Its leases' token names its process.
        let token = format!("-{}-", host1.pid().expect("host 1 runs"));
        host1.kill9();
        drop(host1);
        let taken = wait_for_every(TTL * 3, Duration::from_millis(2), || {
            let owners = lease_owners(&mut store);
            owners
                .iter()
                .all(|o| o.as_ref().is_some_and(|o| !o.contains(&token)))
        });
        assert!(
            wait_for(TTL, || fleet.held(0) + fleet.held(2) == PARTITIONS).is_some(),
            "hosts 0 and 2 do not count every partition"
        );
        thread::sleep(TTL.saturating_sub(taken.unwrap_or_default()));
        (taken, measure(&fleet, Duration::from_secs(3)))
    });
    let taken = taken.expect("the dead host's partitions were not taken");
    println!("host 1 killed: its partitions taken in {taken:?}; then {after_kill:.0?} pkts/s");
    // Its last renewal reached the store before the kill, so its leases
    // expired within a TTL of it; the hungry hosts take them as they do
    // (the margin: the store watched every 2 ms, a retry's 2 ms, a busy
    // machine's scheduling).
    assert!(
        taken <= TTL + Duration::from_millis(30),
        "taken in {taken:?}"
    );
    assert_rate(
        after_kill.iter().sum(),
        bound,
        5.0,
        "the fleet with a dead host",
    );
    assert_rate(
        after_kill[1],
        RESERVE,
        10.0,
        "the dead host's kernel, its share lapsed to its reserve",
    );

    fleet.daemons[1]
        .lock()
        .unwrap()
        .spawn()
        .expect("restarting host 1");
    let (during_ttl, fallen, shares) = fleet.flood(&[0, 1, 2], Duration::from_secs(9), || {
        thread::sleep(Duration::from_secs(2));
        fleet.lab.stop_store();
        let during_ttl = measure(&fleet, TTL);
        let fallen = measure(&fleet, Duration::from_secs(3));
        let shares: Vec<serde_json::Value> = (0..3).map(|n| fleet.share(n)).collect();
        (during_ttl, fallen, shares)
    });
    println!("store stopped: {during_ttl:.0?} pkts/s within the TTL, then {fallen:.0?} pkts/s");
    assert!(
        during_ttl.iter().sum::<f64>() <= bound * 1.05,
        "over the budget while the store went away: {during_ttl:.0?}"
    );
    for (n, rate) in fallen.iter().enumerate() {
        assert_rate(*rate, RESERVE, 10.0, &format!("host {n} without the store"));
        assert_eq!(shares[n]["store_up"], false, "host {n}: {}", shares[n]);
    }

    fleet.lab.start_store().expect("restarting redis");
    let resumed = fleet.flood(&[0, 1, 2], Duration::from_secs(11), || {
        let held = wait_for(Duration::from_secs(6), || {
            (0..3).map(|n| fleet.held(n)).sum::<u64>() == PARTITIONS
        });
        // The shares settle to equal parts.
        thread::sleep(Duration::from_secs(1));
        (held, measure(&fleet, Duration::from_secs(2)))
    });
    let (held, rates) = resumed;
    println!("store back: every partition leased again in {held:?}; {rates:.0?} pkts/s");
    assert!(held.is_some(), "leasing did not resume");
    assert_rate(
        rates.iter().sum(),
        bound,
        5.0,
        "the fleet with the store back",
    );
}

/// Two `limiter proxy` instances in front of one upstream share one
/// fleet-wide request budget through Redis (on loopback, the test's own):
/// together they answer 200 to the global rate plus their reserves, each
/// flooded beyond it, counted by the clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_share_one_http_budget() {
    use limiter::lab::store::RedisServer;

    let upstream_addr = limiter_tests::upstream().await;
    let dir = TempDir::new("fleet-proxies");
    let password = format!(
        "{:x}",
        u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    );
    let redis = RedisServer::start(None, &[Ipv4Addr::LOCALHOST.into()], 0, Some(&password))
        .expect("redis-server");
    let password_file = dir.write("password", &password);
    let fleet = dir.write(
        "fleet.yaml",
        &format!(
            "store:\n  url: {}\n  password_file: {}\nlease_ttl: 2s\n",
            redis.url(),
            password_file.display()
        ),
    );
    // 200 requests/s for the fleet in 20 partitions, 10/s each proxy keeps.
    let rules = dir.write(
        "rules.yaml",
        "rules:
  - name: api
    match: { source: 127.0.0.0/8 }
    limit: { rate: 1000000, unit: second }
    aggregate: { rate: 200, unit: second, burst: 10, scope: fleet, partitions: 20, reserve: 10 }
",
    );
    let upstream = format!("http://{upstream_addr}");
    let metrics: Vec<String> = (0..2)
        .map(|_| limiter_tests::free_loopback_addr())
        .collect();
    let proxies: Vec<_> = metrics
        .iter()
        .map(|m| {
            let fleet = fleet.to_string_lossy().into_owned();
            limiter_tests::proxy(&rules, &upstream, &["--fleet", &fleet, "--metrics", m])
        })
        .collect();
    // Each proxy offered 400 requests/s by 4 clients for 6 s; 200s counted
    // from 2 s on, once the shares have settled.
    let start = tokio::time::Instant::now();
    let (settle, window) = (Duration::from_secs(2), Duration::from_secs(4));
    let mut clients = Vec::new();
    for p in &proxies {
        for _ in 0..4 {
            let url = format!("http://{}/x", p.addr);
            clients.push(tokio::spawn(async move {
                let client: hyper_util::client::legacy::Client<_, axum::body::Body> =
                    hyper_util::client::legacy::Client::builder(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .build_http();
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                let (mut ok, mut limited) = (0u64, 0u64);
                while start.elapsed() < settle + window {
                    tick.tick().await;
                    let request = http::Request::get(&url)
                        .body(axum::body::Body::empty())
                        .unwrap();
                    let Ok(response) = client.request(request).await else {
                        continue;
                    };
                    let counted = start.elapsed() >= settle && start.elapsed() < settle + window;
                    match response.status().as_u16() {
                        200 if counted => ok += 1,
                        429 if counted => limited += 1,
                        _ => {}
                    }
                }
                (ok, limited)
            }));
        }
    }
    let mut per_proxy = [(0u64, 0u64); 2];
    for (i, client) in clients.into_iter().enumerate() {
        let (ok, limited) = client.await.unwrap();
        per_proxy[i / 4].0 += ok;
        per_proxy[i / 4].1 += limited;
    }
    let scrapes: Vec<String> = metrics
        .iter()
        .map(|m| limiter_tests::exchange(m.parse().unwrap(), b"GET /metrics HTTP/1.0\r\n\r\n"))
        .collect();
    let total: u64 = per_proxy.iter().map(|(ok, _)| ok).sum();
    let bound = (200.0 + 2.0 * 10.0) * window.as_secs_f64();
    println!(
        "two proxies: (200s, 429s) = {per_proxy:?}; {total} 200s in {window:?} (bound {bound})"
    );
    assert!(
        per_proxy.iter().all(|(_, limited)| *limited > 0),
        "a proxy was not flooded beyond its share: {per_proxy:?}"
    );
    assert_rate(total as f64, bound, 5.0, "200s of both proxies together");
    let held: u64 = scrapes
        .iter()
        .map(|scrape| {
            scrape
                .lines()
                .find(|l| {
                    l.starts_with("limiter_fleet_partitions_held{layer=\"http\",rule=\"api\"}")
                })
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no partitions gauge in\n{scrape}"))
        })
        .sum();
    assert_eq!(held, 20, "every partition held once: {scrapes:?}");
}

/// Guards the kernel's side of a share: it lapses to the reserve by itself
/// at its deadline (a daemon that died cannot keep a partition), and a
/// share never lands on a rule that a reload renamed or changed: the
/// renamed rule starts at its reserve, and the old loop's grants are
/// refused. The program's clock is set by the test (BPF_PROG_TEST_RUN).
#[test]
fn a_kernel_share_lapses_by_itself_and_never_outlives_its_rule() {
    use limiter::fleet::{Grant, RuleRef};
    use limiter_tests::{
        XDP_DROP, XDP_PASS, frames, loaded_object, rules, run_at, test_clock_object,
    };

    let file = |name: &str, rate: u32| {
        format!(
            "rules:
  - name: {name}
    match: {{ source: 198.18.0.0/15 }}
    limit: {{ rate: 1000000, unit: second }}
    aggregate: {{ rate: {rate}, unit: second, burst: 10, scope: fleet, partitions: 10, reserve: 1 }}
"
        )
    };
    let mut dp = loaded_object(&test_clock_object(), &file("edge", 1000));
    let edge = RuleRef::of(&rules(&file("edge", 1000)).rules[0]);
    let frame = frames::udp4(Ipv4Addr::new(198, 18, 0, 1), 9, 18);
    let sec = 1_000_000_000u64;
    let t0 = 1000 * sec;
    // Leases say 1,000/s (burst 10) until t0 + 1 s.
    dp.engine
        .set_fleet_share(
            &edge,
            Grant {
                local: 1000,
                until_ns: t0 + sec,
            },
        )
        .expect("a share for the rule in force");
    let passed = |dp: &mut _, at: u64, n: usize| {
        (0..n)
            .filter(|_| run_at(dp, &frame, at) == XDP_PASS)
            .count()
    };
    assert_eq!(passed(&mut dp, t0, 12), 10, "the share's burst");
    // Past the deadline, nobody renewed: the reserve (1/s, burst 1).
    assert_eq!(
        passed(&mut dp, t0 + 2 * sec, 3),
        1,
        "the share outlived its deadline"
    );
    // A rename keeps the fingerprint, not the share: the renamed rule is
    // another rule in the store, at its reserve, and the old loop's grant
    // is refused.
    dp.engine
        .set_fleet_share(
            &edge,
            Grant {
                local: 1000,
                until_ns: t0 + 10 * sec,
            },
        )
        .unwrap();
    dp.engine
        .apply(rules(&file("edge2", 1000)))
        .expect("rename");
    assert_eq!(
        passed(&mut dp, t0 + 4 * sec, 3),
        1,
        "a share carried across a rename"
    );
    assert!(
        dp.engine
            .set_fleet_share(
                &edge,
                Grant {
                    local: 1000,
                    until_ns: t0 + 10 * sec
                }
            )
            .is_err()
    );
    // A changed rule: the old loop's grant is refused too.
    let edge2 = RuleRef::of(&rules(&file("edge2", 1000)).rules[0]);
    dp.engine
        .apply(rules(&file("edge2", 2000)))
        .expect("change");
    assert!(
        dp.engine
            .set_fleet_share(
                &edge2,
                Grant {
                    local: 1000,
                    until_ns: t0 + 10 * sec
                }
            )
            .is_err()
    );
    assert_ne!(
        run_at(&mut dp, &frame, t0 + 6 * sec),
        XDP_DROP,
        "the reserve admits one"
    );
}

/// The reproduction: one malformed entry in the store's list of
/// nodes (`HSET limiter:{fleet-udp}:nodes evil garbage`, another writer's
/// or a typo). Before, the report script failed on every host, and every
/// host enforced its fallback while the store answered. Now the first
/// report deletes the entry and counts it: host 1, flooded alone, takes
/// every partition and admits the whole budget, and the fleet counted the
/// entry once.
#[test]
fn a_malformed_entry_in_the_store_is_deleted_and_counted() {
    let fleet = Fleet::start("fm");
    let mut store = fleet.lab.store_connection().expect("the store");
    let added: i64 = redis::cmd("HSET")
        .arg("limiter:{fleet-udp}:nodes")
        .arg("evil")
        .arg("garbage")
        .query(&mut store)
        .expect("HSET");
    assert_eq!(added, 1);
    let (followed, rates) = fleet.flood(&[1], Duration::from_secs(8), || {
        let followed = wait_for(Duration::from_secs(5), || fleet.held(1) == PARTITIONS);
        thread::sleep(Duration::from_millis(500));
        (followed, measure(&fleet, Duration::from_secs(3)))
    });
    let followed = followed.expect("host 1 did not get every partition within 5 s");
    println!(
        "with a malformed entry: every partition on host 1 in {followed:?}: {rates:.0?} pkts/s"
    );
    assert_rate(
        rates[1],
        GLOBAL + RESERVE,
        5.0,
        "host 1 holding the whole budget",
    );
    let counted: u64 = (0..3)
        .map(|n| {
            fleet.share(n)["store_malformed_entries"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(
        counted, 1,
        "the entry counted once, by the report that deleted it"
    );
    let left: bool = redis::cmd("HEXISTS")
        .arg("limiter:{fleet-udp}:nodes")
        .arg("evil")
        .query(&mut store)
        .expect("HEXISTS");
    assert!(!left, "the malformed entry was deleted");
}

/// A TCP relay in a host's namespace, from 127.0.0.1:`port` to the store,
/// holding every chunk `delay` each way: a store `2 × delay` away.
struct SlowRelay {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl SlowRelay {
    fn start(netns: &str, port: u16, upstream: std::net::SocketAddr, delay: Duration) -> Self {
        use std::{
            io::{Read, Write},
            net::{Shutdown, TcpListener, TcpStream},
            sync::{
                Arc,
                atomic::{AtomicBool, Ordering},
            },
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let netns = netns.to_owned();
        let thread = thread::spawn(move || {
            limiter::lab::netns::enter(&netns, || {
                let listener = TcpListener::bind(("127.0.0.1", port)).expect("the relay's port");
                listener.set_nonblocking(true).expect("non-blocking");
                let pump = move |mut from: TcpStream, mut to: TcpStream, stop: Arc<AtomicBool>| {
                    from.set_read_timeout(Some(Duration::from_millis(100)))
                        .expect("a timeout");
                    let mut buffer = vec![0; 64 * 1024];
                    while !stop.load(Ordering::Relaxed) {
                        match from.read(&mut buffer) {
                            Ok(0) => break,
                            Ok(n) => {
                                thread::sleep(delay);
                                if to.write_all(&buffer[..n]).is_err() {
                                    break;
                                }
                            }
                            Err(e)
                                if e.kind() == std::io::ErrorKind::WouldBlock
                                    || e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(_) => break,
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                };
                while !stopping.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            client.set_nonblocking(false).expect("blocking");
                            let Ok(server) = TcpStream::connect(upstream) else {
                                continue;
                            };
                            let (c, s) = (
                                client.try_clone().expect("clone"),
                                server.try_clone().expect("clone"),
                            );
                            let (s1, s2) = (stopping.clone(), stopping.clone());
                            thread::spawn(move || pump(c, s, s1));
                            thread::spawn(move || pump(server, client, s2));
                        }
                        Err(_) => thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
            .expect("entering the host's namespace");
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SlowRelay {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The reproduction: a store 250 ms away, slower than a tick (200
/// ms) but within its response timeout (500 ms), kept a host in its
/// fallback for good (an exchange of a renewal, a report and a `SET NX`
/// per partition could not fit the loop's limit). Now a host alone under
/// a flood leases the whole budget through it, in three round trips a
/// tick at most.
#[test]
fn a_store_slower_than_a_tick_keeps_leasing() {
    let name = "fs";
    let dir = TempDir::new(name);
    let lab = FleetLab::create(name, 1, &dir.0).expect("fleet lab");
    let port = 16379;
    let upstream = lab
        .store_url(0)
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .expect("the store's address");
    let relay = SlowRelay::start(
        lab.hosts[0].rx.name(),
        port,
        upstream,
        Duration::from_millis(125),
    );
    let section = lab
        .fleet_section(0, TTL)
        .replace(&lab.store_url(0), &format!("redis://127.0.0.1:{port}/"));
    let daemon = Daemon::start_with(
        &lab.hosts[0],
        &format!("{name}0"),
        &[RX_IFACE],
        RULES,
        &section,
        &[],
    )
    .expect("daemon");
    let fleet = Fleet {
        daemons: vec![Mutex::new(daemon)],
        lab,
        _dir: dir,
    };
    let (followed, rates) = fleet.flood(&[0], Duration::from_secs(10), || {
        let followed = wait_for(Duration::from_secs(6), || fleet.held(0) == PARTITIONS);
        thread::sleep(Duration::from_millis(500));
        (followed, measure(&fleet, Duration::from_secs(3)))
    });
    let share = fleet.share(0);
    let rtt = share["store_rtt_seconds"].as_f64().unwrap_or(0.0);
    println!(
        "a store {:.0} ms away: every partition in {followed:?}, {rates:.0?} pkts/s; store up: {}",
        rtt * 1000.0,
        share["store_up"]
    );
    assert!(rtt >= 0.25, "the relay delays: a round trip of {rtt} s");
    assert_eq!(share["store_up"], true, "{share}");
    followed.expect("the host did not lease every partition within 6 s");
    assert_rate(
        rates[0],
        GLOBAL + RESERVE,
        5.0,
        "the host holding the whole budget",
    );
    drop(fleet);
    drop(relay);
}

/// Partitions leased under a token no node reports (another writer on the
/// store's keys) are budget no node can use: the hosts see them, while
/// the store answers (`store_foreign_partitions`, the metric
/// `limiter_fleet_foreign_partitions`, the alert LimiterFleetForeignLeases).
#[test]
fn leases_a_foreign_writer_holds_are_seen() {
    let fleet = Fleet::start("ff");
    let mut store = fleet.lab.store_connection().expect("the store");
    let _: () = redis::cmd("SET")
        .arg("limiter:{fleet-udp}:0")
        .arg("intruder")
        .arg("PX")
        .arg(60_000)
        .query(&mut store)
        .expect("SET");
    let (took, foreign) = fleet.flood(&[1], Duration::from_secs(8), || {
        let took = wait_for(Duration::from_secs(6), || fleet.held(1) == PARTITIONS - 1);
        thread::sleep(Duration::from_millis(500));
        (took, fleet.share(1)["store_foreign_partitions"].as_u64())
    });
    let took = took.expect("host 1 did not take every partition but the foreign one in 6 s");
    println!("a foreign lease: host 1 took the other 29 partitions in {took:?}");
    assert_eq!(foreign, Some(1), "host 1 counts the foreign lease");
    assert_eq!(fleet.held(1), PARTITIONS - 1, "never the foreign one");
    for n in [0, 2] {
        assert_eq!(
            fleet.share(n)["store_foreign_partitions"].as_u64(),
            Some(1),
            "host {n}"
        );
    }
}
