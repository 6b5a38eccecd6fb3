//! `limiter trace` on real traffic: the real program on a veth, frames
//! from sources the test chooses, and what the trace says checked against
//! what the receiver counted (nftables, independently of the limiter) and
//! against the rule (which packets a burst lets through, what is left).

use std::{
    io::{BufRead, BufReader, Read},
    net::{IpAddr, Ipv4Addr},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{Daemon, RunningLimiter, TempDir, flood, limiter_command, run_in_lab, sources};
use serde_json::Value;

const RULES: &str = "rules:
  - { name: held, match: { source: 198.18.0.0/16, protocol: udp }, key: source, limit: { rate: 1, unit: minute, burst: 5 } }
  - { name: roomy, match: { source: 198.19.0.0/16 }, key: source, limit: { rate: 100000, unit: second, burst: 100000 } }
";

/// A `limiter trace` child; killed on drop if still running.
struct Tracer {
    child: Child,
    /// Its output, read as it comes (a full pipe would stall it).
    output: Option<std::thread::JoinHandle<String>>,
}

impl Tracer {
    /// Starts `limiter trace --json` with `args` in the receiver's
    /// namespace (interface names are its), and waits until it traces.
    fn start(lab: &Lab, args: &[&str]) -> Self {
        let mut all = vec!["trace", "--json"];
        all.extend_from_slice(args);
        let mut child = limiter_command(Some(lab.rx.name()), &all)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning limiter trace");
        let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let mut said = String::new();
        stderr.read_line(&mut said).expect("reading its stderr");
        assert!(
            said.contains("limiter trace: tracing"),
            "limiter trace did not start: {said}"
        );
        let mut stdout = child.stdout.take().expect("stdout");
        let output = std::thread::spawn(move || {
            let mut out = String::new();
            stdout.read_to_string(&mut out).expect("reading its output");
            out
        });
        Self {
            child,
            output: Some(output),
        }
    }

    /// [`Tracer::start`] against the pins of `limiter run` (no daemon).
    fn of_run(lab: &Lab, running: &RunningLimiter, args: &[&str]) -> Self {
        let pins = running.pin_dir.to_string_lossy().into_owned();
        let mut all = vec!["--pin-dir", &pins, "--socket", "/nonexistent/control.sock"];
        all.extend_from_slice(args);
        Self::start(lab, &all)
    }

    /// Its lines, parsed, once it exits (within 20 s).
    fn lines(mut self) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().expect("waiting").is_none() {
            assert!(Instant::now() < deadline, "limiter trace did not stop");
            std::thread::sleep(Duration::from_millis(50));
        }
        let status = self.child.try_wait().expect("waiting").expect("exited");
        let out = self
            .output
            .take()
            .expect("read once")
            .join()
            .expect("reader thread");
        assert!(status.success(), "limiter trace failed: {status}\n{out}");
        out.lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn v4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 18, c, d))
}

