//! Leases on a global budget's partitions, against a real `redis-server`
//! that the test starts on loopback (and stops): exclusive, renewed,
//! given back, and expiring by Redis's clock when a node stops renewing.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use std::sync::{Arc, Mutex};

use limiter::{
    clock::monotonic_ns,
    fleet::{
        Enforcer, Grant, RuleCounts, RuleRef,
        lease::{LeaseError, Leases},
        node::{Fallback, Node, Spec},
        share::Budget,
        store::{StoreConfig, StoreError},
    },
    lab::store::{RedisCluster, RedisServer, certificates},
};

/// A redis-server of the test's own on a free loopback port.
fn redis(password: Option<&str>) -> RedisServer {
    RedisServer::start(None, &[Ipv4Addr::LOCALHOST.into()], 0, password)
        .expect("redis-server (cargo xtask setup installs it)")
}

fn store(redis: &RedisServer) -> StoreConfig {
    StoreConfig::at(redis.url())
}

fn set(partitions: &[u32]) -> BTreeSet<u32> {
    partitions.iter().copied().collect()
}

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

/// A rule's traffic as a node sees it: `want` per second offered, of
/// which the share in force is admitted and the rest refused by the
/// aggregate; and every share the node enforced, when.
struct Traffic {
    reserve: u64,
    state: Mutex<TrafficState>,
}

struct TrafficState {
    want: u64,
    since: Instant,
    counts: RuleCounts,
    grant: Grant,
    /// (when, the share in force from then on).
    enforced: Vec<(Instant, u64)>,
}

impl Traffic {
    fn new(want: u64, reserve: u64) -> Arc<Self> {
        Arc::new(Self {
            reserve,
            state: Mutex::new(TrafficState {
                want,
                since: Instant::now(),
                counts: RuleCounts::default(),
                grant: Grant {
                    local: reserve,
                    until_ns: 1,
                },
                enforced: vec![(Instant::now(), reserve)],
            }),
        })
    }

    /// The share in force now: the grant until it lapses, then the reserve.
    fn in_force(&self, s: &TrafficState) -> u64 {
        if monotonic_ns() < s.grant.until_ns {
            s.grant.local
        } else {
            self.reserve
        }
    }

    fn offer(&self, want: u64) {
        let mut s = self.state.lock().unwrap();
        self.advance(&mut s);
        s.want = want;
    }

    fn advance(&self, s: &mut TrafficState) {
        let dt = s.since.elapsed().as_secs_f64();
        s.since = Instant::now();
        let allowed = self.in_force(s);
        s.counts.admitted += (s.want.min(allowed) as f64 * dt) as u64;
        s.counts.refused += (s.want.saturating_sub(allowed) as f64 * dt) as u64;
    }

    fn local(&self) -> u64 {
        let s = self.state.lock().unwrap();
        self.in_force(&s)
    }

    fn enforced(&self) -> Vec<(Instant, u64)> {
        self.state.lock().unwrap().enforced.clone()
    }
}

impl Enforcer for Traffic {
    fn counts(&self, _: &RuleRef) -> anyhow::Result<RuleCounts> {
        let mut s = self.state.lock().unwrap();
        self.advance(&mut s);
        Ok(s.counts)
    }

    fn enforce(&self, _: &RuleRef, grant: Grant) -> anyhow::Result<()> {
        let mut s = self.state.lock().unwrap();
        self.advance(&mut s);
        s.grant = grant;
        s.enforced.push((Instant::now(), grant.local));
        Ok(())
    }
}

const BUDGET: Budget = Budget {
    global_rate: 8_000,
    partitions: 8,
    reserve_rate: 100,
};

fn spec(fallback: Fallback, ttl: Duration) -> Spec {
    Spec {
        rule: RuleRef {
            name: "api".into(),
            fingerprint: 1,
        },
        budget: BUDGET,
        period: Duration::from_secs(1),
        fallback,
        ttl,
    }
}

/// The longest a test waits for the state it starts from: a fresh store
/// hands out nothing for one TTL, and a machine busy with the other tests'
/// Redis servers may take several ticks more (three TTLs were too few
/// once in four runs of this file).
const SETTLE: Duration = Duration::from_secs(10);

/// Ticks `node` every tick interval until `done` holds or `within` ends.
async fn tick_until(node: &mut Node, within: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        node.tick().await;
        if done() {
            return true;
        }
        tokio::time::sleep(node.spec().tick()).await;
    }
    false
}

/// A fail-static node of `traffic` that has leased every partition.
async fn holding_everything(store: StoreConfig, ttl: Duration, traffic: &Arc<Traffic>) -> Node {
    let mut node = Node::new(spec(Fallback::Static, ttl), store, traffic.clone());
    let all = BUDGET.local_rate(BUDGET.partitions);
    assert!(
        tick_until(&mut node, SETTLE, || traffic.local() == all).await,
        "did not lease every partition: {:?}",
        node.status()
    );
    node
}

