//! Faults under flood: the daemon killed (SIGKILL, from a crash point at
//! each step of a rule apply) while a source is flooded, then started
//! again. The kernel enforces throughout; the next daemon adopts a
//! consistent state: the rule file's rules in force, the flooded source's
//! bucket kept (no second burst, no gap), and the next apply works.
//! Arrivals are counted by nftables in the receiving namespace.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::unix::process::ExitStatusExt,
    thread,
    time::Duration,
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{Daemon, assert_within, flood, ok, sources};

const BEFORE: &str = "rules:
  - { name: flooded, match: { source: 198.18.0.0/16 }, limit: { rate: 100, unit: second, burst: 200 } }
  - { name: gone, match: { source: 198.19.0.0/16 }, limit: { rate: 100, unit: second } }
";

const AFTER: &str = "rules:
  - { name: flooded, match: { source: 198.18.0.0/16 }, limit: { rate: 100, unit: second, burst: 200 } }
  - { name: added, match: { source: 198.20.0.0/16 }, limit: { rate: 5, unit: second } }
";

fn names(view: &serde_json::Value) -> Vec<&str> {
    view["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .map(|r| r["name"].as_str().expect("name"))
        .collect()
}

/// Crashes at the `nth` time the daemon reaches `step` (its own apply at
/// start passes every step but the sweep, which has nothing to sweep).
fn crash_during_apply(step: &str, nth: u32, lab_name: &str) {
    let lab = Lab::create(lab_name).expect("lab");
    let crash = vec!["env".to_owned(), format!("LIMITER_CRASH_AT={step}:{nth}")];
    let mut daemon =
        Daemon::start_with(&lab, lab_name, &[RX_IFACE], BEFORE, "", &crash).expect("daemon");
    let id = |daemon: &Daemon| -> serde_json::Value {
        let view: serde_json::Value =
            serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
        view["rules"][0]["id"].clone()
    };
    let flooded_id = id(&daemon);
    // Keys of the rule the apply removes, for the sweep to find (two: a
    // crash after the first leaves one unswept).
    let gone = [
        IpAddr::V4(Ipv4Addr::new(198, 19, 0, 1)),
        IpAddr::V4(Ipv4Addr::new(198, 19, 0, 2)),
    ];
    flood(
        &lab,
        &sources(&lab, 0, &gone, 200, 64),
        Duration::from_millis(300),
    );
    let after = daemon.dir.write("after.yaml", AFTER);
    let addrs = [IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1))];
    let (report, received) = thread::scope(|scope| {
        let side = scope.spawn(|| {
            thread::sleep(Duration::from_secs(1));
            let out = daemon.cli(&["rules", "apply", &after.to_string_lossy()]);
            assert!(
                !out.status.success(),
                "the apply finished: no crash at {step} (is the binary built \
                 without the `faults` feature? `cargo xtask test` builds it with)"
            );
            let status = daemon.wait_exit().expect("the daemon exits");
            assert_eq!(status.signal(), Some(9), "{status}: {}", daemon.log());
            assert!(daemon.log().contains(&format!("crash point {step}")));
            thread::sleep(Duration::from_millis(500));
            daemon.set_wrapper(&[]);
            daemon.spawn().expect("a new daemon");
        });
        let result = flood(
            &lab,
            &sources(&lab, 0, &addrs, 1000, 64),
            Duration::from_secs(4),
        );
        side.join().expect("the apply and restart");
        result
    });
    // Enforced through the crash and the restart, from one bucket.
    assert_within(
        received[&addrs[0]],
        200.0 + 100.0 * report.elapsed.as_secs_f64(),
        5.0,
        &format!("the flooded source across a crash at {step}"),
    );
    // The rule file's rules, the flooded rule under the same id (its
    // buckets), and the next apply works.
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(names(&view), ["flooded", "gone"], "{view}");
    assert_eq!(id(&daemon), flooded_id);
    ok(daemon.cli(&["rules", "apply", &after.to_string_lossy()]));
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(names(&view), ["flooded", "added"], "{view}");
    assert_eq!(id(&daemon), flooded_id);
}

