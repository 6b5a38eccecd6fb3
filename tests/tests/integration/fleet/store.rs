//! The store's odd states: a malformed entry, a store slower than a tick,
//! and leases another writer holds.

use std::{sync::Mutex, thread, time::Duration};

use limiter::lab::{RX_IFACE, fleet::FleetLab};
use limiter_tests::{Daemon, TempDir};

use super::{Fleet, GLOBAL, PARTITIONS, RESERVE, RULES, TTL, assert_rate, measure, wait_for};

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