/// Ticks `node` on a task of its own (as on a host of its own) until
/// `until`; gives it back.
fn run_until(mut node: Node, until: Instant) -> tokio::task::JoinHandle<Node> {
    tokio::spawn(async move {
        while Instant::now() < until {
            node.tick().await;
            tokio::time::sleep(node.spec().tick()).await;
        }
        node
    })
}

/// The largest sum of the two nodes' shares in force at any moment, from
/// what each enforced when.
fn peak_total(a: &[(Instant, u64)], b: &[(Instant, u64)]) -> u64 {
    let at = |log: &[(Instant, u64)], t: Instant| {
        log.iter()
            .take_while(|(when, _)| *when <= t)
            .last()
            .map_or(0, |(_, local)| *local)
    };
    a.iter()
        .chain(b)
        .map(|(t, _)| at(a, *t) + at(b, *t))
        .max()
        .unwrap_or(0)
}

/// Guards the sharing: demand takes partitions, the fleet's total never
/// exceeds the global rate plus the reserves (a node lowers its share
/// before it gives partitions back, and the other raises its own only
/// after leasing them), and capacity follows the traffic within a few
/// ticks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_follows_the_traffic_and_never_exceeds_the_budget() {
    let redis = redis(None);
    let ttl = Duration::from_millis(1000);
    let a_traffic = Traffic::new(20_000, BUDGET.reserve_rate);
    let b_traffic = Traffic::new(0, BUDGET.reserve_rate);
    let a = holding_everything(store(&redis), ttl, &a_traffic).await;
    let mut b = Node::new(
        spec(Fallback::Static, ttl),
        store(&redis),
        b_traffic.clone(),
    );
    let all = BUDGET.local_rate(BUDGET.partitions);
    b.tick().await;
    assert_eq!(
        b_traffic.local(),
        BUDGET.reserve_rate,
        "b got a partition a holds"
    );
    // The flood moves from a to b.
    a_traffic.offer(0);
    b_traffic.offer(20_000);
    let moved = Instant::now();
    // Each node on its own, as on two hosts.
    let until = Instant::now() + ttl * 3;
    let (a, b) = (run_until(a, until), run_until(b, until));
    let (_a, b) = (a.await.unwrap(), b.await.unwrap());
    assert_eq!(
        b_traffic.local(),
        all,
        "the capacity did not follow: {:?}",
        b.status()
    );
    assert_eq!(a_traffic.local(), BUDGET.reserve_rate);
    let followed = b_traffic
        .enforced()
        .iter()
        .find(|(_, local)| *local == all)
        .map(|(t, _)| t.duration_since(moved));
    println!("capacity followed in {followed:?}");
    let peak = peak_total(&a_traffic.enforced(), &b_traffic.enforced());
    assert!(
        peak <= BUDGET.global_rate + 2 * BUDGET.reserve_rate,
        "together the nodes enforced {peak} at some moment"
    );
}

/// Guards the share's steps: a node takes what its refused traffic needs
/// on top of what it holds, and gives back only what its use leaves over
/// (acquiring or freeing the difference, not the sum).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_grows_and_shrinks_by_the_difference() {
    const WIDE: Budget = Budget {
        global_rate: 32_000,
        partitions: 32,
        reserve_rate: 100,
    };
    let redis = redis(None);
    let ttl = Duration::from_millis(600);
    let traffic = Traffic::new(6_500, WIDE.reserve_rate);
    let mut node = Node::new(
        Spec {
            budget: WIDE,
            ..spec(Fallback::Static, ttl)
        },
        store(&redis),
        traffic.clone(),
    );
    // Ticks as a node does, for two TTLs; the shares enforced meanwhile.
    let settle = async |node: &mut Node| {
        let from = traffic.enforced().len();
        let until = Instant::now() + ttl * 2;
        while Instant::now() < until {
            tokio::time::sleep(node.spec().tick()).await;
            node.tick().await;
        }
        let shares: Vec<u64> = traffic.enforced()[from..].iter().map(|(_, l)| *l).collect();
        shares
    };
    assert!(
        tick_until(&mut node, SETTLE, || traffic.local() >= 6_500).await,
        "{:?}",
        node.status()
    );
    // Offered `want` a second, the node settles on at most `partitions`.
    let settles_within = async |node: &mut Node, want: u64, partitions: u32| {
        traffic.offer(want);
        let shares = settle(node).await;
        let local = traffic.local();
        assert!(
            (want..=WIDE.local_rate(partitions)).contains(&local),
            "{local} held for {want} a second ({shares:?}): {:?}",
            node.status()
        );
    };
    // 6,500: 7 partitions (7,100), or 8 after the moment of refusals
    // the tick that granted them saw.
    settles_within(&mut node, 6_500, 8).await;
    // 10,500 on 7 or 8 partitions: 4 more (and one for the moment of
    // refusals the tick that granted them saw), not as many again as it
    // held.
    settles_within(&mut node, 10_500, 13).await;
    // 2,000: down to 4 partitions (4,100: twice the use less the
    // reserve), by giving back the rest, not everything.
    traffic.offer(2_000);
    let four = WIDE.local_rate(4);
    let down = settle(&mut node).await;
    assert!(
        down.iter().all(|&l| l >= four),
        "under 4 partitions: {down:?}"
    );
    let steady = settle(&mut node).await;
    assert!(
        !steady.is_empty() && steady.iter().all(|&l| l == four),
        "{steady:?} held for 2,000 a second: {:?}",
        node.status()
    );
}

