//! Leases themselves: exclusive, renewed, given back, expiring; what a
//! lease and a report count for; where the password comes from.

use std::time::{Duration, Instant};

use limiter::fleet::{
    lease::{LeaseError, Leases},
    store::{StoreConfig, StoreError},
};

use super::{redis, set, store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_exclusive_renewed_returned_and_expire() {
    let redis = redis(None);
    let ttl = Duration::from_millis(400);
    let mut a = Leases::new(&store(&redis), "api", 8, ttl).await.unwrap();
    let mut b = Leases::new(&store(&redis), "api", 8, ttl).await.unwrap();
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

/// Guards the takeover's timing: an acquisition that falls short says when
/// the partitions others hold expire (no later than they do, so a node
/// whose owner died takes them then, not a tick later), and they are free
/// from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_acquisition_says_when_the_others_leases_expire() {
    let redis = redis(None);
    let ttl = Duration::from_millis(600);
    let mut a = Leases::new(&store(&redis), "api", 4, ttl).await.unwrap();
    let mut b = Leases::new(&store(&redis), "api", 4, ttl).await.unwrap();
    let a_asked = Instant::now();
    assert_eq!(a.acquire(4).await.unwrap().len(), 4);
    let a_answered = Instant::now();
    assert_eq!(a.next_free(), None, "a got all it asked for");
    tokio::time::sleep(ttl / 3).await;
    let b_asked = Instant::now();
    assert!(b.acquire(2).await.unwrap().is_empty(), "a holds them all");
    let b_rtt = b_asked.elapsed();
    let free_at = b
        .next_free()
        .expect("b was not told when a's leases expire");
    // Redis expires them a TTL after a's request arrived; b's estimate is
    // early by at most its own round trip, never late. (Redis keeps time
    // in whole milliseconds: the expiry it set from its truncated clock
    // may be up to 1 ms early, and PTTL, counted from a truncated now, up
    // to 1 ms long; the retry comes 2 ms after the estimate anyway.)
    assert!(
        free_at <= a_answered + ttl + Duration::from_millis(1),
        "told {:?} after a's answer, beyond the TTL",
        free_at - a_answered
    );
    assert!(
        free_at + b_rtt + Duration::from_millis(2) >= a_asked + ttl,
        "told {:?} after a's request, short of the TTL by more than b's round trip {b_rtt:?}",
        free_at - a_asked
    );
    // a died: nothing renews its leases.
    tokio::time::sleep_until((a_answered + ttl + Duration::from_millis(5)).into()).await;
    assert_eq!(
        b.acquire(4).await.unwrap().len(),
        4,
        "a's leases did not expire"
    );
    assert_eq!(b.next_free(), None, "b got all it asked for");
}

/// Guards the safety margin: a lease (taken or renewed) counts from when
/// its request was sent until 0.9 TTL later, never for the whole TTL
/// Redis gives it: clock rates and a late tick must not make a node count
/// a partition Redis may already have handed to another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_counts_for_its_ttl_less_the_safety_margin() {
    let redis = redis(None);
    let ttl = Duration::from_millis(1000);
    let counted = ttl.mul_f64(0.9);
    let mut a = Leases::new(&store(&redis), "api", 4, ttl).await.unwrap();
    for round in 0..2 {
        let asked = Instant::now();
        if round == 0 {
            assert_eq!(a.acquire(4).await.unwrap().len(), 4);
        } else {
            assert!(a.renew().await.unwrap().is_empty());
        }
        let answered = Instant::now();
        let (valid, until) = a.valid_beyond(answered);
        let until = until.expect("leases held");
        assert_eq!(valid, 4);
        assert!(
            until >= asked + counted && until <= answered + counted,
            "round {round}: counted until {:?} after the request, {:?} after the answer              (0.9 TTL: {counted:?})",
            until - asked,
            until.saturating_duration_since(answered)
        );
        assert_eq!(a.held(until - Duration::from_millis(1)), 4);
        assert_eq!(a.held(until), 0, "counted past 0.9 TTL");
        tokio::time::sleep(ttl / 4).await;
    }
}

/// Guards the reports' lifetime and the ping: a node's report counts for
/// a third of the TTL (a dead node stops counting well before its leases
/// lapse), and a ping is a round trip, failing when the store is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_counts_for_a_third_of_the_ttl_and_a_ping_reaches_the_store() {
    let mut redis = redis(None);
    let ttl = Duration::from_millis(900);
    let mut a = Leases::new(&store(&redis), "api", 4, ttl).await.unwrap();
    let mut b = Leases::new(&store(&redis), "api", 4, ttl).await.unwrap();
    assert_eq!(a.acquire(1).await.unwrap().len(), 1);
    let reported = Instant::now();
    assert_eq!(a.report(true).await.unwrap().hungry, 1);
    let peers = b.report(false).await.unwrap();
    assert!(
        reported.elapsed() < ttl / 3,
        "a slow store: {:?}",
        reported.elapsed()
    );
    assert_eq!((peers.hungry, peers.satisfied_held), (1, 0), "{peers:?}");
    tokio::time::sleep_until((reported + ttl / 3 + Duration::from_millis(50)).into()).await;
    let peers = b.report(false).await.unwrap();
    assert_eq!(
        peers.hungry, 0,
        "a's report outlived a third of the TTL: {peers:?}"
    );
    b.ping().await.expect("a ping");
    redis.stop();
    assert!(b.ping().await.is_err(), "a ping without a store");
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
    let redis = redis(Some(&secret));
    let dir = std::env::temp_dir().join(format!("limiter-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("password");
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    let ttl = Duration::from_millis(400);
    let from_file = StoreConfig {
        password_file: Some(file.clone()),
        ..store(&redis)
    };
    let mut leases = Leases::new(&from_file, "api", 4, ttl).await.unwrap();
    assert_eq!(leases.acquire(2).await.unwrap().len(), 2);
    let from_env = StoreConfig {
        password_env: Some("PATH".into()),
        ..store(&redis)
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
    let mut in_url = store(&redis);
    in_url.url = in_url.url.replace("redis://", "redis://:pw@");
    assert!(matches!(in_url.client(), Err(StoreError::PasswordInUrl)));
    let both = StoreConfig {
        password_file: Some(file),
        password_env: Some("PATH".into()),
        ..store(&redis)
    };
    assert!(matches!(both.client(), Err(StoreError::TwoPasswords)));
    let _ = std::fs::remove_dir_all(&dir);
}
