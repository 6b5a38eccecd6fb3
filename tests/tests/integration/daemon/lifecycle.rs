//! The daemon's life under flood: killed with -9 and restarted, its rules
//! reloaded (over the control socket and by SIGHUP), and detached.

use std::{
    thread,
    time::{Duration, Instant},
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{
    Daemon, OPENMETRICS_ACCEPT, assert_within, flood, http_request, ok, sources, wait_until,
    xdp_attached,
};

use super::{BIG_BURST, flood_while, limits, v4};

#[test]
fn kill_9_and_restart_under_flood_admit_no_second_burst() {
    let lab = Lab::create("lt-restart").expect("lab");
    let mut daemon = Daemon::start(&lab, "restart", &[RX_IFACE], BIG_BURST).expect("daemon");
    let addrs = v4(4, 1);
    let start = Instant::now();
    // Long enough that the new daemon (under a second to load on a busy
    // 2-CPU machine, a few on a slow day: the verifier; far longer in the
    // kernel matrix's emulated guests, which say so with a longer start
    // timeout) serves well before the flood ends.
    let flood_for = Duration::from_secs(14).max(limiter_tests::start_timeout() / 3);
    let (report, received, restarted_log) = flood_while(&lab, &addrs, 1000, flood_for, || {
        thread::sleep(Duration::from_millis(1200));
        daemon.kill9();
        // Enforcement goes on with nobody home...
        let attached = xdp_attached(lab.rx.name(), RX_IFACE);
        thread::sleep(Duration::from_millis(800));
        daemon.spawn().expect("restarting the daemon");
        assert!(attached, "the program left the interface with the daemon");
        (daemon.log(), start.elapsed())
    });
    let (log, restarted_at) = restarted_log;
    assert!(
        restarted_at < report.elapsed,
        "the restart happened after the flood: serving again at {restarted_at:?}"
    );
    assert!(log.contains("adopted the pinned link"), "{log}");
    assert!(log.contains("unchanged [\"flooded\"]"), "{log}");
    // A second burst would add 200 (+33%); a gap in enforcement far more.
    let expected = 200.0 + 100.0 * report.elapsed.as_secs_f64();
    for addr in &addrs {
        assert_within(
            received[addr],
            expected,
            5.0,
            &format!("{addr} across a kill -9 and restart"),
        );
    }
}

#[test]
fn reloads_under_flood_keep_buckets_and_a_rejected_file_changes_nothing() {
    let lab = Lab::create("lt-reload").expect("lab");
    let other = |rate: u32| {
        format!(
            "{BIG_BURST}  - {{ name: other, match: {{ source: 198.19.0.0/16 }}, limit: {{ rate: {rate}, unit: second }} }}\n"
        )
    };
    let daemon = Daemon::start(&lab, "reload", &[RX_IFACE], &other(1)).expect("daemon");
    let addrs = v4(1, 2);
    let (report, received, outputs) = flood_while(
        &lab,
        &addrs,
        1000,
        Duration::from_secs(4),
        || {
            let mut outputs = Vec::new();
            for i in 0..20 {
                let file = daemon.dir.write(&format!("rules-{i}.yaml"), &other(2 + i));
                outputs.push(ok(daemon.cli(&["rules", "apply", &file.to_string_lossy()])));
                thread::sleep(Duration::from_millis(100));
            }
            // A typo in the last rule: `limt`.
            let bad = daemon.dir.write(
            "bad.yaml",
            &format!("{BIG_BURST}  - {{ name: other, match: {{ source: 198.19.0.0/16 }}, limt: {{ rate: 99, unit: second }} }}\n"),
        );
            let rejected = daemon.cli(&["rules", "apply", &bad.to_string_lossy()]);
            (outputs, rejected)
        },
    );
    let (outputs, rejected) = outputs;
    assert_eq!(outputs.len(), 20);
    for out in &outputs {
        // `other`'s limit alone changes: its keys kept, state carried.
        assert!(out.contains("new limits (state carried)  other"), "{out}");
        assert!(out.contains("unchanged (buckets kept)    flooded"), "{out}");
    }
    assert!(!rejected.status.success());
    let stderr = String::from_utf8_lossy(&rejected.stderr);
    assert!(
        stderr.contains("bad.yaml:3: rules[1]: unknown field `limt`"),
        "{stderr}"
    );
    let expected = 200.0 + 100.0 * report.elapsed.as_secs_f64();
    assert_within(
        received[&addrs[0]],
        expected,
        5.0,
        "the flooded source across 20 reloads",
    );
    // The rejected file changed nothing: the last good rule set is in force.
    let show = ok(daemon.cli(&["rules", "show", "--json"]));
    let view: serde_json::Value = serde_json::from_str(&show).expect("rules show JSON");
    assert_eq!(
        limits(&view),
        ["100 pkts/s, burst 200", "21 pkts/s, burst 21"]
    );
}

/// Guards the daemon's re-reading of its rule file on SIGHUP: a valid file
/// goes in force; a bad one is refused, counted where an alert can see it
/// (`limiter_rule_file_rejections_total`), and changes nothing: the
/// limit the good file set still holds the packets of a flood.
#[test]
fn sighup_rereads_the_rule_file_and_a_bad_one_is_counted_and_changes_nothing() {
    let lab = Lab::create("lt-sighup").expect("lab");
    let daemon = Daemon::start(&lab, "sighup", &[RX_IFACE], BIG_BURST).expect("daemon");
    let rules_show = || -> serde_json::Value {
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON")
    };
    // A sample of the daemon's metrics, by name.
    let metric = |name: &str| {
        let (_, body) = http_request(&lab.rx, daemon.metrics_port, "/metrics", OPENMETRICS_ACCEPT)
            .expect("scrape");
        limiter_tests::parse_openmetrics(&body)
            .into_iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, v)| v)
    };
    let rejections = || metric("limiter_rule_file_rejections_total");
    assert_eq!(rejections(), Some(0.0));
    daemon.dir.write(
        "rules.yaml",
        "rules:\n  - { name: flooded, match: { source: 198.18.0.0/16 }, limit: { rate: 50, unit: second, burst: 20 } }\n",
    );
    daemon.hang_up();
    wait_until(
        || limits(&rules_show()) == ["50 pkts/s, burst 20"],
        "the rewritten file never went in force",
    );
    daemon.dir.write("rules.yaml", "rules: [ {");
    daemon.hang_up();
    wait_until(
        || rejections() == Some(1.0),
        "the bad file was never counted as refused",
    );
    assert_eq!(limits(&rules_show()), ["50 pkts/s, burst 20"]);
    assert_eq!(metric("limiter_ruleset_generation"), Some(2.0));
    let addrs = v4(1, 9);
    let (report, received) = flood(
        &lab,
        &sources(&lab, 0, &addrs, 500, 64),
        Duration::from_secs(2),
    );
    assert_within(
        received[&addrs[0]],
        20.0 + 50.0 * report.elapsed.as_secs_f64(),
        5.0,
        "a flood after the refused file",
    );
}

#[test]
fn detach_leaves_no_program_link_or_pin() {
    let lab = Lab::with_pairs("lt-detach", 2).expect("lab");
    let mut daemon =
        Daemon::start(&lab, "detach", &[RX_IFACE, "veth-rx1"], BIG_BURST).expect("daemon");
    assert!(xdp_attached(lab.rx.name(), RX_IFACE) && xdp_attached(lab.rx.name(), "veth-rx1"));
    let out = ok(daemon.cli(&["detach"]));
    assert!(out.contains("detached from veth-rx, veth-rx1"), "{out}");
    assert!(daemon.wait_exit().expect("exit").success());
    assert!(!xdp_attached(lab.rx.name(), RX_IFACE) && !xdp_attached(lab.rx.name(), "veth-rx1"));
    assert!(!daemon.pin_dir.exists(), "pins left behind");
    assert!(!daemon.socket.exists(), "socket left behind");
    // With no daemon, detach works on the pins directly (nothing left to do).
    ok(daemon.cli(&["detach"]));
}