/// Guards the fallback: with Redis gone, a node never enforces more than
/// it held, and its share lapses to its reserve within one TTL
/// (fail-static), or is the stated cap (fail-open); with Redis back on the
/// same address, it leases again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_falls_back_and_leasing_resumes() {
    let mut redis = redis(None);
    let ttl = Duration::from_millis(600);
    let store = StoreConfig {
        connect_timeout: Duration::from_millis(200),
        response_timeout: Duration::from_millis(200),
        ..store(&redis)
    };
    let fixed_traffic = Traffic::new(5_100, BUDGET.reserve_rate);
    let open_traffic = Traffic::new(9_000, BUDGET.reserve_rate);
    let mut fixed = Node::new(
        spec(Fallback::Static, ttl),
        store.clone(),
        fixed_traffic.clone(),
    );
    let mut open = Node::new(
        spec(Fallback::Open { rate: 300 }, ttl),
        store.clone(),
        open_traffic.clone(),
    );
    assert!(
        tick_until(&mut fixed, SETTLE, || fixed_traffic.local() == 5_100).await,
        "{:?}",
        fixed.status()
    );
    assert!(
        tick_until(&mut open, SETTLE, || open_traffic.local() == 3_100).await,
        "the 3 left: {:?}",
        open.status()
    );
    redis.stop();
    let stopped = Instant::now();
    let stopped_ns = monotonic_ns();
    open.tick().await;
    assert!(!open.store_up());
    assert_eq!(open_traffic.local(), 300, "fail-open enforces its cap");
    let mut shares = Vec::new();
    while stopped.elapsed() < ttl * 2 {
        let grant = fixed.tick().await;
        shares.push((stopped.elapsed(), fixed_traffic.local(), grant));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!fixed.store_up());
    assert!(
        shares.iter().all(|(_, local, _)| *local <= 5_100),
        "more than it held: {shares:?}"
    );
    // The share counts leases only while Redis cannot have freed them.
    let ttl_ns = ttl.as_nanos() as u64;
    assert!(
        shares
            .iter()
            .all(|(_, local, grant)| *local == 100 || grant.until_ns <= stopped_ns + ttl_ns),
        "a share that outlives its leases: {shares:?}"
    );
    assert!(
        shares
            .iter()
            .filter(|(t, _, _)| *t >= ttl)
            .all(|(_, local, _)| *local == 100),
        "leases counted past their TTL: {shares:?}"
    );
    redis.resume().expect("redis-server again");
    assert!(
        tick_until(&mut fixed, Duration::from_secs(10), || fixed_traffic
            .local()
            > 100)
        .await,
        "leasing did not resume: {:?}",
        fixed.status()
    );
    assert!(fixed.store_up());
}

/// Guards TLS: rediss:// verifies the server against the given CA (the
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

/// Guards the retry: a node refused because another holds every
/// partition is told when their leases lapse, before its next tick, and
/// asking again then gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hungry_node_asks_again_as_the_others_leases_lapse() {
    let redis = redis(None);
    let ttl = Duration::from_millis(1000);
    let a_traffic = Traffic::new(20_000, BUDGET.reserve_rate);
    let a = holding_everything(store(&redis), ttl, &a_traffic).await;
    // a stops renewing, as a node that died.
    drop(a);
    let b_traffic = Traffic::new(20_000, BUDGET.reserve_rate);
    let mut b = Node::new(
        spec(Fallback::Static, ttl),
        store(&redis),
        b_traffic.clone(),
    );
    let deadline = Instant::now() + ttl * 2;
    let mut told = None;
    while told.is_none() && Instant::now() < deadline {
        b.tick().await;
        told = b.retry_at();
        if told.is_none() {
            tokio::time::sleep(b.spec().tick()).await;
        }
    }
    let at = told.unwrap_or_else(|| panic!("b was never told to ask again: {:?}", b.status()));
    tokio::time::sleep_until(at.into()).await;
    b.retry().await;
    assert!(b.status().held > 0, "{:?}", b.status());
}

/// Guards the cluster: with `cluster: true`, leases, renewals, releases and
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
