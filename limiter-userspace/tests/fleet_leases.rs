//! Leases on a global budget's partitions, against a real `redis-server`
//! that the test starts on loopback (and stops): exclusive, renewed,
//! given back, and expiring by Redis's clock when a node stops renewing.

use std::{
    collections::BTreeSet,
    net::TcpStream,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use limiter::fleet::{
    lease::{LeaseError, Leases},
    node::{Fallback, Node},
    share::{Budget, Demand},
    store::{StoreConfig, StoreError},
};

/// A redis-server on a free loopback port, killed on drop.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start() -> Self {
        Self::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(port, extra)
    }

    fn start_on(port: u16, extra: &[&str]) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (cargo xtask setup installs it)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port }
    }

    fn store(&self) -> StoreConfig {
        StoreConfig::at(format!("redis://127.0.0.1:{}/", self.port))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn set(partitions: &[u32]) -> BTreeSet<u32> {
    partitions.iter().copied().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_exclusive_renewed_returned_and_expire() {
    let redis = Redis::start();
    let ttl = Duration::from_millis(400);
    let mut a = Leases::new(&redis.store(), "api", 8, ttl).await.unwrap();
    let mut b = Leases::new(&redis.store(), "api", 8, ttl).await.unwrap();
    // Exclusive: 5 and then the 3 left, never the same one twice.
    let got_a = a.acquire(5).await.unwrap();
    let got_b = b.acquire(5).await.unwrap();
    assert_eq!((got_a.len(), got_b.len()), (5, 3));
    assert!(set(&got_a).is_disjoint(&set(&got_b)));
    assert_eq!(set(&got_a).union(&set(&got_b)).count(), 8);
    // Renewed before they expire, they are kept past several TTLs.
    for _ in 0..4 {
        tokio::time::sleep(ttl / 2).await;
        assert!(
            a.renew().await.unwrap().is_empty(),
            "a lost a lease it renewed"
        );
        assert!(
            b.renew().await.unwrap().is_empty(),
            "b lost a lease it renewed"
        );
    }
    assert_eq!(a.held(Instant::now()), 5);
    // Given back, free at once for another node.
    let given = b.release(2).await.unwrap();
    assert_eq!(given.len(), 2);
    assert_eq!(b.held(Instant::now()), 1);
    let more = a.acquire(8).await.unwrap();
    assert_eq!(set(&more), set(&given));
    // A node that stops renewing: it stops counting its leases within the
    // TTL (before Redis frees them), the other takes them by Redis's clock,
    // and its next renewal reports them lost.
    for _ in 0..3 {
        tokio::time::sleep(ttl / 2).await;
        assert!(b.renew().await.unwrap().is_empty());
    }
    assert_eq!(a.held(Instant::now()), 0, "leases counted past their TTL");
    let taken = b.acquire(8).await.unwrap();
    assert_eq!(taken.len(), 7, "the expired leases were not free");
    assert_eq!(a.renew().await.unwrap().len(), 7);
    assert_eq!(a.held(Instant::now()), 0);
}

#[tokio::test]
async fn a_ttl_too_short_to_renew_is_refused() {
    let store = StoreConfig::at("redis://127.0.0.1:1/");
    let error = Leases::new(&store, "api", 8, Duration::from_millis(10)).await;
    assert!(matches!(error, Err(LeaseError::TtlTooShort)));
}

/// Guards the credentials: the password from a file or the environment
/// authenticates; a wrong one is refused by Redis; one in the URL, or two
/// sources at once, are refused before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_comes_from_a_file_or_the_environment() {
    // The environment's PATH is the password: a variable that is there,
    // without setting one in a test process that runs threads.
    let secret = std::env::var("PATH").expect("PATH");
    let redis = Redis::start_with(&["--requirepass", &secret]);
    let dir = std::env::temp_dir().join(format!("limiter-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("password");
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    let ttl = Duration::from_millis(400);
    let from_file = StoreConfig {
        password_file: Some(file.clone()),
        ..redis.store()
    };
    let mut leases = Leases::new(&from_file, "api", 4, ttl).await.unwrap();
    assert_eq!(leases.acquire(2).await.unwrap().len(), 2);
    let from_env = StoreConfig {
        password_env: Some("PATH".into()),
        ..redis.store()
    };
    let mut leases = Leases::new(&from_env, "api", 4, ttl).await.unwrap();
    assert_eq!(
        leases.acquire(4).await.unwrap().len(),
        2,
        "the other two are held"
    );
    std::fs::write(&file, "wrong\n").unwrap();
    let wrong = Leases::new(&from_file, "api", 4, ttl).await;
    let message = wrong.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message.to_lowercase().contains("pass"), "{message}");
    let mut in_url = redis.store();
    in_url.url = in_url.url.replace("redis://", "redis://:pw@");
    assert!(matches!(in_url.client(), Err(StoreError::PasswordInUrl)));
    let both = StoreConfig {
        password_file: Some(file),
        password_env: Some("PATH".into()),
        ..redis.store()
    };
    assert!(matches!(both.client(), Err(StoreError::TwoPasswords)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Guards the fallback: with Redis gone, a node never enforces more than it
/// held, and its rate falls to its reserve within one TTL (fail-static) or
/// is the stated cap (fail-open); with Redis back on the same address, it
/// leases again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_falls_back_and_leasing_resumes() {
    let redis = Redis::start();
    let port = redis.port;
    let ttl = Duration::from_millis(400);
    let store = StoreConfig {
        connect_timeout: Duration::from_millis(200),
        response_timeout: Duration::from_millis(200),
        ..redis.store()
    };
    let budget = Budget {
        global_rate: 8_000,
        partitions: 8,
        reserve_rate: 100,
    };
    let leases = || Leases::new(&store, "api", 8, ttl);
    let mut fixed = Node::new(leases().await.unwrap(), budget, Fallback::Static);
    let mut open = Node::new(
        leases().await.unwrap(),
        budget,
        Fallback::Open { rate: 300 },
    );
    let hungry = Demand {
        admitted_rate: 100,
        refused_rate: 5_000,
    };
    assert_eq!(fixed.tick(hungry).await, 100 + 5 * 1_000);
    assert_eq!(open.tick(hungry).await, 100 + 3 * 1_000, "the 3 left");
    drop(redis);
    let stopped = Instant::now();
    assert_eq!(open.tick(hungry).await, 300);
    let mut rates = Vec::new();
    while stopped.elapsed() < ttl * 2 {
        rates.push((stopped.elapsed(), fixed.tick(hungry).await));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!fixed.store_up());
    assert!(
        rates.iter().all(|(_, r)| *r <= 5_100),
        "more than it held: {rates:?}"
    );
    assert!(
        rates
            .iter()
            .filter(|(t, _)| *t >= ttl)
            .all(|(_, r)| *r == 100),
        "leases counted past their TTL: {rates:?}"
    );
    let _redis = Redis::start_on(port, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rate = fixed.tick(hungry).await;
        if fixed.store_up() && rate > 100 {
            break;
        }
        assert!(Instant::now() < deadline, "leasing did not resume");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
