//! Every input the limiter takes from outside, fuzzed: the rule file (and
//! what is done with an accepted one: the kernel's tables and the layer-7
//! limiter), the daemon's configuration, an envoy configuration for the
//! import, and the control protocol. Each case is random bytes or a real
//! file mutated with YAML's and JSON's own syntax. No case may panic or
//! hang (each finishes; the suite is bounded in time), and inputs past
//! the size and depth caps are refused before parsing.
//!
//! `PROPTEST_CASES` sets the number of cases: 256 in `cargo xtask test`,
//! 20,000 in `cargo xtask fuzz`.

use std::{io::Read, net::Ipv4Addr, path::Path, sync::Arc};

use limiter::{
    control::{Request, Response, server},
    http::{Limiter, RequestMeta, SystemClock},
    rules::RuleSet,
};
use proptest::prelude::*;

const RULES: &str = include_str!("../../examples/rules.yaml");
const DAEMON: &str = include_str!("../../examples/daemon.yaml");
const ENVOY: &str = include_str!("../../examples/envoy-ratelimit.yaml");
const ENVOY_ROUTES: &str = include_str!("../../examples/envoy-routes.yaml");
const REQUESTS: [&str; 6] = [
    r#"{"command":"status"}"#,
    r#"{"command":"rules_apply","text":"rules: []","origin":"x.yaml"}"#,
    r#"{"command":"block","prefix":"198.18.0.0/24","for_secs":600}"#,
    r#"{"command":"unblock","prefix":"2001:db8::/32"}"#,
    r#"{"command":"shadow","rule":"web","on":true}"#,
    r#"{"command":"detach"}"#,
];

/// Pieces of YAML and JSON syntax, and values at the edges of what the
/// fields take.
const TOKENS: [&str; 40] = [
    "[",
    "]",
    "{",
    "}",
    ":",
    ": ",
    ",",
    "- ",
    "\n",
    "  ",
    "\t",
    "#",
    "'",
    "\"",
    "&a ",
    "*a",
    "!!str ",
    "? ",
    "|\n",
    ">-\n",
    "~",
    "null",
    "0",
    "-1",
    "1e999",
    "18446744073709551616",
    "4294967296",
    "0.5",
    "nan",
    "::",
    "/",
    "10.0.0.0/33",
    "source/129",
    "unlimited",
    "gcra",
    "sliding_log",
    "\u{0}",
    "\u{feff}",
    "é",
    "\\u0000",
];

/// A mutation: at a position (a fraction of the length), delete a span,
/// insert a token, duplicate a span, or put a random byte.
#[derive(Clone, Debug)]
enum Mutation {
    Delete(f64, usize),
    Insert(f64, usize),
    Duplicate(f64, usize),
    Byte(f64, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0..1.0, 1usize..40).prop_map(|(at, n)| Mutation::Delete(at, n)),
        (0.0..1.0, 0..TOKENS.len()).prop_map(|(at, t)| Mutation::Insert(at, t)),
        (0.0..1.0, 1usize..200).prop_map(|(at, n)| Mutation::Duplicate(at, n)),
        (0.0..1.0, any::<u8>()).prop_map(|(at, b)| Mutation::Byte(at, b)),
    ]
}

fn apply(seed: &str, mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = seed.as_bytes().to_vec();
    for m in mutations {
        let at = |f: f64, len: usize| ((f * len as f64) as usize).min(len);
        match *m {
            Mutation::Delete(f, n) => {
                let start = at(f, bytes.len());
                let end = (start + n).min(bytes.len());
                bytes.drain(start..end);
            }
            Mutation::Insert(f, t) => {
                let start = at(f, bytes.len());
                bytes.splice(start..start, TOKENS[t].bytes());
            }
            Mutation::Duplicate(f, n) => {
                let start = at(f, bytes.len());
                let end = (start + n).min(bytes.len());
                let span = bytes[start..end].to_vec();
                bytes.splice(end..end, span);
            }
            Mutation::Byte(f, b) => {
                if !bytes.is_empty() {
                    let i = at(f, bytes.len() - 1);
                    bytes[i] = b;
                }
            }
        }
    }
    bytes
}

/// A seed mutated, or random bytes.
fn input(seed: &'static str) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(mutation(), 1..12).prop_map(move |m| apply(seed, &m)),
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
}

/// Whatever the rule file, an accepted one compiles to the kernel's tables
/// and judges a request at layer 7.
fn use_rules(set: RuleSet) {
    let ids: Vec<u32> = (1..=set.rules.len() as u32).collect();
    let _ = limiter::compile::build(&set, &ids, 0);
    let limiter = Limiter::new(set, Arc::new(SystemClock));
    let _ = limiter.check(&RequestMeta {
        client: Ipv4Addr::new(198, 18, 0, 1).into(),
        port: Some(443),
        key: None,
        bytes: 100,
        http: None,
    });
}

