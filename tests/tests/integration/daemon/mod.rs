//! The daemon on real traffic: restarts and reloads under flood, aggregate
//! limits, blocks, detach, the control socket and the metrics endpoint.
//! Arrivals are counted by nftables in the receiving namespace. A file
//! per topic; this one holds what they share.

mod enforcement;
mod lifecycle;
mod operator;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
    thread,
    time::Duration,
};

use limiter::lab::Lab;
use limiter_tests::{flood, sources};

fn v4(n: u8, third: u8) -> Vec<IpAddr> {
    (1..=n)
        .map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, third, i)))
        .collect()
}

/// Runs `during` on another thread while the flood runs on this one.
fn flood_while<T: Send>(
    lab: &Lab,
    addrs: &[IpAddr],
    pps: u64,
    duration: Duration,
    during: impl FnOnce() -> T + Send,
) -> (limiter::lab::FloodReport, HashMap<IpAddr, u64>, T) {
    thread::scope(|scope| {
        let side = scope.spawn(during);
        let (report, received) = flood(lab, &sources(lab, 0, addrs, pps, 64), duration);
        (report, received, side.join().expect("side thread"))
    })
}

/// The limits of the rules in `limiter rules show --json` output, in words.
fn limits(view: &serde_json::Value) -> Vec<&str> {
    view["rules"]
        .as_array()
        .expect("a rules array")
        .iter()
        .map(|r| r["limit"].as_str().expect("a limit"))
        .collect()
}

const BIG_BURST: &str = "rules:
  - { name: flooded, match: { source: 198.18.0.0/16 }, limit: { rate: 100, unit: second, burst: 200 } }
";
