//! The daemon on real traffic: restarts and reloads under flood, aggregate
//! limits, blocks, detach, the control socket and the metrics endpoint.
//! Arrivals are counted by nftables in the receiving namespace.

use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    thread,
    time::{Duration, Instant},
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{
    Daemon, OPENMETRICS_ACCEPT, assert_close, assert_within, flood, http_request, ok, sources,
    wait_until, xdp_attached,
};

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

/// Guards the control socket against bad clients: a mode other than 0600,
/// a request that kills the daemon, and a rejected request (bad JSON, bad
/// prefix, unparsable rule file) that changes the rules or blocks in force.
#[test]
fn control_socket_is_root_only_and_survives_bad_clients() {
    let lab = Lab::create("lt-control").expect("lab");
    let daemon = Daemon::start(&lab, "control", &[RX_IFACE], BIG_BURST).expect("daemon");
    let mode = std::fs::metadata(&daemon.socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let ask = |line: &[u8]| {
        let mut stream = UnixStream::connect(&daemon.socket).expect("connect");
        // The daemon may hang up before an oversized line is all written.
        let _ = stream.write_all(line);
        let mut answer = String::new();
        let _ = BufReader::new(stream).read_line(&mut answer);
        answer
    };
    assert!(ask(b"this is not json\n").contains("\"ok\":false"));
    assert!(ask(b"{\"command\":\"launch_missiles\"}\n").contains("unknown variant"));
    assert!(
        ask(b"{\"command\":\"block\",\"prefix\":\"300.1.1.1/8\"}\n")
            .contains("not an address prefix")
    );
    let huge = vec![b'x'; 5 << 20];
    assert!(ask(&huge).contains("\"ok\":false"));
    // A rule file that does not parse, sent straight to the socket.
    assert!(
        ask(b"{\"command\":\"rules_apply\",\"text\":\"rules: [\",\"origin\":\"x.yaml\"}\n")
            .contains("\"ok\":false")
    );
    // Still serving, and still enforcing the same rules: the same rule set,
    // no block from the bad request, and a flood held to the same limit.
    assert!(ask(b"{\"command\":\"status\"}\n").contains("\"ok\":true"));
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(limits(&view), ["100 pkts/s, burst 200"]);
    assert_eq!(view["blocks"].as_array().map(Vec::len), Some(0), "{view}");
    let addrs = v4(1, 6);
    let (report, received) = flood(
        &lab,
        &sources(&lab, 0, &addrs, 1000, 64),
        Duration::from_secs(1),
    );
    assert_close(
        received[&addrs[0]],
        200.0 + 100.0 * report.elapsed.as_secs_f64(),
        10.0,
        "a flood after the bad requests",
    );
}

/// Guards the exporter and the kernel's counters: an exposition Prometheus
/// cannot parse, a verdict counted under the wrong label, and shadow
/// packets never counted by the kernel (held to sent − B − R × duration, not
/// to another reading of the same map).
#[test]
fn metrics_parse_and_agree_with_stats_and_the_receiver() {
    let lab = Lab::create("lt-metrics").expect("lab");
    let rules = "rules:
  - { name: web, match: { source: 198.18.0.0/16 }, limit: { rate: 200, unit: second, burst: 20 } }
  - { name: dry, match: { source: 198.19.0.0/16 }, limit: { rate: 200, unit: second, burst: 20 }, action: shadow }
";
    let daemon = Daemon::start(&lab, "metrics", &[RX_IFACE], rules).expect("daemon");
    let web = v4(3, 5);
    let dry: Vec<IpAddr> = (1..=2)
        .map(|i| IpAddr::V4(Ipv4Addr::new(198, 19, 5, i)))
        .collect();
    let all: Vec<IpAddr> = web.iter().chain(&dry).copied().collect();
    let (report, received) = flood(
        &lab,
        &sources(&lab, 0, &all, 1000, 64),
        Duration::from_secs(2),
    );
    // As Prometheus asks: OpenMetrics (host.rs checks the classic format).
    let (head, body) =
        http_request(&lab.rx, daemon.metrics_port, "/metrics", OPENMETRICS_ACCEPT).expect("scrape");
    assert!(head.contains(" 200 "), "{head}");
    let samples = limiter_tests::parse_openmetrics(&body);
    let sample = |name: &str, labels: &[(&str, &str)]| -> f64 {
        samples
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, v)| *v)
            .sum()
    };
    let stats: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["stats", "--json"]))).expect("JSON");
    let rule = |name: &str| limiter_tests::stats_rule(&stats, name);
    let arrived = |addrs: &[IpAddr]| {
        addrs
            .iter()
            .map(|a| received.get(a).copied().unwrap_or(0))
            .sum::<u64>() as f64
    };
    let sent = |addrs: &[IpAddr]| {
        addrs
            .iter()
            .map(|a| report.sent[all.iter().position(|x| x == a).unwrap()])
            .sum::<u64>() as f64
    };
    let on = |rule: &'static str, verdict: &'static str| {
        [
            ("layer", "xdp"),
            ("interface", RX_IFACE),
            ("rule", rule),
            ("verdict", verdict),
        ]
    };
    // Enforced rule: passed = what arrived; dropped = the rest; stats agree.
    assert_eq!(
        sample("limiter_packets_total", &on("web", "passed")),
        arrived(&web)
    );
    assert_eq!(
        sample("limiter_packets_total", &on("web", "dropped")),
        sent(&web) - arrived(&web)
    );
    assert_eq!(rule("web")["passed_packets"].as_f64(), Some(arrived(&web)));
    assert_eq!(
        rule("web")["dropped_packets"].as_f64(),
        Some(sent(&web) - arrived(&web))
    );
    // Shadow rule: everything arrived; the excess is counted as
    // shadow_dropped. Guards against a kernel that never counts shadow
    // packets: both are held to what the limit admits over the flood
    // (B + R × duration per source, from the sender's clock), not to
    // another reading of the same counters.
    assert_eq!(arrived(&dry), sent(&dry));
    let admitted = dry.len() as f64 * (20.0 + 200.0 * report.elapsed.as_secs_f64());
    let shadowed = sample("limiter_packets_total", &on("dry", "shadow_dropped"));
    let conformed = sample("limiter_packets_total", &on("dry", "passed"));
    let tolerance = 5.0 * dry.len() as f64;
    assert!(
        (shadowed - (sent(&dry) - admitted)).abs() <= tolerance,
        "shadow_dropped {shadowed}, sent {} minus admitted {admitted:.1}",
        sent(&dry)
    );
    assert!(
        (conformed - admitted).abs() <= tolerance,
        "passed {conformed} under a dry run, the limit admits {admitted:.1}"
    );
    assert_eq!(shadowed, rule("dry")["shadow_packets"].as_f64().unwrap());
    // 106-byte frames: 14 Ethernet + 20 IPv4 + 8 UDP + 64 payload.
    assert_eq!(
        sample("limiter_bytes_total", &on("web", "passed")),
        arrived(&web) * 106.0
    );
    assert_eq!(sample("limiter_ruleset_generation", &[]), 1.0);
    assert_eq!(sample("limiter_key_capacity", &[]), 1_048_576.0);
    assert_eq!(
        sample(
            "limiter_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    assert!(samples.iter().any(|(n, _, _)| n == "limiter_tracked_keys"));
    // Dry run for everything, switched live.
    ok(daemon.cli(&["shadow", "on"]));
    let (report2, received2) = flood(
        &lab,
        &sources(&lab, 0, &web[..1], 1000, 64),
        Duration::from_secs(1),
    );
    assert_eq!(
        received2[&web[0]] - received[&web[0]],
        report2.sent[0],
        "nothing dropped under global dry run"
    );

    // Dry run for one rule, switched live.
    ok(daemon.cli(&["shadow", "off"]));
    ok(daemon.cli(&["shadow", "on", "--rule", "web"]));
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(view["rules"][0]["action"], "shadow");
    let before = received2[&web[1]];
    let (report3, received3) = flood(
        &lab,
        &sources(&lab, 0, &web[1..2], 1000, 64),
        Duration::from_secs(1),
    );
    assert_eq!(
        received3[&web[1]] - before,
        report3.sent[0],
        "nothing dropped under the rule's dry run"
    );

    // `limiter top`: every source is a key, ordered by drops, counted per key.
    let top: serde_json::Value = serde_json::from_str(&ok(daemon.cli(&[
        "top",
        "--once",
        "--json",
        "--interval",
        "200ms",
    ])))
    .expect("JSON");
    assert_eq!(top["tracked_keys"], 5);
    let rows = top["top"].as_array().unwrap();
    let dropped: Vec<u64> = rows
        .iter()
        .map(|r| r["dropped_total"].as_u64().unwrap())
        .collect();
    assert!(
        dropped.windows(2).all(|w| w[0] >= w[1]) || rows[0]["dropped_per_sec"].as_f64() > Some(0.0)
    );
    let web0 = rows
        .iter()
        .find(|r| r["source"] == web[0].to_string())
        .expect("web[0] listed");
    assert_eq!(web0["rule"], "web");
    // Per key, `passed` counts conforming packets and `dropped` the excess,
    // also the excess a dry run let through: all that arrived while
    // enforced conformed, and the dry-run flood added at most a refilled
    // burst plus the rate over its length.
    let passed = web0["passed_total"].as_u64().unwrap();
    let most = received[&web[0]] as f64 + 20.0 + 200.0 * report2.elapsed.as_secs_f64() + 1.0;
    assert!(
        passed >= received[&web[0]] && passed as f64 <= most,
        "{web0} (at most {most})"
    );
    assert_eq!(
        web0["passed_total"].as_u64().unwrap() + web0["dropped_total"].as_u64().unwrap(),
        report.sent[0] + report2.sent[0]
    );
}

/// The first event named `name`.
fn event<'a>(events: &'a [serde_json::Value], name: &str) -> &'a serde_json::Value {
    events
        .iter()
        .find(|e| e["event"] == name)
        .unwrap_or_else(|| panic!("no {name} event in {events:#?}"))
}