/// The lab demo's question: why is this source dropped? Every decision
/// about it is traced, and only about it: the burst's 5 pass with what is
/// left falling 4, 3, 2, 1, 0; the rest are dropped by the key's packet
/// meter with nothing left. The passes traced are what the receiver got.
#[test]
fn trace_explains_each_decision_about_one_source() {
    let lab = Lab::create("lt-trace").expect("lab");
    let dir = TempDir::new("trace");
    let running = run_in_lab(&lab, &dir, "trace", RULES);
    let pins = running.pin_dir.to_string_lossy().into_owned();
    // `limiter trace` run to its end, against the same pins.
    let trace_once = |args: &[&str]| {
        let mut all = vec![
            "trace",
            "--pin-dir",
            &pins,
            "--socket",
            "/nonexistent/control.sock",
        ];
        all.extend_from_slice(args);
        limiter_command(Some(lab.rx.name()), &all)
    };
    let tracer = Tracer::of_run(
        &lab,
        &running,
        &[
            "--source",
            "198.18.0.1",
            "--count",
            "40",
            "--duration",
            "15s",
        ],
    );
    // Another tracer at the same time is refused, and says why.
    let second = trace_once(&[]).output().expect("running a second trace");
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && said.contains("another `limiter trace`"),
        "{said}"
    );
    let traced_source = v4(0, 1);
    let flooding = sources(&lab, 0, &[traced_source, v4(0, 2)], 40, 32);
    let (_, received) = flood(&lab, &flooding, Duration::from_secs(1));
    let lines = tracer.lines();
    assert_eq!(lines.len(), 40, "40 frames from 198.18.0.1: {lines:#?}");
    let arrived = received.get(&traced_source).copied().unwrap_or(0);
    let passed: Vec<&Value> = lines.iter().filter(|l| l["verdict"] == "passed").collect();
    assert_eq!(passed.len() as u64, arrived, "passes traced vs arrivals");
    assert_eq!(passed.len(), 5, "the burst");
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["source"], "198.18.0.1", "{line}");
        assert_eq!(line["layer"], "xdp");
        assert_eq!(line["interface"], RX_IFACE);
        assert_eq!(line["protocol"], "udp");
        assert_eq!(line["rule"], "held");
        let left = &line["left"][0];
        assert_eq!(left["meter"], "key packets", "{line}");
        assert_eq!(left["of"], 5);
        if i < 5 {
            assert_eq!(line["verdict"], "passed", "{line}");
            assert_eq!(left["left"], 4 - i as u64, "{line}");
            assert!(line["refused_by"].is_null());
        } else {
            assert_eq!(line["verdict"], "dropped", "{line}");
            assert_eq!(line["refused_by"], "key packets", "{line}");
            assert_eq!(left["left"], 0, "{line}");
        }
    }
    // The trace is off once its tracer is gone: the next tracer starts.
    let again = trace_once(&["--duration", "200ms"])
        .output()
        .expect("tracing again");
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    running.stop().expect("limiter run stops cleanly");
}

/// Under a flood, a trace is safe: one decision in N, of the verdicts
/// asked for only. 2,000-odd frames all within their limit, one in four
/// traced: binomial, so within five standard deviations of a quarter.
#[test]
fn a_sampled_trace_keeps_one_in_n_of_the_verdicts_asked_for() {
    let lab = Lab::create("lt-trace-sample").expect("lab");
    let dir = TempDir::new("trace-sample");
    let running = run_in_lab(&lab, &dir, "trace-sample", RULES);
    let tracer = Tracer::of_run(
        &lab,
        &running,
        &["--verdict", "passed", "--sample", "4", "--duration", "4s"],
    );
    let roomy: Vec<IpAddr> = (1..=4)
        .map(|d| IpAddr::V4(Ipv4Addr::new(198, 19, 0, d)))
        .collect();
    // And a held source whose drops must not show.
    let mut all = roomy.clone();
    all.push(v4(0, 9));
    let (_, received) = flood(
        &lab,
        &sources(&lab, 0, &all, 250, 32),
        Duration::from_secs(2),
    );
    let lines = tracer.lines();
    let arrived: u64 = roomy
        .iter()
        .map(|s| received.get(s).copied().unwrap_or(0))
        .sum();
    assert!(arrived > 1000, "the flood arrived: {arrived}");
    assert!(
        lines.iter().all(|l| l["verdict"] == "passed"),
        "passes only"
    );
    let held_passes = lines.iter().filter(|l| l["rule"] == "held").count();
    assert!(held_passes <= 5, "198.18.0.9 passed only its burst");
    let expected = arrived as f64 / 4.0;
    let sd = (arrived as f64 * 0.25 * 0.75).sqrt();
    let got = (lines.len() - held_passes) as f64;
    assert!(
        (got - expected).abs() <= 5.0 * sd,
        "sampled {got} of {arrived} passes, expected {expected:.0} ± {:.0}",
        5.0 * sd
    );
    running.stop().expect("limiter run stops cleanly");
}

