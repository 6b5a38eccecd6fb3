//! The kernel's rare events in the logs (aya-log, drained by the process
//! that loaded the program): a new source the key table has no slot for
//! is reported with its rule and address, at most once a second per CPU,
//! with how many were left out since. Through BPF_PROG_TEST_RUN with the
//! clock under the test's control, and on real traffic through `limiter
//! run`, whose log is read as an operator reads it.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    sync::Mutex,
    thread,
    time::{Duration, Instant},
};

use limiter::lab::Lab;
use limiter_tests::{
    RunningLimiter, TempDir, XDP_DROP, XDP_PASS, flood, frames, loaded_object, pin_to_cpu, run_at,
    sources, test_clock_object,
};

/// One bucket of 8 slots, key creations unbounded, one packet an hour.
const ONE_BUCKET: &str = "max_keys: 8
new_keys: { rate: 1000000, unit: second, burst: 1000000 }
rules:
  - { name: hourly, match: { source: 198.18.0.0/16 }, limit: { rate: 1, unit: hour, burst: 1 } }
";

const SECOND: u64 = 1_000_000_000;
/// Far from 0, where the report program's "never reported" is.
const T0: u64 = 1_000 * SECOND;

/// The warnings this process logged (the `log` records aya-log makes).
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            LOGGED
                .lock()
                .expect("log lock")
                .push(record.args().to_string());
        }
    }

    fn flush(&self) {}
}

/// The lines logged so far that report a full key table.
fn key_table_reports() -> Vec<String> {
    LOGGED
        .lock()
        .expect("log lock")
        .iter()
        .filter(|line| line.starts_with("key table full"))
        .cloned()
        .collect()
}

/// Waits until `n` reports of a full key table were logged (the drain
/// wakes every 250 ms), then a little longer for any that should not be.
fn await_reports(n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while key_table_reports().len() < n && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    thread::sleep(Duration::from_millis(600));
    key_table_reports()
}

#[test]
fn a_full_key_table_is_reported_once_a_second_with_what_was_left_out() {
    log::set_logger(&Capture).expect("the test's logger");
    log::set_max_level(log::LevelFilter::Warn);
    // Per-CPU state: every run of the program on one CPU.
    pin_to_cpu(0).expect("pinning to CPU 0");
    let mut dp = loaded_object(&test_clock_object(), ONE_BUCKET);
    dp.engine.datapath_mut().log_reports();
    let send = |dp: &mut _, n: u8, t: u64| {
        run_at(dp, &frames::udp4(Ipv4Addr::new(198, 18, 0, n), 9, 0), t)
    };
    // Eight sources take the eight slots, each in debt for an hour.
    for n in 1..=8 {
        assert_eq!(send(&mut dp, n, T0 + u64::from(n)), XDP_PASS);
    }
    assert!(await_reports(0).is_empty(), "nothing to report yet");

    // The ninth has no slot: reported, with its address and rule.
    assert_eq!(send(&mut dp, 9, T0 + 10), XDP_DROP);
    let reports = await_reports(1);
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert!(
        reports[0].contains("198.18.0.9")
            && reports[0].contains("of rule ")
            && reports[0].contains("; 0 more"),
        "{}",
        reports[0]
    );

    // 41 more within the same second: counted, not logged.
    for n in 10..=50 {
        assert_eq!(send(&mut dp, n, T0 + 20 + u64::from(n)), XDP_DROP);
    }
    assert_eq!(await_reports(2).len(), 1, "a report within the second");

    // A second on: the next is reported, with the 41 left out.
    assert_eq!(send(&mut dp, 51, T0 + 10 + SECOND), XDP_DROP);
    let reports = await_reports(2);
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert!(
        reports[1].contains("198.18.0.51") && reports[1].contains("; 41 more"),
        "{}",
        reports[1]
    );
    assert_eq!(
        limiter_tests::snapshot(&dp).global.key_alloc_failed,
        43,
        "every refusal counted"
    );
}

/// `limiter run` on a veth pair: 40 sources at once against a table of 8
/// slots. The receiver sees the first packet of at most 8 of them (one an
/// hour each), and the limiter's log says why the others got nothing,
/// at most once a second on each CPU.
#[test]
fn a_full_key_table_shows_in_the_log_of_limiter_run() {
    let lab = Lab::create("lt-reports").expect("lab");
    let dir = TempDir::new("reports");
    let config = dir.write("rules.yaml", ONE_BUCKET);
    let pin_dir = Path::new("/sys/fs/bpf/limiter-test-reports");
    let running = RunningLimiter::on_receiver(&lab, &dir, &config, pin_dir).expect("limiter run");
    let addrs: Vec<IpAddr> = (1..=40)
        .map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, 1, i)))
        .collect();
    let duration = Duration::from_secs(3);
    let (report, received) = flood(&lab, &sources(&lab, 0, &addrs, 200, 64), duration);
    let arrived: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| received.get(a).copied().unwrap_or(0) > 0)
        .collect();
    assert!(
        !arrived.is_empty() && arrived.len() <= 8,
        "sources that got a packet through a table of 8 slots: {arrived:?}"
    );
    assert!(
        report.sent.iter().all(|&n| n > 100),
        "every source flooded: {:?}",
        report.sent
    );
    thread::sleep(Duration::from_millis(600));
    let log = running.stop().expect("limiter run stops cleanly");
    let reports: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("key table full: no slot for a new key of rule"))
        .collect();
    println!("{}", reports.join("\n"));
    let cpus = thread::available_parallelism().map_or(1, usize::from);
    let seconds = report.elapsed.as_secs_f64().ceil() as usize + 1;
    assert!(
        !reports.is_empty() && reports.len() <= seconds * cpus,
        "{} reports of a full table (at most one a second on each of {cpus} CPUs):\n{log}",
        reports.len()
    );
    assert!(
        reports
            .iter()
            .all(|l| l.contains("WARN") && l.contains("198.18.1.")),
        "{reports:?}"
    );
}
