//! Leases on a global budget's partitions, against a real `redis-server`
//! that the test starts on loopback (and stops): exclusive, renewed,
//! given back, and expiring by Redis's clock when a node stops renewing.

use std::{
    collections::BTreeSet,
    net::TcpStream,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use limiter::fleet::lease::{LeaseError, Leases};

/// A redis-server on a free loopback port, killed on drop.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
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

    fn client(&self) -> redis::Client {
        redis::Client::open(format!("redis://127.0.0.1:{}/", self.port)).unwrap()
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
    let mut a = Leases::new(redis.client(), "api", 8, ttl).await.unwrap();
    let mut b = Leases::new(redis.client(), "api", 8, ttl).await.unwrap();
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
    let client = redis::Client::open("redis://127.0.0.1:1/").unwrap();
    let error = Leases::new(client, "api", 8, Duration::from_millis(10)).await;
    assert!(matches!(error, Err(LeaseError::TtlTooShort)));
}