proptest! {
    #[test]
    fn rule_files(bytes in input(RULES)) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(set) = RuleSet::parse(&text, Path::new("fuzz.yaml")) {
            use_rules(set);
        }
    }

    #[test]
    fn daemon_configurations(bytes in input(DAEMON)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = limiter::yaml::parse::<limiter::daemon::DaemonConfig>(&text, Path::new("daemon.yaml"));
    }

    /// An accepted envoy configuration converts to a rule file that the
    /// limiter itself accepts.
    #[test]
    fn envoy_imports(bytes in input(ENVOY)) {
        let text = String::from_utf8_lossy(&bytes);
        let routes = Some((ENVOY_ROUTES, Path::new("routes.yaml")));
        for routes in [None, routes] {
            if let Ok(conversion) = limiter::import::envoy_text(&text, Path::new("envoy.yaml"), routes) {
                let set = RuleSet::parse(&conversion.rules, Path::new("converted.yaml"));
                prop_assert!(set.is_ok(), "{:?}\n{}", set.err().map(|e| e.to_string()), conversion.rules);
            }
        }
    }

    /// The same with the route configuration mutated.
    #[test]
    fn envoy_route_imports(bytes in input(ENVOY_ROUTES)) {
        let text = String::from_utf8_lossy(&bytes);
        let routes = Some((text.as_ref(), Path::new("routes.yaml")));
        if let Ok(conversion) = limiter::import::envoy_text(ENVOY, Path::new("envoy.yaml"), routes) {
            let set = RuleSet::parse(&conversion.rules, Path::new("converted.yaml"));
            prop_assert!(set.is_ok(), "{:?}\n{}", set.err().map(|e| e.to_string()), conversion.rules);
        }
    }

    /// The control socket's side of the protocol: whatever arrives, each
    /// answer is a response, and the connection ends when the client's
    /// input does.
    #[test]
    fn control_requests(lines in prop::collection::vec(
        prop_oneof![
            4 => (0..REQUESTS.len(), prop::collection::vec(mutation(), 0..6))
                .prop_map(|(i, m)| apply(REQUESTS[i], &m)),
            1 => prop::collection::vec(any::<u8>(), 0..256),
        ],
        1..6,
    )) {
        let mut input = Vec::new();
        for line in &lines {
            input.extend(line);
            input.push(b'\n');
        }
        let started = std::time::Instant::now();
        let answers = serve(input);
        // The connection ends with the input, not at the 5 s deadline.
        prop_assert!(started.elapsed() < std::time::Duration::from_secs(4));
        for answer in answers.lines() {
            prop_assert!(serde_json::from_str::<Response>(answer).is_ok(), "{answer}");
        }
        // One answer a line, up to the line that ends the connection: one
        // that is not UTF-8, or `detach`. (Lines may hold newlines of their
        // own: the protocol splits the bytes, not the cases.)
        let mut expected = 0;
        for line in input_lines(&lines) {
            expected += 1;
            let ends = match std::str::from_utf8(&line) {
                Err(_) => true,
                Ok(text) => serde_json::from_str::<Request>(text.trim_end_matches('\r'))
                    .is_ok_and(|r| r == Request::Detach),
            };
            if ends {
                break;
            }
        }
        prop_assert_eq!(answers.lines().count(), expected, "{}", answers);
    }
}

/// The lines the server reads from `lines` sent one after another, each
/// ended with a newline.
fn input_lines(lines: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for line in lines {
        all.extend(line);
        all.push(b'\n');
    }
    all.split(|&b| b == b'\n')
        .map(<[u8]>::to_vec)
        .collect::<Vec<_>>()
        .split_last()
        .map(|(_, lines)| lines.to_vec())
        .unwrap_or_default()
}

/// Runs one control connection over a socket pair with a handler that
/// answers every request it gets; returns what the client read.
fn serve(input: Vec<u8>) -> String {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    theirs.set_nonblocking(true).unwrap();
    let writer = std::thread::spawn({
        let mut ours = ours.try_clone().unwrap();
        move || {
            let _ = std::io::Write::write_all(&mut ours, &input);
            let _ = ours.shutdown(std::net::Shutdown::Write);
        }
    });
    runtime.block_on(async move {
        let stream = tokio::net::UnixStream::from_std(theirs).unwrap();
        server::serve_connection(
            stream,
            std::time::Duration::from_secs(5),
            |request: Request| async move { Response::ok(format!("{request:?}")) },
            |_| anyhow::bail!("no tracing here"),
        )
        .await;
    });
    writer.join().unwrap();
    let mut answers = String::new();
    let mut ours = ours;
    ours.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let _ = ours.read_to_string(&mut answers);
    answers
}

/// Guards the caps before parsing: a file over 4 MiB is refused unread
/// past the cap, and nesting past 32 levels is refused as it is read.
#[test]
fn oversized_and_deep_inputs_are_refused_before_they_cost_anything() {
    let huge = format!("rules: []\n#{}\n", "x".repeat(5 << 20));
    let error = RuleSet::parse(&huge, Path::new("huge.yaml"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("read only up to 4 MiB"), "{error}");
    let deep = format!("rules: {}{}\n", "[".repeat(40), "]".repeat(40));
    let error = RuleSet::parse(&deep, Path::new("deep.yaml"))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("deep") || error.contains("depth") || error.contains("recursion"),
        "{error}"
    );
}