/// Guards `--log-format json`: a log pipeline gets one JSON object a line,
/// with a timestamp and level, and the rule changes, blocks and the
/// adoption of pinned state as events with their fields.
#[test]
fn json_logs_carry_rule_changes_blocks_and_adoption_as_fields() {
    let lab = Lab::create("lt-jsonlog").expect("lab");
    let rules = |rate: u32| {
        format!(
            "rules:\n  - {{ name: api, match: {{ source: 198.18.0.0/16 }}, limit: {{ rate: {rate}, unit: second }} }}\n"
        )
    };
    let mut daemon = Daemon::start(&lab, "jsonlog", &[RX_IFACE], &rules(10)).expect("daemon");
    daemon.kill9();
    daemon.set_args(&["--log-format", "json"]);
    daemon.spawn().expect("restarting with JSON logs");
    let file = daemon.dir.write("lower.yaml", &rules(5));
    ok(daemon.cli(&["rules", "apply", &file.to_string_lossy()]));
    ok(daemon.cli(&["block", "203.0.113.0/24", "--for", "1h"]));
    ok(daemon.cli(&["unblock", "203.0.113.0/24"]));
    let events = limiter_tests::json_lines(&daemon.log());
    for e in &events {
        assert!(e["timestamp"].is_string() && e["level"].is_string(), "{e}");
    }
    let link = event(&events, "adopted_link");
    assert_eq!(link["iface"], RX_IFACE);
    assert!(event(&events, "adopted_state")["pin_dir"].is_string());
    let applied: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["event"] == "rules_applied")
        .collect();
    assert_eq!(applied.len(), 2, "the restart's and the new file's");
    assert_eq!(applied[1]["carried"], "[\"api\"]", "{}", applied[1]);
    assert!(
        applied[1]["origin"]
            .as_str()
            .is_some_and(|o| o.ends_with("lower.yaml"))
    );
    let blocked = event(&events, "blocked");
    assert_eq!(blocked["prefix"], "203.0.113.0/24");
    assert_eq!(blocked["for_secs"], 3600.0);
    assert_eq!(event(&events, "unblocked")["prefix"], "203.0.113.0/24");
}
