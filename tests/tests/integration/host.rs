//! The limiter on its host, as an attacker with a local account or a
//! connection would probe it: state directories another user could
//! change, the capabilities it keeps, its systemd unit, its listeners
//! under connection abuse, and the metrics format a scraper asks for.

use std::{
    fs,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    os::unix::{
        fs::{PermissionsExt, chown},
        net::UnixStream,
        process::ExitStatusExt,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{
    Daemon, RunningLimiter, TempDir, assert_close, flood, http_request, limiter_bin, ok, sources,
    xdp_attached,
};

const RULES: &str = "rules:
  - { name: held, match: { source: 198.18.0.0/16 }, limit: { rate: 100, unit: second, burst: 200 } }
";

/// A pin directory below bpffs, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let path = PathBuf::from(format!(
            "/sys/fs/bpf/limiter-test-{name}-{}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&path);
        limiter::kernel::pins::ensure_bpffs().expect("bpffs");
        Self(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = limiter::kernel::detach_all(&self.0);
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o7777
}

/// Guards the pins against another local user: a pin directory someone
/// else created (who could unpin the maps of the running limiter), one
/// that others can write, or one below a directory others can write is
/// refused before anything is read or pinned there, and nothing attaches;
/// so is one of ours whose mode is not 0700; a missing one is made 0700.
#[test]
fn pin_directories_other_users_could_change_are_refused() {
    let lab = Lab::create("lt-pins").expect("lab");
    let dir = TempDir::new("pins");
    let config = dir.write("rules.yaml", RULES);
    let start = |pins: &Path, log: &str| {
        RunningLimiter::start(lab.rx.name(), &[RX_IFACE], &config, pins, dir.0.join(log))
    };
    let refused = |pins: &Path, log: &str, reason: &str| {
        let error = match start(pins, log) {
            Ok(_) => panic!("{} was accepted", pins.display()),
            Err(e) => format!("{e:#}"),
        };
        assert!(error.contains(reason), "{error}");
        assert!(!xdp_attached(lab.rx.name(), RX_IFACE), "attached anyway");
    };

    let owned = Scratch::new("owned");
    fs::create_dir(&owned.0).unwrap();
    chown(&owned.0, Some(65534), Some(65534)).unwrap();
    refused(&owned.0, "owned.log", "owned by uid 65534");

    let open = Scratch::new("open");
    fs::create_dir(&open.0).unwrap();
    fs::set_permissions(&open.0, fs::Permissions::from_mode(0o777)).unwrap();
    refused(&open.0, "open.log", "mode 0777");

    let parent = Scratch::new("parent");
    fs::create_dir(&parent.0).unwrap();
    fs::set_permissions(&parent.0, fs::Permissions::from_mode(0o777)).unwrap();
    refused(
        &parent.0.join("pins"),
        "parent.log",
        "can be changed by another user",
    );

    let ours = Scratch::new("ours");
    fs::create_dir(&ours.0).unwrap();
    fs::set_permissions(&ours.0, fs::Permissions::from_mode(0o755)).unwrap();
    refused(&ours.0, "ours.log", "mode 0755, not 0700");
    let made = Scratch::new("made");
    let running = start(&made.0, "made.log").expect("a directory it makes");
    assert_eq!(mode(&made.0), 0o700);
    running.stop().expect("stop");
}

/// The capabilities `dist/limiter.service` bounds the service to, of those
/// this machine grants at all (a container may lack some, such as
/// CAP_SYS_RESOURCE).
fn unit_capabilities() -> Vec<String> {
    let granted = capability_mask(std::process::id(), "CapBnd");
    let unit =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/limiter.service"))
            .expect("the unit");
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet in the unit");
    line.split_whitespace()
        .map(str::to_owned)
        .filter(|name| granted & mask_of(std::slice::from_ref(name)) != 0)
        .collect()
}

/// A process's capability set `set` (`CapEff`, `CapBnd`, ...) as a mask,
/// the same in every thread (capabilities belong to threads: one left
/// with more would be asserted here).
fn capability_mask(pid: u32, set: &str) -> u64 {
    let masks: Vec<u64> = fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .map(|task| task_capability_mask(&task.unwrap().path().join("status"), set))
        .collect();
    assert!(
        masks.iter().all(|&m| m == masks[0]),
        "{set} differs between threads: {masks:x?}"
    );
    masks[0]
}

fn task_capability_mask(status: &Path, set: &str) -> u64 {
    let status = fs::read_to_string(status).expect("status");
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{set}:")))
        .expect("the set");
    u64::from_str_radix(hex.trim(), 16).expect("hex")
}

fn mask_of(names: &[String]) -> u64 {
    names
        .iter()
        .map(|name| {
            let cap: caps::Capability = name.parse().expect("a capability name");
            1u64 << cap.index()
        })
        .fold(0, |a, b| a | b)
}

/// Everything a daemon does after it starts, on real traffic: a flood held
/// to its limit, a rule file applied, a block, a scrape, and detach.
fn exercise(lab: &Lab, daemon: &mut Daemon, tag: u8) {
    let addrs = vec![std::net::IpAddr::V4(std::net::Ipv4Addr::new(
        198, 18, tag, 1,
    ))];
    let (report, received) = flood(
        lab,
        &sources(lab, 0, &addrs, 1000, 64),
        Duration::from_secs(1),
    );
    assert_close(
        received[&addrs[0]],
        200.0 + 100.0 * report.elapsed.as_secs_f64(),
        10.0,
        "a flood held by the daemon",
    );
    let rules = daemon.dir.write(
        "second.yaml",
        "rules:\n  - { name: other, match: { source: 198.19.0.0/16 }, limit: { rate: 5, unit: second } }\n",
    );
    ok(daemon.cli(&["rules", "apply", &rules.to_string_lossy()]));
    ok(daemon.cli(&["block", "198.51.100.0/24", "--for", "1m"]));
    let (head, _) = http_request(&lab.rx, daemon.metrics_port, "/metrics", "").expect("scrape");
    assert!(
        head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
        "{head}"
    );
    let out = ok(daemon.cli(&["detach"]));
    assert!(out.contains("detached from veth-rx"), "{out}");
    assert!(
        daemon.wait_exit().expect("exit").success(),
        "{}",
        daemon.log()
    );
    assert!(!xdp_attached(lab.rx.name(), RX_IFACE));
}

/// Guards least privilege: a daemon started as full root keeps only the
/// capabilities the unit names (effective, permitted and bounding sets),
/// and still does all its work with them.
#[test]
fn the_daemon_keeps_only_the_capabilities_it_needs() {
    let needed = mask_of(&unit_capabilities());
    let lab = Lab::create("lt-caps").expect("lab");
    let mut daemon = Daemon::start(&lab, "caps", &[RX_IFACE], RULES).expect("daemon");
    let pid = daemon.pid().expect("pid");
    // Serving: past the drop, and every thread of the runtime started.
    ok(daemon.cli(&["rules", "show"]));
    assert!(
        daemon.log().contains("running with CAP_BPF"),
        "{}",
        daemon.log()
    );
    assert!(fs::read_dir(format!("/proc/{pid}/task")).unwrap().count() >= 3);
    for set in ["CapEff", "CapPrm", "CapBnd"] {
        assert_eq!(
            capability_mask(pid, set),
            needed,
            "{set} of the running daemon:\n{}",
            daemon.log()
        );
    }
    assert_eq!(capability_mask(pid, "CapInh"), 0);
    exercise(&lab, &mut daemon, 1);
}

/// Guards the unit's capability set: the daemon starts and works with no
/// capability but those `dist/limiter.service` leaves it (as systemd would
/// run it; this machine has no systemd to run the unit itself).
#[test]
fn the_daemon_works_within_the_units_capabilities() {
    let names = unit_capabilities();
    let bounding = std::iter::once("-all".to_owned())
        .chain(
            names
                .iter()
                .map(|n| format!("+{}", n.trim_start_matches("CAP_").to_lowercase())),
        )
        .collect::<Vec<_>>()
        .join(",");
    let wrapper = [
        "setpriv".to_owned(),
        "--bounding-set".to_owned(),
        bounding,
        "--inh-caps=-all".to_owned(),
    ];
    let lab = Lab::create("lt-unitcaps").expect("lab");
    let mut daemon =
        Daemon::start_with(&lab, "unitcaps", &[RX_IFACE], RULES, "", &wrapper).expect("daemon");
    ok(daemon.cli(&["rules", "show"]));
    assert_eq!(
        capability_mask(daemon.pid().unwrap(), "CapBnd"),
        mask_of(&names)
    );
    exercise(&lab, &mut daemon, 2);
}

/// Guards the unit's hardening: `systemd-analyze security` rates it, and a
/// unit that loses its sandboxing fails here (the README quotes the score).
#[test]
fn the_systemd_unit_is_sandboxed() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/limiter.service");
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze (cargo xtask setup installs systemd)");
    let text = String::from_utf8_lossy(&out.stdout);
    let score: f64 = text
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for limiter.service: ")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no score in:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(
        score <= 2.0,
        "exposure {score} (the README says 2.0):\n{text}"
    );
}

