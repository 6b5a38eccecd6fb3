//! The bounds the tests hold the limiter to, and readers of what it
//! printed (CLI output, `stats --json`, JSON logs, OpenMetrics).

use std::{collections::HashMap, process::Command};

use crate::process::piped;

/// Asserts `got` is within `percent` % of `expected`.
#[track_caller]
pub fn assert_within(got: u64, expected: f64, percent: f64, what: &str) {
    let error = (got as f64 - expected).abs() / expected * 100.0;
    assert!(
        error <= percent,
        "{what}: got {got}, expected {expected:.0} ± {percent}% (off by {error:.1}%)"
    );
}

/// Asserts `got` is within `packets` of `expected`. Floods admitted by a
/// limit arrive exact to the packet or two (B + R × the flood's duration):
/// a tolerance well under the burst lets a wrong burst show.
#[track_caller]
pub fn assert_close(got: u64, expected: f64, packets: f64, what: &str) {
    let off = got as f64 - expected;
    assert!(
        off.abs() <= packets,
        "{what}: got {got}, expected {expected:.1} ± {packets} packets (off by {off:+.1})"
    );
}

/// The entry of rule `name` in `limiter stats --json` output.
pub fn stats_rule(stats: &serde_json::Value, name: &str) -> serde_json::Value {
    stats["rules"]
        .as_array()
        .expect("a rules array")
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no rule {name:?} in {stats}"))
        .clone()
}

/// Asserts a CLI run succeeded; returns its stdout.
#[track_caller]
pub fn ok(output: std::process::Output) -> String {
    assert!(
        output.status.success(),
        "exit {}: {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Polls `what` every 50 ms until it holds; fails with `why` after 10 s.
pub fn wait_until(what: impl Fn() -> bool, why: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !what() {
        assert!(std::time::Instant::now() < deadline, "{why}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Samples of an OpenMetrics exposition as parsed by the Prometheus
/// project's own Python parser: (name, labels, value).
pub fn parse_openmetrics(text: &str) -> Vec<(String, HashMap<String, String>, f64)> {
    let script = "import sys, json\n\
from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
out = [[s.name, s.labels, s.value] for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]\n\
print(json.dumps(out))\n";
    let out = piped(Command::new("python3").args(["-c", script]), text);
    assert!(
        out.status.success(),
        "the exposition does not parse: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("parser output")
}

/// Every line of a `--log-format json` log, each one JSON object.
pub fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}
