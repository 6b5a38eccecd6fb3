//! The operator's artefacts against a live daemon: the Prometheus alert
//! rules (`dist/prometheus/limiter-rules.yml`) pass `promtool check rules`,
//! and `promtool test rules` evaluates every alert on series taken from a
//! running daemon's `/metrics` (so an alert that names a metric or label
//! the daemon does not export fails here): as scraped, and with the one
//! series each alert watches pushed past its threshold.

use std::{collections::BTreeMap, path::Path, process::Command};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{Daemon, TempDir, http_request};

const RULES_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../dist/prometheus/limiter-rules.yml"
);

type Labels = BTreeMap<String, String>;

/// A sample of the classic text exposition: name, labels, value.
#[derive(Clone, Debug)]
struct Sample {
    name: String,
    labels: Labels,
    value: f64,
}

fn parse_exposition(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a value");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|p| !p.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once('=').expect("label=value");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            Sample {
                name: name.to_owned(),
                labels,
                value: value.parse().expect("a number"),
            }
        })
        .collect()
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

#[test]
fn alert_rules_pass_promtool_and_fire_on_a_live_daemons_series() {
    let check = Command::new("promtool")
        .args(["check", "rules", RULES_FILE])
        .output()
        .expect("running promtool (cargo xtask setup installs it)");
    assert!(
        check.status.success(),
        "promtool check rules: {}",
        String::from_utf8_lossy(&check.stdout)
    );
    let rules_file: RulesFile =
        serde_saphyr::from_str(&std::fs::read_to_string(RULES_FILE).expect("rules file"))
            .expect("the rules file as YAML");
    let alerts: Vec<&Rule> = rules_file.groups.iter().flat_map(|g| &g.rules).collect();

    // A daemon with a fleet rule whose store does not answer (nothing
    // listens on port 1): its fallback is live, the rest healthy.
    let lab = Lab::create("lt-alerts").expect("lab");
    let rules = "rules:
  - { name: web, match: { source: 198.18.0.0/16 }, limit: { rate: 200, unit: second, burst: 20 } }
  - { name: shared, match: { source: 198.19.0.0/16 }, limit: { rate: 100, unit: second }, aggregate: { rate: 1000, unit: second, scope: fleet, reserve: 10 } }
";
    let daemon = Daemon::start_with(
        &lab,
        "alerts",
        &[RX_IFACE],
        rules,
        "fleet:\n  store:\n    url: redis://127.0.0.1:1/\n    connect_timeout: 100ms\n  lease_ttl: 2s\n",
        &[],
    )
    .expect("daemon");
    let scrape = || {
        let (head, body) =
            http_request(&lab.rx, daemon.metrics_port, "/metrics", "").expect("scrape");
        assert!(head.contains(" 200 "), "{head}");
        parse_exposition(&body)
    };
    // The fleet loop reports the store down after its first attempt.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let samples = loop {
        let samples = scrape();
        if samples
            .iter()
            .any(|s| s.name == "limiter_fleet_store_up" && s.value == 0.0)
        {
            break samples;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the store never showed as down"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
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
            what: "pins gone",
            changed: vec![{
                let s = live("limiter_pins_missing");
                (s.name, scraped(s.labels), "1x90".into())
            }],
            firing: vec![("LimiterPinsMissing", instance.clone()), fleet_firing],
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
    let run = Command::new("promtool")
        .args(["test", "rules", &test_file.to_string_lossy()])
        .output()
        .expect("running promtool");
    assert!(
        run.status.success(),
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