/// Guards the listeners against connection abuse: past the cap a client is
/// told so at once; a connection that sends nothing (or half a request) is
/// closed at the deadline, on the metrics endpoint and the control socket;
/// a rejected 10 MB value is not echoed back whole.
#[test]
fn listeners_cap_connections_and_close_idle_ones() {
    let lab = Lab::create("lt-listen").expect("lab");
    let extra = "metrics_listener: { max_connections: 3, header_timeout: 2s }\n\
                 control_listener: { max_connections: 2, header_timeout: 2s }\n";
    let daemon =
        Daemon::start_with(&lab, "listen", &[RX_IFACE], RULES, extra, &[]).expect("daemon");
    let port = daemon.metrics_port;

    // Metrics: three idle connections (one with half a request line) hold
    // every slot; a fourth is refused with 503; the three are closed
    // after the header deadline; then scrapes work again.
    let idle: Vec<TcpStream> = lab
        .rx
        .enter(move || {
            (0..3)
                .map(|i| {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
                    if i == 0 {
                        s.write_all(b"GET /metr").unwrap();
                    }
                    s
                })
                .collect()
        })
        .expect("netns");
    std::thread::sleep(Duration::from_millis(200));
    // (It is answered before it says anything.)
    let refused = lab
        .rx
        .enter(move || {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
            answer
        })
        .expect("netns");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    for mut stream in idle {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut rest = Vec::new();
        // Closed by the server (EOF), not by our read timeout.
        let read = stream.read_to_end(&mut rest);
        assert!(
            read.is_ok(),
            "an idle metrics connection stayed open: {read:?}"
        );
    }
    let (head, _) = http_request(&lab.rx, port, "/metrics", "").expect("scrape");
    assert!(head.contains(" 200 "), "{head}");

    // Control socket: two idle connections fill it; a third is told so.
    let idle: Vec<UnixStream> = (0..2)
        .map(|_| UnixStream::connect(&daemon.socket).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut answer = String::new();
    BufReader::new(UnixStream::connect(&daemon.socket).unwrap())
        .read_line(&mut answer)
        .unwrap();
    assert!(
        answer.contains("serving 2 control connections already"),
        "{answer}"
    );
    for stream in idle {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut answer = String::new();
        let mut reader = BufReader::new(stream);
        reader
            .read_line(&mut answer)
            .expect("an answer before the close");
        assert!(answer.contains("no complete request within 2s"), "{answer}");
        let mut rest = String::new();
        assert_eq!(reader.read_line(&mut rest).expect("EOF"), 0, "still open");
    }
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    let mut request = b"{\"command\":\"block\",\"prefix\":\"".to_vec();
    request.extend(std::iter::repeat_n(b'x', 3 << 20));
    request.extend(b"\"}\n");
    stream.write_all(&request).unwrap();
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).unwrap();
    assert!(
        answer.contains("not an address prefix") && answer.len() < 1000,
        "{} bytes",
        answer.len()
    );
    // A duration whose end is past the u64 clock: refused, not wrapped
    // into a block that ends at once (or a panic under the engine lock).
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    stream
        .write_all(
            b"{\"command\":\"block\",\"prefix\":\"198.51.100.0/24\",\"for_secs\":18446744073}\n",
        )
        .unwrap();
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).unwrap();
    assert!(answer.contains("at most 500 years"), "{answer}");
    let view = ok(daemon.cli(&["rules", "show", "--json"]));
    assert!(view.contains("\"blocks\":[]"), "{view}");
}

