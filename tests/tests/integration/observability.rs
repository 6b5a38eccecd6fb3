//! The operator's artefacts against a live daemon: the Prometheus alert
//! rules (`dist/prometheus/limiter-rules.yml`) pass `promtool check rules`,
//! and `promtool test rules` evaluates every alert on series taken from a
//! running daemon's `/metrics` (so an alert that names a metric or label
//! the daemon does not export fails here): as scraped, and with the one
//! series each alert watches pushed past its threshold.

use std::{collections::BTreeMap, path::Path, process::Command};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{Daemon, OPENMETRICS_ACCEPT, TempDir, http_request};

const RULES_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../dist/prometheus/limiter-rules.yml"
);

type Labels = BTreeMap<String, String>;

/// A sample of an exposition: name, labels, value.
#[derive(Clone, Debug)]
struct Sample {
    name: String,
    labels: Labels,
    value: f64,
}

/// The samples of an OpenMetrics exposition, as Prometheus's own parser
/// reads them.
fn samples_of(exposition: &str) -> Vec<Sample> {
    limiter_tests::parse_openmetrics(exposition)
        .into_iter()
        .map(|(name, labels, value)| Sample {
            name,
            labels: labels.into_iter().collect(),
            value,
        })
        .collect()
}

/// Runs promtool with `args`, which must succeed.
fn promtool(args: &[&str], what: &str) {
    let out = Command::new("promtool")
        .args(args)
        .output()
        .expect("running promtool (cargo xtask setup installs it)");
    assert!(
        out.status.success(),
        "promtool {}: {what}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The labels Prometheus adds to every scraped series.
fn scraped(mut labels: Labels) -> Labels {
    labels.insert("instance".into(), "lab:9464".into());
    labels.insert("job".into(), "limiter".into());
    labels
}

fn series_text(name: &str, labels: &Labels) -> String {
    let pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{name}{{{}}}", pairs.join(","))
}

/// The alerts of the rules file: name, labels, annotations.
#[derive(serde::Deserialize)]
struct RulesFile {
    groups: Vec<Group>,
}

#[derive(serde::Deserialize)]
struct Group {
    rules: Vec<Rule>,
}

#[derive(serde::Deserialize)]
struct Rule {
    alert: String,
    #[serde(default)]
    labels: Labels,
    #[serde(default)]
    annotations: Labels,
}

/// An alert expected to fire with `labels` (those of its expression's
/// result): its full labels and annotations as Prometheus renders them.
fn expected(rule: &Rule, labels: &Labels) -> serde_json::Value {
    let mut all = labels.clone();
    all.extend(rule.labels.clone());
    let annotations: Labels = rule
        .annotations
        .iter()
        .map(|(k, v)| {
            let mut text = v.clone();
            for (name, value) in labels {
                text = text.replace(&format!("{{{{ $labels.{name} }}}}"), value);
            }
            assert!(
                !text.contains("{{"),
                "{}: template left in {text}",
                rule.alert
            );
            (k.clone(), text)
        })
        .collect();
    serde_json::json!({"exp_labels": all, "exp_annotations": annotations})
}

/// A daemon with a fleet rule whose store does not answer (nothing listens
/// on port 1): its fallback is live, the rest healthy; and its samples
/// once the fleet loop has reported the store down.
fn live_daemon(lab: &Lab, name: &str) -> (Daemon, Vec<Sample>) {
    let rules = "rules:
  - { name: web, match: { source: 198.18.0.0/16 }, limit: { rate: 200, unit: second, burst: 20 } }
  - { name: shared, match: { source: 198.19.0.0/16 }, limit: { rate: 100, unit: second }, aggregate: { rate: 1000, unit: second, scope: fleet, reserve: 10 } }
";
    let daemon = Daemon::start_with(
        lab,
        name,
        &[RX_IFACE],
        rules,
        "fleet:\n  store:\n    url: redis://127.0.0.1:1/\n    connect_timeout: 100ms\n  lease_ttl: 2s\n",
        &[],
    )
    .expect("daemon");
    let scrape = || {
        let (head, body) =
            http_request(&lab.rx, daemon.metrics_port, "/metrics", OPENMETRICS_ACCEPT)
                .expect("scrape");
        assert!(head.contains(" 200 "), "{head}");
        samples_of(&body)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let samples = scrape();
        if samples
            .iter()
            .any(|s| s.name == "limiter_fleet_store_up" && s.value == 0.0)
        {
            return (daemon, samples);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the store never showed as down"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// The samples of a `limiter proxy --metrics` with a fleet rule whose
/// store does not answer (the upstream need not exist for a scrape).
fn live_proxy() -> Vec<Sample> {
    let dir = TempDir::new("dashboard-proxy");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: api, limit: { rate: 10, unit: second }, concurrent: 4 }\n  - { name: shared, match: { source: 10.0.0.0/8 }, limit: { rate: 10, unit: second }, aggregate: { rate: 100, unit: second, scope: fleet } }\n",
    );
    let fleet = dir.write(
        "fleet.yaml",
        "store:\n  url: redis://127.0.0.1:1/\n  connect_timeout: 100ms\nlease_ttl: 2s\n",
    );
    let metrics = limiter_tests::free_loopback_addr();
    let p = limiter_tests::proxy(
        &config,
        "http://127.0.0.1:1",
        &["--metrics", &metrics, "--fleet", &fleet.to_string_lossy()],
    );
    // A request, so the per-rule families have samples.
    let _ = limiter_tests::exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let request = format!("GET /metrics HTTP/1.0\r\n{OPENMETRICS_ACCEPT}\r\n");
    let answer = limiter_tests::exchange(metrics.parse().expect("address"), request.as_bytes());
    let (_, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    samples_of(body)
}

#[test]
fn alert_rules_pass_promtool_and_fire_on_a_live_daemons_series() {
    promtool(&["check", "rules", RULES_FILE], "the alert rules");
    let rules_file: RulesFile =
        serde_saphyr::from_str(&std::fs::read_to_string(RULES_FILE).expect("rules file"))
            .expect("the rules file as YAML");
    let alerts: Vec<&Rule> = rules_file.groups.iter().flat_map(|g| &g.rules).collect();

    let lab = Lab::create("lt-alerts").expect("lab");
    let (_daemon, samples) = live_daemon(&lab, "alerts");
    let live = |name: &str| -> Sample {
        samples
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("the daemon exports no {name}"))
            .clone()
    };
    let dropped = samples
        .iter()
        .find(|s| {
            s.name == "limiter_packets_total"
                && s.labels.get("verdict").map(String::as_str) == Some("dropped")
                && s.labels.get("rule").map(String::as_str) == Some("web")
        })
        .expect("the daemon exports dropped packets per rule")
        .clone();
    let instance = scraped(Labels::new());
    let with = |extra: &[(&str, &str)]| {
        let mut labels = instance.clone();
        labels.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        labels
    };
    let fleet = live("limiter_fleet_store_up");

    // One promtool test per case: the live series (constant for 90
    // minutes, `up` 1), with `changed` series replacing or added, and the
    // alerts expected to fire at 70 m; every other alert must not.
    struct Case<'a> {
        what: &'a str,
        changed: Vec<(String, Labels, String)>,
        firing: Vec<(&'a str, Labels)>,
    }
    let fleet_firing = (
        "LimiterFleetFallback",
        with(&[
            ("layer", &fleet.labels["layer"]),
            ("rule", &fleet.labels["rule"]),
        ]),
    );
    let capacity = live("limiter_key_capacity");
    let keys = live("limiter_tracked_keys");
    let cases = vec![
        Case {
            what: "as scraped (the fleet store down)",
            changed: vec![],
            firing: vec![fleet_firing.clone()],
        },
        Case {
            what: "scrapes failing",
            changed: vec![("up".into(), instance.clone(), "0x90".into())],
            firing: vec![("LimiterDown", instance.clone()), fleet_firing.clone()],
        },
        Case {
            what: "key table 95% full",
            changed: vec![(
                keys.name.clone(),
                scraped(keys.labels.clone()),
                format!("{}x90", (capacity.value * 0.95).round()),
            )],
            firing: vec![
                ("LimiterKeyMapNearlyFull", scraped(keys.labels.clone())),
                fleet_firing.clone(),
            ],
        },
        Case {
            what: "slots refused, keys evicted, frames malformed",
            changed: [
                "limiter_key_alloc_failures_total",
                "limiter_key_evictions_total",
                "limiter_parse_failures_total",
            ]
            .iter()
            .map(|name| {
                let s = live(name);
                (s.name, scraped(s.labels), "0+600x90".into())
            })
            .collect(),
            firing: vec![
                ("LimiterNewSourcesRefusedASlot", instance.clone()),
                ("LimiterKeysEvicted", instance.clone()),
                ("LimiterParseFailures", instance.clone()),
                fleet_firing.clone(),
            ],
        },
        Case {
            what: "drops jumping tenfold",
            changed: vec![(
                dropped.name.clone(),
                scraped(dropped.labels.clone()),
                "0x60 60000+60000x30".into(),
            )],
            firing: vec![
                ("LimiterDropRateJump", with(&[("rule", "web")])),
                fleet_firing.clone(),
            ],
        },
        Case {
            what: "a rule file refused",
            changed: vec![{
                let s = live("limiter_rule_file_rejections_total");
                (s.name, scraped(s.labels), "0x60 1x30".into())
            }],
            firing: vec![
                ("LimiterRuleFileRejected", with(&[("layer", "xdp")])),
                fleet_firing.clone(),
            ],
        },
        Case {
            what: "pins gone",
            changed: vec![{
                let s = live("limiter_pins_missing");
                (s.name, scraped(s.labels), "1x90".into())
            }],
            firing: vec![
                ("LimiterPinsMissing", instance.clone()),
                fleet_firing.clone(),
            ],
        },
        Case {
            what: "partitions leased by a foreign writer",
            changed: vec![{
                let s = live("limiter_fleet_foreign_partitions");
                (s.name, scraped(s.labels), "3x90".into())
            }],
            firing: vec![
                (
                    "LimiterFleetForeignLeases",
                    with(&[
                        ("layer", &fleet.labels["layer"]),
                        ("rule", &fleet.labels["rule"]),
                    ]),
                ),
                fleet_firing,
            ],
        },
    ];

    let dir = TempDir::new("alert-tests");
    let mut tests = Vec::new();
    for case in &cases {
        let mut input: BTreeMap<String, String> = samples
            .iter()
            .map(|s| {
                (
                    series_text(&s.name, &scraped(s.labels.clone())),
                    format!("{}x90", s.value),
                )
            })
            .collect();
        input.insert(series_text("up", &instance), "1x90".into());
        for (name, labels, values) in &case.changed {
            input.insert(series_text(name, labels), values.clone());
        }
        let alert_tests: Vec<serde_json::Value> = alerts
            .iter()
            .map(|rule| {
                let firing: Vec<serde_json::Value> = case
                    .firing
                    .iter()
                    .filter(|(name, _)| *name == rule.alert)
                    .map(|(_, labels)| expected(rule, labels))
                    .collect();
                serde_json::json!({"eval_time": "70m", "alertname": rule.alert, "exp_alerts": firing})
            })
            .collect();
        tests.push(serde_json::json!({
            "name": case.what,
            "interval": "1m",
            "input_series": input.iter().map(|(series, values)| {
                serde_json::json!({"series": series, "values": values})
            }).collect::<Vec<_>>(),
            "alert_rule_test": alert_tests,
        }));
        for (name, _) in &case.firing {
            assert!(
                alerts.iter().any(|r| r.alert == *name),
                "no alert {name} in the rules file"
            );
        }
    }
    // Every alert of the file is made to fire by some case.
    for rule in &alerts {
        assert!(
            cases
                .iter()
                .any(|c| c.firing.iter().any(|(n, _)| *n == rule.alert)),
            "no case fires {}",
            rule.alert
        );
    }
    // YAML is a superset of JSON: promtool reads this as it is.
    let test_file = dir.write(
        "alert-tests.yml",
        &serde_json::to_string_pretty(&serde_json::json!({
            "rule_files": [Path::new(RULES_FILE).canonicalize().expect("rules file")],
            "evaluation_interval": "1m",
            "tests": tests,
        }))
        .expect("JSON"),
    );
    promtool(
        &["test", "rules", &test_file.to_string_lossy()],
        "the alerts on the live series",
    );
}

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../dist/grafana/limiter.json");

/// Every PromQL expression of the dashboard (panel targets, template
/// variable queries), Grafana's variables given values Prometheus accepts.
fn dashboard_queries() -> Vec<String> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(DASHBOARD).expect("dashboard"))
            .expect("the dashboard as JSON");
    let mut queries = Vec::new();
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .collect();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target's expr");
            // `{{label}}` in a legend must name a label of the result.
            let legend = target["legendFormat"].as_str().unwrap_or("");
            queries.push(format!("{expr}\u{0}{legend}"));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if let Some(query) = variable["query"].as_str().and_then(|q| {
            q.strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
        }) {
            // label_values(selector, label)
            let (selector, label) = query.rsplit_once(',').expect("selector, label");
            queries.push(format!("{selector}\u{0}{{{{{}}}}}", label.trim()));
        }
    }
    queries
        .into_iter()
        .map(|q| {
            q.replace("$__rate_interval", "5m")
                .replace("$instance", ".*")
                .replace("$interface", ".*")
        })
        .collect()
}