/// Through the daemon: the same lines, streamed over its control socket,
/// and the trace logged as events; once the daemon is gone, from its pins.
#[test]
fn trace_through_the_daemon() {
    let lab = Lab::create("lt-trace-daemon").expect("lab");
    let mut daemon = Daemon::start(&lab, "trace-daemon", &[RX_IFACE], RULES).expect("daemon");
    let socket = daemon.socket.to_string_lossy().into_owned();
    let tracer = Tracer::start(
        &lab,
        &[
            "--socket",
            &socket,
            "--rule",
            "held",
            "--verdict",
            "dropped",
            "--count",
            "10",
            "--duration",
            "15s",
        ],
    );
    let flooding = sources(
        &lab,
        0,
        &[v4(0, 1), IpAddr::V4(Ipv4Addr::new(198, 19, 0, 1))],
        40,
        32,
    );
    let (_, received) = flood(&lab, &flooding, Duration::from_secs(1));
    let lines = tracer.lines();
    assert!(received.get(&v4(0, 1)).copied() == Some(5), "{received:?}");
    assert_eq!(lines.len(), 10, "{lines:#?}");
    for line in &lines {
        assert_eq!(line["rule"], "held", "{line}");
        assert_eq!(line["verdict"], "dropped", "{line}");
        assert_eq!(line["refused_by"], "key packets", "{line}");
        assert_eq!(line["interface"], RX_IFACE);
    }
    // The daemon logged the trace's start and end.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !daemon.log().contains("the client stopped tracing") {
        assert!(Instant::now() < deadline, "{}", daemon.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(daemon.log().contains("tracing for a client"));
    // A bad filter is refused before anything is traced.
    let wrong = daemon.cli(&["trace", "--rule", "nope"]);
    let said = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        !wrong.status.success() && said.contains("no such rule") && said.contains("held"),
        "{said}"
    );
    // The daemon gone (`kill -9`), its program enforces on (its link is
    // pinned), and so does its trace program: a trace from the pins runs.
    daemon.kill9();
    let pins = daemon.pin_dir.to_string_lossy().into_owned();
    let tracer = Tracer::start(
        &lab,
        &[
            "--pin-dir",
            &pins,
            "--socket",
            "/nonexistent/control.sock",
            "--count",
            "3",
            "--duration",
            "15s",
        ],
    );
    flood(
        &lab,
        &sources(&lab, 0, &[v4(0, 7)], 40, 32),
        Duration::from_secs(1),
    );
    assert_eq!(tracer.lines().len(), 3, "traced without the daemon");
}