/// Samples of an exposition through `promtool check metrics`: Prometheus's
/// own parser and linter of the classic text format.
fn promtool_check(text: &str) {
    let out = limiter_tests::piped(Command::new("promtool").args(["check", "metrics"]), text);
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Guards the format negotiation: what curl gets (no Accept) is the
/// classic text format and passes `promtool check metrics`; OpenMetrics
/// comes when asked for, as Prometheus asks.
#[test]
fn metrics_come_in_the_format_the_scraper_asks_for() {
    let lab = Lab::create("lt-format").expect("lab");
    let daemon = Daemon::start(&lab, "format", &[RX_IFACE], RULES).expect("daemon");
    let (head, body) = http_request(&lab.rx, daemon.metrics_port, "/metrics", "").expect("scrape");
    assert!(
        head.to_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(
        !body.contains("# EOF") && body.contains("limiter_build_info{"),
        "{body}"
    );
    promtool_check(&body);
    let prometheus = "Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2\r\n";
    let (head, body) =
        http_request(&lab.rx, daemon.metrics_port, "/metrics", prometheus).expect("scrape");
    assert!(
        head.to_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
}

/// Guards the CLI in a pipeline: a reader that goes away ends it by
/// SIGPIPE, as it ends other tools, not with a panic and a backtrace.
#[test]
fn a_closed_pipe_ends_the_cli_quietly() {
    let mut fds = [0; 2];
    // SAFETY: a pipe whose read end we close at once.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    unsafe { libc::close(fds[0]) };
    // SAFETY: the write end is ours, handed to the child.
    let stdout = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[1]) };
    let out = Command::new(limiter_bin())
        .args(["check", "--config"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/rules.yaml"))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::piped())
        .output()
        .expect("limiter");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {stderr}",
        out.status
    );
}

/// Guards the write deadline: a client that sends requests and never reads
/// the answers (its window full) holds its connection only until the write
/// timeout; then the one slot is free and a scrape is served (before, it
/// got 503 for as long as the reader stayed).
#[test]
fn a_client_that_stops_reading_loses_its_connection() {
    let lab = Lab::create("lt-reader").expect("lab");
    let extra = "metrics_listener: { max_connections: 1, write_timeout: 1s }\n";
    let daemon =
        Daemon::start_with(&lab, "reader", &[RX_IFACE], RULES, extra, &[]).expect("daemon");
    let port = daemon.metrics_port;
    let reader = lab
        .rx
        .enter(move || {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
            stream
                .set_write_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            let request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(5000);
            // It may stop taking requests before they are all sent.
            let _ = stream.write_all(request.as_bytes());
            stream
        })
        .expect("netns");
    // It is served until the buffers between them fill (thousands of
    // answers), then cut off a second later: the slot comes back.
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let served = loop {
        std::thread::sleep(Duration::from_secs(1));
        match http_request(&lab.rx, port, "/metrics", "") {
            Ok((head, _)) if head.contains(" 200 ") => break true,
            _ if std::time::Instant::now() > deadline => break false,
            _ => {}
        }
    };
    assert!(served, "the reader still holds the only slot after 40 s");
    drop(reader);
}

/// Guards `limiter detach` against a daemon it cannot reach: given another
/// socket than the daemon's, it refuses (the daemon holds the pins and
/// would pin again what was removed under it) and the program stays
/// attached with its pins (before, it detached and removed them).
#[test]
fn detach_refuses_while_another_daemon_holds_the_pins() {
    let lab = Lab::create("lt-detach2").expect("lab");
    let daemon = Daemon::start(&lab, "detach2", &[RX_IFACE], RULES).expect("daemon");
    let pins = daemon.pin_dir.to_string_lossy().into_owned();
    let out = limiter_tests::limiter_command(
        None,
        &[
            "detach",
            "--pin-dir",
            &pins,
            "--socket",
            "/run/limiter-test-no-such.sock",
        ],
    )
    .output()
    .expect("limiter");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "detached: {stderr}");
    assert!(stderr.contains("detach through its socket"), "{stderr}");
    assert!(xdp_attached(lab.rx.name(), RX_IFACE));
    assert!(daemon.pin_dir.join("CONFIG").exists());
    assert!(ok(daemon.cli(&["rules", "show"])).contains("held"));
}

/// Guards `limiter run --log-format json`: its log lines (stderr) are JSON
/// objects, the rules it applied an event with their fields; its summary
/// lines (stdout) stay text.
#[test]
fn run_logs_json_events() {
    let lab = Lab::create("lt-runjson").expect("lab");
    let dir = TempDir::new("runjson");
    let config = dir.write("rules.yaml", RULES);
    let running = RunningLimiter::start_with(
        lab.rx.name(),
        &[RX_IFACE],
        &config,
        Path::new("/sys/fs/bpf/limiter-test-runjson"),
        dir.0.join("run.log"),
        &["--log-format", "json"],
    )
    .expect("limiter run");
    let output = running.output();
    let events: Vec<serde_json::Value> = output
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let applied = events
        .iter()
        .find(|e| e["event"] == "rules_applied")
        .unwrap_or_else(|| panic!("no rules_applied event in {output}"));
    assert!(
        applied["added"]
            .as_str()
            .is_some_and(|a| a.starts_with('[')),
        "{applied}"
    );
    assert_eq!(applied["level"], "INFO");
    assert!(output.contains("limiter: enforcing"), "{output}");
}
