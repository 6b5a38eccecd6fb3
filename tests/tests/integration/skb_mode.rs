//! Skb (generic) mode on real traffic. Its program runs on socket
//! buffers, and one buffer may be many frames: TCP from a veth peer with
//! TSO arrives as buffers of up to 64 kB that are segmented only later
//! (issue 35: 458 "packets" carried 20.6 MB in 3 s through a 100
//! packets/s rule). And `auto` falls back to it where native XDP fails,
//! which must never go unsaid.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, TcpListener, TcpStream},
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use limiter::{
    kernel::offloads,
    lab::{Lab, RX_IFACE},
    render::openmetrics::{self, DaemonGauges},
    wire::{Mode, Snapshot},
};
use limiter_tests::{TempDir, limiter_command, rules, session_on_receiver};

const PORT: u16 = 8000;
const RATE: f64 = 100.0;
const BURST: f64 = 100.0;
/// TCP's payload in a full-size frame of a 1,500-byte MTU (with timestamps).
const MSS: f64 = 1448.0;

/// A TCP stream from the sending namespace, as fast as it goes: what the
/// receiving application read in `window` from the connection on.
fn bulk(lab: &Lab, window: Duration) -> u64 {
    let listener = lab
        .rx
        .enter(|| TcpListener::bind((Ipv4Addr::UNSPECIFIED, PORT)))
        .expect("entering the namespace")
        .expect("listening");
    let reader = thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("a connection");
        let start = Instant::now();
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("a timeout");
        let (mut total, mut buffer) = (0u64, vec![0; 1 << 20]);
        while start.elapsed() < window {
            if let Ok(n) = stream.read(&mut buffer) {
                total += n as u64;
            }
        }
        total
    });
    let target = lab.target(0).v4;
    let mut stream = lab
        .tx
        .enter(|| TcpStream::connect((target, PORT)))
        .expect("entering the namespace")
        .expect("connecting");
    stream
        .set_write_timeout(Some(Duration::from_millis(50)))
        .expect("a timeout");
    let chunk = vec![0x5a; 64 * 1024];
    while !reader.is_finished() {
        // A full window waits out the timeout: the limiter is dropping.
        let _ = stream.write(&chunk);
    }
    reader.join().expect("the reader")
}

/// A packet limit is a limit on frames in skb mode too: a buffer longer
/// than any frame is charged the full-size segments it carries. Counted
/// by what the receiving application read, which the limit's frames
/// bound; before, one 64 kB buffer was one packet and the stream ran at
/// the veth's speed.
#[test]
fn a_packet_limit_counts_frames_in_skb_mode() {
    let lab = Lab::create("lt-skb").expect("lab");
    // The lab's counters drop what they count; TCP needs its frames.
    lab.rx
        .exec("nft", &["delete", "table", "netdev", "limiter_lab"])
        .expect("removing the lab's counters");
    let set = rules(&format!(
        "rules:\n  - {{ name: bulk, match: {{ source: 198.19.0.0/24, protocol: tcp, dest_port: {PORT} }}, limit: {{ rate: {RATE}, unit: second, burst: {BURST} }} }}\n"
    ));
    // GRO on, as many drivers ship it: skb mode would see what it merged.
    lab.rx
        .enter(|| offloads::set_gro(RX_IFACE, true))
        .expect("entering the namespace")
        .expect("turning GRO on");
    let gro_before = lab
        .rx
        .enter(|| offloads::merging(RX_IFACE))
        .expect("entering the namespace")
        .expect("reading the offloads")
        .gro;
    assert!(gro_before, "GRO was turned on");
    let session = session_on_receiver(&lab, &set, Mode::Skb, "/sys/fs/bpf/limiter-test-skb");
    assert_eq!(session.attachments[0].mode, Mode::Skb);
    // The stack's merging offloads are off where it attached.
    let merging = lab
        .rx
        .enter(|| offloads::merging(RX_IFACE))
        .expect("entering the namespace")
        .expect("reading the offloads");
    assert!(!merging.any(), "{merging:?}");

    let window = Duration::from_secs(3);
    let received = bulk(&lab, window);
    let elapsed = window;
    // Each frame the limit passes carries at most a segment; a tenth more
    // for the headers' guess (`limiter_common::segments`).
    let allowed = (BURST + RATE * elapsed.as_secs_f64()) * MSS * 1.1;
    println!("{received} bytes read in {elapsed:?}; the limit allows {allowed:.0}");
    assert!(
        received as f64 <= allowed && received as f64 >= BURST * MSS / 2.0,
        "{received} bytes read in {elapsed:?}; the limit's frames carry at most {allowed:.0}"
    );
    let snapshot = session.snapshot().expect("counters");
    let bulk_rule = snapshot.rule("bulk").expect("bulk");
    // Its counters count frames: about what was read, in segments.
    let frames = bulk_rule.passed_packets as f64;
    assert!(
        frames >= received as f64 / MSS * 0.9,
        "{frames} frames passed for {received} bytes read"
    );
}

