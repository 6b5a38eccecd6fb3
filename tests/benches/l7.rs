//! The layer-7 decision path against governor, in the same run: one key
//! (the hot path) and 10,000 keys (map lookups included). Ratios, not
//! absolute times, are what to compare across machines.

use std::{net::IpAddr, num::NonZeroU32, sync::Arc, time::Duration};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use limiter::http::{Limiter, RequestMeta, SystemClock};
use limiter_tests::{request_from, rules};

const KEYS: u32 = 10_000;

/// The daemon's allocator (limiter-userspace's main.rs), so a key's state
/// is laid out here as it is there; governor's keys too.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn bench(c: &mut Criterion) {
    // A limit nothing in the benchmark reaches: every call admits.
    let text = "max_keys: 1000000\nrules:\n  - { name: api, limit: { rate: 1000000000, unit: second, burst: 1000000000 } }\n";
    let ours = Limiter::new(rules(text), Arc::new(SystemClock));
    let quota = Quota::with_period(Duration::from_nanos(1))
        .unwrap()
        .allow_burst(NonZeroU32::new(1_000_000_000).unwrap());
    let direct = RateLimiter::direct(quota);
    let keyed = RateLimiter::dashmap(quota);
    // The same with `CLOCK_MONOTONIC` (std's `Instant`, the vDSO), the
    // clock the limiter keeps its states in: what the clock alone accounts
    // for of the difference.
    let keyed_monotonic = RateLimiter::dashmap_with_clock(quota, governor::clock::MonotonicClock);
    let addr = |i: u32| -> IpAddr { std::net::Ipv4Addr::from(0x0a00_0000 + i).into() };
    // A request from client `i`, by address alone.
    let from = |i: u32| request_from(addr(i));

    let mut group = c.benchmark_group("one key");
    let one = from(1);
    group.bench_function("limiter l7 (rule match, key, GCRA)", |b| {
        b.iter(|| ours.check(&one).allowed)
    });
    group.bench_function("limiter-common GCRA alone", |b| {
        let gcra =
            limiter_common::gcra::Gcra::new(1_000_000_000, 1_000_000_000, 1_000_000_000).unwrap();
        let cell = std::sync::atomic::AtomicU64::new(0);
        let mut now = 1_000_000_000u64;
        b.iter(|| {
            now += 1;
            limiter_common::meter::acquire(&cell, &gcra, now, 1)
        })
    });
    group.bench_function("governor direct", |b| b.iter(|| direct.check().is_ok()));
    group.finish();

    // What a reading of the time costs: the vDSO's CLOCK_MONOTONIC (as the
    // kernel's clock) and the CPU's counter layer 7 reads instead.
    let mut group = c.benchmark_group("clock");
    group.bench_function("CLOCK_MONOTONIC (vDSO)", |b| {
        b.iter(limiter::clock::monotonic_ns)
    });
    group.bench_function("counter (quanta), anchored to CLOCK_MONOTONIC", |b| {
        b.iter(limiter::clock::counter_monotonic_ns)
    });
    group.finish();

    let mut group = c.benchmark_group("10k keys");
    let mut i = 0;
    group.bench_function("limiter l7", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            ours.check(&from(i)).allowed
        })
    });
    // Two threads at once (as the proxy's two workers), each on keys of
    // its own: wall time per check of both, so shared lines (a rule's
    // counts) show as time the second thread does not save.
    group.bench_function("limiter l7, two threads", |b| {
        b.iter_custom(|iters| on_two_threads(iters, |i| ours.check(&from(i)).allowed))
    });
    group.bench_function("governor keyed (dashmap), two threads", |b| {
        b.iter_custom(|iters| on_two_threads(iters, |i| keyed.check_key(&addr(i)).is_ok()))
    });
    let mut i = 0;
    group.bench_function("governor keyed (dashmap)", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            keyed.check_key(&addr(i)).is_ok()
        })
    });
    let mut i = 0;
    group.bench_function("governor keyed (dashmap), CLOCK_MONOTONIC", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            keyed_monotonic.check_key(&addr(i)).is_ok()
        })
    });
    group.finish();

    // Many rules: 1,000 of /24 sources, and the client under none of them
    // (the catch-all after them applies), as a flood from elsewhere is.
    let mut text = String::from("max_keys: 1000000\nrules:\n");
    for i in 0..1_000u32 {
        let net = std::net::Ipv4Addr::from(0x6400_0000 + (i << 8));
        text.push_str(&format!(
            "  - {{ name: r{i}, match: {{ source: {net}/24 }}, limit: {{ rate: 1000000000, unit: second, burst: 1000000000 }} }}\n"
        ));
    }
    text.push_str(
        "  - { name: rest, limit: { rate: 1000000000, unit: second, burst: 1000000000 } }\n",
    );
    let many = Limiter::new(rules(&text), Arc::new(SystemClock));
    let mut group = c.benchmark_group("1,000 rules");
    let mut i = 0;
    group.bench_function("limiter l7, 10k keys, under the last rule", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            many.check(&from(i)).allowed
        })
    });
    group.finish();

    // Many layer-7 rules: 1,000 routes by path prefix (as an envoy
    // configuration's convert) and a catch-all, requests for a path none
    // of them names.
    let mut text = String::from("max_keys: 1000000\nrules:\n");
    for i in 0..1_000u32 {
        text.push_str(&format!(
            "  - {{ name: r{i}, match: {{ path_prefix: /service-{i}/ }}, limit: {{ rate: 1000000000, unit: second, burst: 1000000000 }} }}\n"
        ));
    }
    text.push_str(
        "  - { name: rest, limit: { rate: 1000000000, unit: second, burst: 1000000000 } }\n",
    );
    let routes = Limiter::new(rules(&text), Arc::new(SystemClock));
    let (method, uri, headers) = (
        http::Method::GET,
        http::Uri::from_static("/other/page"),
        http::HeaderMap::new(),
    );
    let request = |i: u32| RequestMeta {
        http: Some(limiter::rules::HttpRequest {
            method: &method,
            uri: &uri,
            headers: &headers,
        }),
        ..from(i)
    };
    let mut group = c.benchmark_group("1,000 path rules");
    let mut i = 0;
    group.bench_function("limiter l7, 10k keys, under the last rule", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            routes.check(&request(i)).allowed
        })
    });
    group.finish();
}

