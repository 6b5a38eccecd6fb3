//! A node's share of a rule's budget, tick by tick, following its
//! traffic and never exceeding the budget; Redis down and back; a node
//! refused asking again.

use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use limiter::{
    clock::monotonic_ns,
    fleet::{
        Enforcer, Grant, RuleCounts, RuleRef,
        node::{Fallback, Node, Spec},
        share::Budget,
        store::StoreConfig,
    },
};

use super::{redis, store};

/// A rule's traffic as a node sees it: `want` per second offered, of
/// which the share in force is admitted and the rest refused by the
/// aggregate; and every share the node enforced, when.
pub(super) struct Traffic {
    reserve: u64,
    state: Mutex<TrafficState>,
}

pub(super) struct TrafficState {
    want: u64,
    since: Instant,
    counts: RuleCounts,
    grant: Grant,
    /// (when, the share in force from then on).
    enforced: Vec<(Instant, u64)>,
}

impl Traffic {
    pub(super) fn new(want: u64, reserve: u64) -> Arc<Self> {
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

    pub(super) fn enforced(&self) -> Vec<(Instant, u64)> {
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

pub(super) const BUDGET: Budget = Budget {
    global_rate: 8_000,
    partitions: 8,
    reserve_rate: 100,
};

pub(super) fn spec(fallback: Fallback, ttl: Duration) -> Spec {
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
pub(super) const SETTLE: Duration = Duration::from_secs(10);

/// Ticks `node` every tick interval until `done` holds or `within` ends.
pub(super) async fn tick_until(node: &mut Node, within: Duration, done: impl Fn() -> bool) -> bool {
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
pub(super) async fn holding_everything(
    store: StoreConfig,
    ttl: Duration,
    traffic: &Arc<Traffic>,
) -> Node {
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
pub(super) fn run_until(mut node: Node, until: Instant) -> tokio::task::JoinHandle<Node> {
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
pub(super) fn peak_total(a: &[(Instant, u64)], b: &[(Instant, u64)]) -> u64 {
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
