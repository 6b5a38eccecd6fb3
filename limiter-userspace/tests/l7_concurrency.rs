//! Layer 7 under concurrency: a client within its limit is never refused,
//! however the threads judging its requests are scheduled. Many threads
//! hammer one key at a hundredth of a tight limit (1,000,000/s, burst
//! 100: 100 us of headroom, more than the 64 clients can use at once) while other threads keep both CPUs
//! busy, so the judging threads are preempted at any point of a check.
//! A check that read the clock before waiting (for the key map's lock, or
//! for a CPU) judges with a stale time and refuses a conforming request.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use limiter::{
    http::{Limiter, RequestMeta, SystemClock},
    rules::RuleSet,
};

#[test]
fn a_client_within_its_limit_is_never_refused() {
    let rules = RuleSet::parse(
        "rules:\n  - name: api\n    limit: { rate: 1000000, unit: second, burst: 100 }\n",
        Path::new("rules.yaml"),
    )
    .unwrap();
    let limiter = Arc::new(Limiter::new(rules, Arc::new(SystemClock)));
    let stop = Arc::new(AtomicBool::new(false));
    let (passed, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // CPU hogs: the judging threads lose their CPU at random points.
    let hogs: Vec<_> = (0..4)
        .map(|_| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    // 64 clients of one key, 10,000 requests/s together: a hundredth of
    // the limit.
    let clients: Vec<_> = (0..64)
        .map(|_| {
            let (limiter, stop) = (Arc::clone(&limiter), Arc::clone(&stop));
            let (passed, refused) = (Arc::clone(&passed), Arc::clone(&refused));
            thread::spawn(move || {
                let request = RequestMeta {
                    client: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
                    port: None,
                    key: None,
                    bytes: 100,
                    http: None,
                };
                while !stop.load(Ordering::Relaxed) {
                    let counter = if limiter.check(&request).allowed {
                        &passed
                    } else {
                        &refused
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_micros(6_400));
                }
            })
        })
        .collect();
    let start = Instant::now();
    thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    for t in clients.into_iter().chain(hogs) {
        t.join().unwrap();
    }
    let (passed, refused) = (
        passed.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    println!(
        "{passed} passed, {refused} refused in {:?} ({:.0} requests/s)",
        start.elapsed(),
        (passed + refused) as f64 / start.elapsed().as_secs_f64()
    );
    assert!(passed > 10_000, "the clients barely ran: {passed}");
    assert_eq!(refused, 0, "requests at a hundredth of the limit refused");
}