/// Wall time of `iters` checks made by two threads at once, each on half
/// of the keys, its own (`check(i)`: the check of key `i`).
fn on_two_threads(iters: u64, check: impl Fn(u32) -> bool + Sync) -> std::time::Duration {
    let start = std::time::Instant::now();
    std::thread::scope(|scope| {
        for t in 0..2u32 {
            let check = &check;
            scope.spawn(move || {
                for n in 0..iters / 2 {
                    std::hint::black_box(check((n as u32 % (KEYS / 2)) + t * (KEYS / 2)));
                }
            });
        }
    });
    start.elapsed()
}

/// Memory a key costs, against governor's keyed limiter: resident memory
/// grown by 1,000,000 keys of each (both kept alive, so no freed memory
/// is counted twice), printed once a run.
fn memory_per_key(_: &mut Criterion) {
    const N: u32 = 1_000_000;
    let resident = || -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let pages: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        pages * 4096
    };
    let addr = |i: u32| -> IpAddr { std::net::Ipv4Addr::from(0x0a00_0000 + i).into() };
    let before = resident();
    let quota = Quota::per_second(NonZeroU32::new(1_000_000).unwrap());
    let keyed = RateLimiter::dashmap(quota);
    for i in 0..N {
        std::hint::black_box(keyed.check_key(&addr(i)).is_ok());
    }
    let governor = resident().saturating_sub(before);
    let before = resident();
    let text =
        "max_keys: 2000000\nrules:\n  - { name: api, limit: { rate: 1000000, unit: second } }\n";
    let ours = Limiter::new(rules(text), Arc::new(SystemClock));
    for i in 0..N {
        std::hint::black_box(ours.check(&request_from(addr(i))).allowed);
    }
    let limiter = resident().saturating_sub(before);
    assert_eq!(ours.tracked_keys(), N as usize);
    let per_key = |bytes: u64| bytes as f64 / f64::from(N);
    println!(
        "memory/1,000,000 keys  limiter l7 {:.0} B/key, governor keyed (dashmap) {:.0} B/key: {:.2}x",
        per_key(limiter),
        per_key(governor),
        per_key(limiter) / per_key(governor)
    );
}

criterion_group!(benches, bench, memory_per_key);
criterion_main!(benches);
