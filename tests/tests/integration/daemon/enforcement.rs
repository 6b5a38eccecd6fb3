//! What the daemon enforces on real traffic: an aggregate limit over many
//! sources, and blocks that expire without it.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{Daemon, assert_within, flood, ok, sources};

use super::v4;

#[test]
fn aggregate_limit_holds_across_fifty_sources() {
    let lab = Lab::create("lt-aggregate").expect("lab");
    let rules = "rules:
  - name: many
    match: { source: 198.18.0.0/16 }
    limit: { rate: 100, unit: second, burst: 10 }
    aggregate: { rate: 1000, unit: second, burst: 100 }
";
    let daemon = Daemon::start(&lab, "aggregate", &[RX_IFACE], rules).expect("daemon");
    let addrs = v4(50, 3);
    let (report, received) = flood(
        &lab,
        &sources(&lab, 0, &addrs, 150, 64),
        Duration::from_secs(3),
    );
    let total: u64 = addrs
        .iter()
        .map(|a| received.get(a).copied().unwrap_or(0))
        .sum();
    // Each source alone would get 10 + 100 t; together they are held to the aggregate.
    assert_within(
        total,
        100.0 + 1000.0 * report.elapsed.as_secs_f64(),
        5.0,
        "50 sources together",
    );
    let stats: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["stats", "--json"]))).expect("JSON");
    let many = stats["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "many")
        .unwrap();
    assert_eq!(many["passed_packets"].as_u64(), Some(total));
    assert!(many["aggregate_excess"].as_u64().unwrap() > 1000, "{many}");
}

/// Guards the kernel's block lookups: an IPv4 block that expires by itself
/// (no daemon), an IPv6 block without expiry that drops every packet of its
/// prefix, and a global dry run that lets a blocked source through.
#[test]
fn blocks_expire_on_time_without_the_daemon() {
    let lab = Lab::create("lt-block").expect("lab");
    let rules = "rules:\n  - { name: open, match: { source: 198.18.0.0/16 }, limit: unlimited }\n";
    let mut daemon = Daemon::start(&lab, "block", &[RX_IFACE], rules).expect("daemon");
    let blocked_v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 1));
    let addrs = [IpAddr::V4(Ipv4Addr::new(198, 18, 4, 1)), blocked_v6];
    ok(daemon.cli(&["block", "198.18.4.0/24", "--for", "1s"]));
    let blocked_at = Instant::now();
    ok(daemon.cli(&["block", "2001:db8:77::/48"]));
    let listed = ok(daemon.cli(&["rules", "show"]));
    assert!(
        listed.contains("198.18.4.0/24") && listed.contains("2001:db8:77::/48"),
        "{listed}"
    );
    // The kernel lifts the block by itself: no daemon from here on.
    daemon.kill9();
    let flood_at = Instant::now();
    let (report, received) = flood(
        &lab,
        &sources(&lab, 0, &addrs, 1000, 64),
        Duration::from_secs(3),
    );
    // The part of the block's second that overlapped the flood.
    let blocked_for = 1.0 - flood_at.duration_since(blocked_at).as_secs_f64();
    let expected = report.sent[0] as f64 - 1000.0 * blocked_for;
    assert_within(
        received.get(&addrs[0]).copied().unwrap_or(0),
        expected,
        5.0,
        "packets after the 1 s block expired",
    );
    assert!(report.sent[1] > 2000, "the IPv6 source was not flooded");
    assert_eq!(
        received.get(&blocked_v6).copied().unwrap_or(0),
        0,
        "packets through the IPv6 block without expiry"
    );
    daemon.spawn().expect("restart");
    // The block counts what it dropped: everything the IPv6 source sent.
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    let v6_block = view["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .find(|b| b["prefix"] == "2001:db8:77::/48")
        .unwrap_or_else(|| panic!("the IPv6 block is listed: {view}"));
    assert_eq!(v6_block["expires_in_secs"], serde_json::Value::Null);
    assert_eq!(v6_block["dropped_packets"].as_u64(), Some(report.sent[1]));
    // A global dry run lets the blocked source through (and counts it).
    ok(daemon.cli(&["shadow", "on"]));
    let (dry, received_dry) = flood(
        &lab,
        &sources(&lab, 0, &addrs[1..], 1000, 64),
        Duration::from_secs(1),
    );
    assert!(dry.sent[0] > 500, "the blocked source was not flooded");
    assert_eq!(
        received_dry.get(&blocked_v6).copied().unwrap_or(0),
        dry.sent[0],
        "a blocked source under a global dry run"
    );
    ok(daemon.cli(&["shadow", "off"]));
    ok(daemon.cli(&["unblock", "2001:db8:77::/48"]));
    let out = daemon.cli(&["unblock", "2001:db8:77::/48"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("2001:db8:77::/48 is not blocked"));
}