/// Guards the Grafana dashboard (`dist/grafana/limiter.json`): every
/// expression parses (`promtool check rules` on them as recording rules),
/// and names only metrics and labels that a live daemon and a live proxy
/// export (or that Prometheus adds: `instance`, `job`).
#[test]
fn the_dashboard_queries_only_what_the_daemon_and_proxy_export() {
    let lab = Lab::create("lt-dashboard").expect("lab");
    let (_daemon, mut samples) = live_daemon(&lab, "dashboard");
    samples.extend(live_proxy());
    let metrics: std::collections::BTreeSet<&str> =
        samples.iter().map(|s| s.name.as_str()).collect();
    let mut labels: std::collections::BTreeSet<&str> = samples
        .iter()
        .flat_map(|s| s.labels.keys().map(String::as_str))
        .collect();
    labels.extend(["instance", "job"]);
    assert!(
        labels.contains("layer") && metrics.contains("limiter_in_flight_refused_requests_total")
    );

    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    let keywords = [
        "sum",
        "max",
        "min",
        "avg",
        "count",
        "topk",
        "bottomk",
        "rate",
        "irate",
        "increase",
        "by",
        "without",
        "on",
        "ignoring",
        "and",
        "or",
        "unless",
        "offset",
        "label_values",
    ];
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, query) in queries.iter().enumerate() {
        let (expr, legend) = query.split_once('\u{0}').expect("expr and legend");
        rules += &format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(expr).expect("a JSON string is a YAML string")
        );
        // Metric names: identifiers not followed by `(` that are not
        // keywords or label names inside braces and `by (...)`.
        let mut rest = expr;
        let mut in_braces = false;
        let mut in_grouping = false;
        while let Some(c) = rest.chars().next() {
            if c.is_ascii_alphabetic() || c == '_' {
                let end = rest
                    .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == ':'))
                    .unwrap_or(rest.len());
                let word = &rest[..end];
                let after = rest[end..].trim_start();
                if in_braces || in_grouping {
                    assert!(labels.contains(word), "{expr}: no label {word} is exported");
                } else if after.starts_with('(') {
                    in_grouping = matches!(word, "by" | "without" | "on" | "ignoring");
                } else if !keywords.contains(&word) {
                    assert!(
                        metrics.contains(word),
                        "{expr}: no metric {word} is exported"
                    );
                }
                rest = &rest[end..];
                continue;
            }
            match c {
                '{' => in_braces = true,
                '}' => in_braces = false,
                ')' => in_grouping = false,
                '"' => {
                    // Skip a string (a label value or regex).
                    let close = rest[1..].find('"').expect("a closed string");
                    rest = &rest[close + 2..];
                    continue;
                }
                '[' => {
                    let close = rest.find(']').expect("a closed range");
                    rest = &rest[close + 1..];
                    continue;
                }
                _ => {}
            }
            rest = &rest[c.len_utf8()..];
        }
        for part in legend.split("{{").skip(1) {
            let label = part.split("}}").next().unwrap_or("").trim();
            assert!(
                labels.contains(label),
                "{expr}: legend label {label} is not exported"
            );
        }
    }
    let dir = TempDir::new("dashboard");
    let file = dir.write("dashboard-rules.yml", &rules);
    promtool(
        &["check", "rules", &file.to_string_lossy()],
        &format!("the dashboard's expressions do not parse:\n{rules}"),
    );
}