/// Every verdict and cause as the kernel decided it, on crafted frames
/// through BPF_PROG_TEST_RUN (tail calls included): passes and drops by
/// the key's packet and byte meters and by the aggregate, a dry run's
/// excess, a manual block, `default: drop`, a malformed frame, a tiny
/// fragment, an IPv6 source; and a frame the filter leaves out is not
/// traced.
#[test]
fn every_verdict_and_cause_is_traced_as_decided() {
    use limiter::kernel::trace::KernelTracer;
    use limiter_tests::{frames, loaded};
    let mut dp = loaded(
        "default: drop
rules:
  - { name: held, match: { source: 198.18.0.0/16 }, key: source, limit: { rate: 1, unit: minute, burst: 2 } }
  - { name: bytes, match: { source: 198.20.0.0/16 }, key: source, limit: { bytes: 100, unit: minute } }
  - { name: dry, match: { source: 198.19.128.0/24 }, key: source, limit: { rate: 1, unit: minute, burst: 1 }, action: shadow }
  - { name: shared, match: { source: 198.21.0.0/16 }, key: source, limit: { rate: 100, unit: second, burst: 100 }, aggregate: { rate: 1, unit: minute, burst: 1 } }
  - { name: v6, match: { source: \"2001:db8::/32\" }, key: source, limit: { rate: 1, unit: minute, burst: 1 } }
",
    );
    dp.engine
        .block("198.18.9.9/32".parse().unwrap(), None)
        .expect("blocking");
    let filter = limiter::trace::TraceFilter {
        source: None,
        ..Default::default()
    };
    let mut tracer = KernelTracer::start(dp.pin_dir(), &filter).expect("tracing");
    let run = |dp: &limiter_tests::Loaded, frame: &[u8]| limiter_tests::verdict(dp, frame);
    let v4 = |a, b, c, d| std::net::Ipv4Addr::new(a, b, c, d);
    let mut expected: Vec<(&str, &str, Option<&str>, Option<&str>)> = Vec::new();
    let mut send = |dp: &limiter_tests::Loaded,
                    frame: Vec<u8>,
                    line: (
        &'static str,
        &'static str,
        Option<&'static str>,
        Option<&'static str>,
    )| {
        let verdict = run(dp, &frame);
        let dropped = matches!(line.1, "dropped" | "blocked")
            || (line.1 == "malformed" && line.2 == Some("tiny fragment"));
        let want = if dropped {
            limiter_tests::XDP_DROP
        } else {
            limiter_tests::XDP_PASS
        };
        assert_eq!(verdict, want, "{line:?}");
        expected.push(line);
    };
    let udp = |a, b, c, d| frames::udp4(v4(a, b, c, d), 53, 20);
    let tiny = frames::ipv4_fragment(&udp(198, 18, 0, 3), true, 0);
    let whole = udp(198, 18, 0, 4);
    let v6 = frames::udp6("2001:db8::1".parse().unwrap(), 53, 20);
    let held = ("198.18.0.1", "passed", None, Some("held"));
    let sent = [
        (udp(198, 18, 0, 1), held),
        (udp(198, 18, 0, 1), held),
        (
            udp(198, 18, 0, 1),
            ("198.18.0.1", "dropped", Some("key packets"), Some("held")),
        ),
        (
            udp(198, 20, 0, 1),
            ("198.20.0.1", "passed", None, Some("bytes")),
        ),
        (
            udp(198, 20, 0, 1),
            ("198.20.0.1", "dropped", Some("key bytes"), Some("bytes")),
        ),
        (
            udp(198, 19, 128, 1),
            ("198.19.128.1", "passed", None, Some("dry")),
        ),
        (
            udp(198, 19, 128, 1),
            ("198.19.128.1", "shadow", Some("key packets"), Some("dry")),
        ),
        (
            udp(198, 21, 0, 1),
            ("198.21.0.1", "passed", None, Some("shared")),
        ),
        (
            udp(198, 21, 0, 2),
            (
                "198.21.0.2",
                "dropped",
                Some("aggregate packets"),
                Some("shared"),
            ),
        ),
        (
            udp(198, 18, 9, 9),
            (
                "198.18.9.9",
                "blocked",
                Some("block (limiter block or escalation)"),
                None,
            ),
        ),
        (
            udp(10, 0, 0, 1),
            (
                "10.0.0.1",
                "dropped",
                Some("rule action block"),
                Some("default"),
            ),
        ),
        (v6.clone(), ("2001:db8::1", "passed", None, Some("v6"))),
        (
            v6,
            ("2001:db8::1", "dropped", Some("key packets"), Some("v6")),
        ),
        (
            tiny[..frames::L3 + 20 + 4].to_vec(),
            ("198.18.0.3", "malformed", Some("tiny fragment"), None),
        ),
        (
            whole[..frames::L3 + 10].to_vec(),
            ("-", "malformed", None, None),
        ),
    ];
    for (frame, line) in sent {
        send(&dp, frame, line);
    }
    let mut lines = Vec::new();
    while let Some(line) = tracer.next_line() {
        lines.push(line);
    }
    assert_eq!(lines.len(), expected.len(), "{lines:#?}");
    for (line, (source, verdict, refused_by, rule)) in lines.iter().zip(&expected) {
        let shown = line.source.map_or("-".to_owned(), |s| s.to_string());
        assert_eq!(shown, *source, "{line:?}");
        assert_eq!(line.verdict, *verdict, "{line:?}");
        assert_eq!(line.refused_by.as_deref(), *refused_by, "{line:?}");
        if let Some(rule) = rule {
            assert_eq!(line.rule, *rule, "{line:?}");
        }
        assert_eq!(line.layer, "xdp");
    }
    // What is left: the aggregate's refusal shows the aggregate spent.
    let aggregate = &lines[8];
    assert!(
        aggregate
            .left
            .iter()
            .any(|l| l.meter == "aggregate packets" && l.left == 0 && l.of == 1),
        "{aggregate:?}"
    );
    // A filter leaves out what it does not name.
    drop(tracer);
    let only_blocked = limiter::trace::TraceFilter {
        verdicts: vec!["blocked".into()],
        ..Default::default()
    };
    let mut tracer = KernelTracer::start(dp.pin_dir(), &only_blocked).expect("tracing");
    run(&dp, &frames::udp4(v4(198, 18, 0, 1), 53, 20));
    run(&dp, &frames::udp4(v4(198, 18, 9, 9), 53, 20));
    let first = tracer.next_line().expect("the blocked frame");
    assert_eq!(first.verdict, "blocked");
    assert!(tracer.next_line().is_none(), "only the blocked frame");
    assert_eq!(tracer.counts().unwrap(), [1, 0], "one sent, none lost");
}