#[test]
fn a_crash_after_fresh_ids_are_reset() {
    crash_during_apply("reset", 2, "lt-crash-reset");
}

#[test]
fn a_crash_between_writing_a_generation_and_the_flip() {
    crash_during_apply("written", 2, "lt-crash-written");
}

#[test]
fn a_crash_after_the_flip_before_the_sweep() {
    crash_during_apply("flipped", 2, "lt-crash-flipped");
}

#[test]
fn a_crash_during_the_sweep() {
    crash_during_apply("sweeping", 1, "lt-crash-sweep");
}

/// Guards a limit change cut short: the daemon killed after the flooded
/// key's state was carried for a lower limit (its TAT moved to a spent
/// burst of 2 s) and before the flip. The old limit stays in force over
/// that conservative state: the source gets nothing until it lapses (about
/// 1 s, the 2 s debt less the old limit's 1 s burst), no fresh burst, then
/// the old rate; the next daemon keeps the rule and its keys. A state left
/// as it was would have passed 100 packets more.
#[test]
fn a_crash_while_a_lowered_limit_is_carried_leaves_no_burst() {
    const OLD: &str = "rules:
  - { name: flooded, match: { source: 198.18.0.0/16 }, limit: { rate: 100, unit: second, burst: 100 } }
";
    const LOWER: &str = "rules:
  - { name: flooded, match: { source: 198.18.0.0/16 }, limit: { rate: 20, unit: second, burst: 40 } }
";
    let lab = Lab::create("lt-crash-carry").expect("lab");
    let crash = vec!["env".to_owned(), "LIMITER_CRASH_AT=written:2".to_owned()];
    let mut daemon =
        Daemon::start_with(&lab, "crash-carry", &[RX_IFACE], OLD, "", &crash).expect("daemon");
    let lower = daemon.dir.write("lower.yaml", LOWER);
    let addrs = [IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1))];
    let start = std::time::Instant::now();
    let ((report, received), (asked, crashed)) = thread::scope(|scope| {
        let side = scope.spawn(|| {
            thread::sleep(Duration::from_secs(1));
            let asked = start.elapsed();
            let out = daemon.cli(&["rules", "apply", &lower.to_string_lossy()]);
            assert!(!out.status.success(), "the apply finished: no crash");
            let crashed = start.elapsed();
            let status = daemon.wait_exit().expect("the daemon exits");
            assert_eq!(status.signal(), Some(9), "{status}: {}", daemon.log());
            daemon.set_wrapper(&[]);
            daemon.spawn().expect("a new daemon");
            (asked, crashed)
        });
        let result = flood(
            &lab,
            &sources(&lab, 0, &addrs, 1000, 64),
            Duration::from_secs(6),
        );
        (result, side.join().expect("the apply and restart"))
    });
    // Carried somewhere between the ask and the crash: the old burst and
    // rate until then, nothing for the 1 s the carried debt exceeds the
    // old burst, then the old rate.
    let carried_at = (asked + crashed).as_secs_f64() / 2.0;
    let expected = 100.0 + 100.0 * (report.elapsed.as_secs_f64() - 1.0);
    assert_within(
        received[&addrs[0]],
        expected,
        5.0,
        &format!(
            "the flooded source, its lowered limit carried at {carried_at:.2} s then cut short"
        ),
    );
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(names(&view), ["flooded"], "{view}");
}

/// Runs `args` in the daemon's mount namespace.
fn in_mounts(pid: u32, args: &[&str]) -> std::process::Output {
    std::process::Command::new("nsenter")
        .arg(format!("--mount=/proc/{pid}/ns/mnt"))
        .args(args)
        .output()
        .expect("nsenter")
}