/// Where native XDP fails (a bridge has none), `auto` attaches in
/// skb mode and says so: on stderr when it does, in `limiter stats`, and
/// in the metric `limiter_xdp_attached`.
#[test]
fn auto_falls_back_to_skb_mode_and_says_so() {
    let lab = Lab::create("lt-skb-auto").expect("lab");
    lab.rx
        .exec("ip", &["link", "add", "br-skb", "type", "bridge"])
        .expect("a bridge");
    lab.rx
        .exec("ip", &["link", "set", "br-skb", "up"])
        .expect("up");
    let dir = TempDir::new("skb-auto");
    let config = dir.write(
        "rules.yaml",
        "rules:\n  - { name: r, match: { source: 198.18.0.0/16 }, limit: { rate: 10, unit: second } }\n",
    );
    let pins = "/sys/fs/bpf/limiter-test-skb-auto";
    let log = dir.0.join("run.log");
    let config = config.to_string_lossy();
    let mut child = limiter_command(
        Some(lab.rx.name()),
        &[
            "run",
            "--config",
            &config,
            "--mode",
            "auto",
            "--iface",
            "br-skb",
            "--pin-dir",
            pins,
            "--interval",
            "60s",
        ],
    )
    .stdout(std::fs::File::create(&log).expect("log"))
    .stderr(std::fs::File::create(dir.0.join("err.log")).expect("log"))
    .spawn()
    .expect("limiter run");
    let deadline = Instant::now() + Duration::from_secs(60);
    let output = || {
        std::fs::read_to_string(&log).unwrap_or_default()
            + &std::fs::read_to_string(dir.0.join("err.log")).unwrap_or_default()
    };
    while !output().contains("limiter: enforcing") {
        assert!(
            Instant::now() < deadline && child.try_wait().expect("wait").is_none(),
            "limiter run did not attach:\n{}",
            output()
        );
        thread::sleep(Duration::from_millis(50));
    }
    let stats = limiter_command(
        Some(lab.rx.name()),
        &[
            "stats",
            "--json",
            "--pin-dir",
            pins,
            "--socket",
            "/nonexistent/control.sock",
        ],
    )
    .stderr(Stdio::inherit())
    .output()
    .expect("limiter stats");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
    let text = output();
    assert!(
        text.contains("br-skb: attached in skb (generic) mode, native XDP failed"),
        "{text}"
    );
    assert!(text.contains("on br-skb (skb)"), "{text}");
    let snapshot: Snapshot = serde_json::from_slice(&stats.stdout).expect("stats --json");
    let bridge = snapshot
        .interfaces
        .iter()
        .find(|i| i.name == "br-skb")
        .expect("br-skb in stats");
    assert_eq!(bridge.xdp_mode, Some(Mode::Skb));
    let metrics = openmetrics::render(&snapshot, DaemonGauges::default());
    assert!(
        metrics.contains("limiter_xdp_attached{layer=\"xdp\",interface=\"br-skb\",mode=\"skb\"} 1"),
        "{metrics}"
    );
}
