//! The store's connection: TLS both ways, a store that forgets its
//! leases, a Redis cluster.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use limiter::{
    fleet::{
        lease::Leases,
        node::{Fallback, Node},
        store::{StoreConfig, StoreError},
    },
    lab::store::{RedisCluster, RedisServer, certificates},
};

use super::nodes::{BUDGET, Traffic, holding_everything, peak_total, run_until, spec};
use super::{redis, set, store};

/// system's roots do not know it) and shows the client certificate Redis
/// asks for; leases work over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_over_tls_verify_the_server_and_show_a_client_certificate() {
    let dir = std::env::temp_dir().join(format!("limiter-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (tls, client_cert, client_key) =
        certificates(&dir).expect("openssl (cargo xtask setup installs it)");
    let ca = tls.ca.clone();
    let redis = RedisServer::start_tls(None, &[Ipv4Addr::LOCALHOST.into()], 0, None, Some(tls))
        .expect("redis-server with TLS");
    assert!(redis.url().starts_with("rediss://"));
    let ttl = Duration::from_millis(400);
    let config = StoreConfig {
        ca_file: Some(ca.clone()),
        cert_file: Some(client_cert.clone()),
        key_file: Some(client_key.clone()),
        ..store(&redis)
    };
    let mut leases = Leases::new(&config, "api", 4, ttl)
        .await
        .expect("leasing over TLS");
    assert_eq!(leases.acquire(3).await.unwrap().len(), 3);
    let unknown_ca = StoreConfig {
        ca_file: None,
        ..config.clone()
    };
    assert!(
        Leases::new(&unknown_ca, "api", 4, ttl).await.is_err(),
        "a server no root vouches for was trusted"
    );
    let no_client_cert = StoreConfig {
        cert_file: None,
        key_file: None,
        ..config.clone()
    };
    assert!(
        Leases::new(&no_client_cert, "api", 4, ttl).await.is_err(),
        "Redis wanted a client certificate"
    );
    let half = StoreConfig {
        key_file: None,
        ..config.clone()
    };
    assert!(matches!(
        half.client(),
        Err(StoreError::HalfAClientCertificate)
    ));
    let plain = StoreConfig {
        url: config.url.replace("rediss://", "redis://"),
        ..config
    };
    assert!(matches!(
        plain.client(),
        Err(StoreError::TlsOnly("ca_file"))
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Guards the store's memory: a Redis that restarts empty (no
/// persistence, a failover) has forgotten leases that nodes still
/// enforce; it hands out nothing until they have lapsed, so two nodes
/// never enforce one partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_forgets_hands_out_nothing_until_old_leases_lapse() {
    let mut redis = redis(None);
    let ttl = Duration::from_millis(1000);
    let a_traffic = Traffic::new(20_000, BUDGET.reserve_rate);
    let b_traffic = Traffic::new(20_000, BUDGET.reserve_rate);
    let a = holding_everything(store(&redis), ttl, &a_traffic).await;
    redis.stop();
    redis.resume().expect("redis-server again, empty");
    let restarted = Instant::now();
    let b = Node::new(
        spec(Fallback::Static, ttl),
        store(&redis),
        b_traffic.clone(),
    );
    let until = restarted + ttl * 4;
    let (a, b) = (run_until(a, until), run_until(b, until));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let peak = peak_total(&a_traffic.enforced(), &b_traffic.enforced());
    assert!(
        peak <= BUDGET.global_rate + 2 * BUDGET.reserve_rate,
        "together the nodes enforced {peak} at some moment"
    );
    let first_b = b_traffic
        .enforced()
        .iter()
        .find(|(_, local)| *local > BUDGET.reserve_rate)
        .map(|(t, _)| t.duration_since(restarted));
    println!("b's first partition {first_b:?} after the restart");
    assert!(first_b.is_some_and(|t| t >= ttl), "b leased at {first_b:?}");
    assert_eq!(
        a.status().held + b.status().held,
        BUDGET.partitions,
        "leasing resumed: {:?} {:?}",
        a.status(),
        b.status()
    );
}

/// Guards the counts an operator reads: a renewal that finds the store
/// has forgotten the leases counts them lost, and none of them renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_a_store_forgot_count_as_lost_not_renewed() {
    let mut redis = redis(None);
    let ttl = Duration::from_millis(1000);
    let traffic = Traffic::new(20_000, BUDGET.reserve_rate);
    let mut a = holding_everything(store(&redis), ttl, &traffic).await;
    a.tick().await;
    let before = a.status().clone();
    assert!(
        before.leases_renewed > 0 && before.leases_lost == 0,
        "{before:?}"
    );
    redis.stop();
    redis.resume().expect("redis-server again, empty");
    // The first tick may find the connection gone; then the node renews
    // against the empty store (which hands out nothing for a TTL).
    let deadline = Instant::now() + ttl / 2;
    while a.status().leases_lost == 0 && Instant::now() < deadline {
        a.tick().await;
    }
    let after = a.status();
    assert_eq!(
        after.leases_lost,
        u64::from(BUDGET.partitions),
        "{before:?} {after:?}"
    );
    assert_eq!(after.leases_renewed, before.leases_renewed, "{after:?}");
}

/// the hosts' reports work on a real three-master Redis Cluster, for rules
/// whose keys live in different slots (each rule's keys in one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_work_on_a_redis_cluster() {
    let dir = std::env::temp_dir().join(format!("limiter-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = RedisCluster::start(3, &dir).expect("a redis cluster (redis-server, redis-cli)");
    let config = StoreConfig {
        cluster: true,
        ..StoreConfig::at(cluster.url())
    };
    let ttl = Duration::from_millis(600);
    for rule in ["api", "edge", "web-fleet", "z"] {
        let mut a = Leases::new(&config, rule, 8, ttl)
            .await
            .expect("cluster leases");
        let mut b = Leases::new(&config, rule, 8, ttl).await.unwrap();
        let got_a = a.acquire(5).await.unwrap();
        let got_b = b.acquire(5).await.unwrap();
        assert_eq!((got_a.len(), got_b.len()), (5, 3), "rule {rule}");
        assert!(set(&got_a).is_disjoint(&set(&got_b)));
        tokio::time::sleep(ttl / 2).await;
        assert!(a.renew().await.unwrap().is_empty(), "rule {rule}: renewal");
        assert_eq!(b.release(3).await.unwrap().len(), 3);
        assert_eq!(
            a.acquire(8).await.unwrap().len(),
            3,
            "rule {rule}: released, free"
        );
        let peers = a.report(true).await.unwrap();
        assert_eq!(peers.hungry, 1, "rule {rule}: {peers:?}");
    }
    // The rules' keys are spread over more than one master.
    let masters: BTreeSet<u32> = ["api", "edge", "web-fleet", "z"]
        .iter()
        .map(|rule| {
            let out = std::process::Command::new("redis-cli")
                .args([
                    "-p",
                    &cluster.nodes[0].port.to_string(),
                    "cluster",
                    "keyslot",
                ])
                .arg(format!("limiter:{{{rule}}}:0"))
                .output()
                .expect("redis-cli");
            let slot: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
            // `redis-cli --cluster create` splits the 16,384 slots evenly.
            slot * 3 / 16_384
        })
        .collect();
    assert!(masters.len() > 1, "every rule on one master: {masters:?}");
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}