/// Guards the daemon against losing its pins: bpffs unmounted under it
/// (in a mount namespace of its own, with a bpffs of its own) while a
/// source is flooded. The program keeps enforcing (before, the pins were
/// the links' only reference: the links went with them, the program came
/// off the interface and the flood went through); the loss is reported;
/// once a bpffs is mounted again the maps and links are pinned again.
#[test]
fn bpffs_unmounted_under_the_daemon() {
    let lab = Lab::create("lt-unmount").expect("lab");
    let own_bpffs = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount -t bpf bpf /sys/fs/bpf && exec \"$0\" \"$@\"",
    ]
    .map(str::to_owned);
    let daemon =
        Daemon::start_with(&lab, "unmount", &[RX_IFACE], BEFORE, "", &own_bpffs).expect("daemon");
    let pid = daemon.pid().expect("pid");
    let pins = daemon.pin_dir.clone();
    let pinned = |path: &std::path::Path| {
        in_mounts(pid, &["test", "-e", &path.to_string_lossy()])
            .status
            .success()
    };
    assert!(pinned(&pins.join("CONFIG")) && pinned(&pins.join("links").join(RX_IFACE)));
    let addrs = [IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1))];
    let (report, received) = thread::scope(|scope| {
        let side = scope.spawn(|| {
            thread::sleep(Duration::from_secs(1));
            // Its own bpffs, then the host's beneath it (in its namespace
            // only): no bpffs left there.
            for _ in 0..2 {
                let out = in_mounts(pid, &["umount", "/sys/fs/bpf"]);
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let reported = (0..50).any(|_| {
                thread::sleep(Duration::from_millis(100));
                daemon.log().contains("are gone")
            });
            assert!(reported, "{}", daemon.log());
            assert!(
                !pinned(&pins.join("CONFIG")),
                "still pinned after the unmount"
            );
            assert!(
                limiter_tests::xdp_attached(lab.rx.name(), RX_IFACE),
                "detached"
            );
            assert!(daemon.log().contains("are gone"), "{}", daemon.log());
            let out = in_mounts(pid, &["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"]);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let repinned = (0..50).any(|_| {
                thread::sleep(Duration::from_millis(100));
                daemon.log().contains("again under")
            });
            assert!(repinned, "{}", daemon.log());
        });
        let result = flood(
            &lab,
            &sources(&lab, 0, &addrs, 1000, 64),
            Duration::from_secs(5),
        );
        side.join().expect("unmount and mount");
        result
    });
    assert_within(
        received[&addrs[0]],
        200.0 + 100.0 * report.elapsed.as_secs_f64(),
        5.0,
        "the flooded source while bpffs was gone",
    );
    assert!(daemon.log().contains("again under"), "{}", daemon.log());
    assert!(pinned(&pins.join("CONFIG")) && pinned(&pins.join("links").join(RX_IFACE)));
    ok(daemon.cli(&["rules", "show"]));
}

/// Guards the control plane against a bug: a panic in the middle of a rule
/// apply (with the engine locked) fails that request only; the daemon
/// keeps serving, the rules in force are whole, and the next apply works
/// (before, the engine's lock stayed poisoned and every later request
/// failed: the control plane was dead until a restart).
#[test]
fn a_panic_during_an_apply_leaves_the_control_plane_serving() {
    let lab = Lab::create("lt-panic").expect("lab");
    let panic = [
        "env".to_owned(),
        "LIMITER_CRASH_AT=written:2:panic".to_owned(),
    ];
    let daemon =
        Daemon::start_with(&lab, "panic", &[RX_IFACE], BEFORE, "", &panic).expect("daemon");
    let after = daemon.dir.write("after.yaml", AFTER);
    let out = daemon.cli(&["rules", "apply", &after.to_string_lossy()]);
    assert!(!out.status.success(), "the apply did not fail");
    assert!(
        daemon.log().contains("crash point written: panic"),
        "{}",
        daemon.log()
    );
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(names(&view), ["flooded", "gone"], "{view}");
    ok(daemon.cli(&["rules", "apply", &after.to_string_lossy()]));
    let view: serde_json::Value =
        serde_json::from_str(&ok(daemon.cli(&["rules", "show", "--json"]))).expect("JSON");
    assert_eq!(names(&view), ["flooded", "added"], "{view}");
}
