//! What an operator talks to and reads: the control socket, the metrics
//! endpoint and the JSON log.

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    time::Duration,
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{Daemon, OPENMETRICS_ACCEPT, assert_close, flood, http_request, ok, sources};

use super::{BIG_BURST, limits, v4};

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
