//! `match.tcp_flags`: a rule on connection attempts per source. Through
//! BPF_PROG_TEST_RUN on crafted segments (which rule each flag pattern
//! takes, IPv4 and IPv6), and on real TCP connections between two
//! namespaces, counted by the listener: the attempts beyond the budget
//! never connect, an established connection's data is not limited.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use limiter::lab::{Lab, RX_IFACE};
use limiter_tests::{RunningLimiter, TempDir, XDP_DROP, XDP_PASS, frames, loaded, snapshot};

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

#[test]
fn tcp_flags_pick_the_rule_of_a_segment() {
    let dp = loaded(
        "rules:
  - { name: syn, match: { source: 198.18.0.0/16, protocol: tcp, tcp_flags: \"syn,!ack\" }, key: source, limit: { rate: 1, unit: minute, burst: 2 } }
  - { name: tcp, match: { source: 198.18.0.0/16, protocol: tcp }, key: source, limit: { rate: 1, unit: minute, burst: 100 } }
  - { name: syn6, match: { source: \"2001:db8::/32\", protocol: tcp, tcp_flags: syn }, limit: { rate: 1, unit: minute, burst: 1 } }
",
    );
    let run = |frame: &[u8]| {
        use aya::programs::TestRun;
        dp.program()
            .test_run(aya::programs::TestRunOptions {
                data_in: Some(frame),
                ..Default::default()
            })
            .expect("BPF_PROG_TEST_RUN")
            .return_value
    };
    let v4 = |flags| frames::with_tcp_flags(frames::tcp4(Ipv4Addr::new(198, 18, 0, 1), 22), flags);
    let v6 =
        |flags| frames::with_tcp_flags(frames::tcp6("2001:db8::1".parse().unwrap(), 22), flags);
    // Two connection attempts, then the third is refused...
    assert_eq!(
        [run(&v4(SYN)), run(&v4(SYN)), run(&v4(SYN))],
        [XDP_PASS, XDP_PASS, XDP_DROP]
    );
    // ...while the connection's other segments are another rule's.
    for flags in [SYN | ACK, ACK, ACK | 0x08, 0x01 | ACK] {
        assert_eq!(run(&v4(flags)), XDP_PASS, "flags {flags:#04x}");
    }
    assert_eq!(
        [run(&v6(SYN)), run(&v6(SYN | ACK)), run(&v6(SYN))],
        [XDP_PASS, XDP_DROP, XDP_DROP]
    );
    let counters = snapshot(&dp);
    let rule = |name: &str| {
        let r = counters
            .rules
            .iter()
            .find(|r| r.name == name)
            .expect("rule");
        (r.counters.passed_packets, r.counters.dropped_packets)
    };
    assert_eq!(rule("syn"), (2, 1));
    assert_eq!(rule("tcp"), (4, 0));
    // `syn` alone names one flag: a SYN-ACK is a SYN too.
    assert_eq!(rule("syn6"), (1, 2));
}

/// Three connection attempts an hour from the sender: the listener
/// accepts three connections and no more (the fourth and fifth time out:
/// their SYNs, retransmitted too, are dropped), while a megabyte written on
/// the first connection arrives whole.
#[test]
fn connection_attempts_per_source_on_real_connections() {
    let lab = Lab::create("lt-tcpflags").expect("lab");
    // The lab's arrival counters drop what they count: here segments must
    // reach the stack, and the listener counts.
    lab.rx
        .exec("nft", &["delete", "table", "netdev", "limiter_lab"])
        .expect("nft");
    let dir = TempDir::new("tcpflags");
    let config = dir.write(
        "rules.yaml",
        "rules:
  - { name: connects, match: { source: 198.19.0.1/32, protocol: tcp, dest_port: 8080, tcp_flags: \"syn,!ack\" }, key: source, limit: { rate: 1, unit: hour, burst: 3 } }
",
    );
    let pin_dir = Path::new("/sys/fs/bpf/limiter-test-tcpflags");
    let running = RunningLimiter::start(
        lab.rx.name(),
        &[RX_IFACE],
        &config,
        pin_dir,
        dir.0.join("run.log"),
    )
    .expect("limiter run");
    let addr: SocketAddr = "198.19.0.2:8080".parse().unwrap();
    let listener = lab
        .rx
        .enter(|| TcpListener::bind(addr))
        .expect("netns")
        .expect("bind");
    let accepted = Arc::new(AtomicU64::new(0));
    let received = Arc::new(AtomicU64::new(0));
    let server = {
        let (accepted, received) = (Arc::clone(&accepted), Arc::clone(&received));
        std::thread::spawn(move || {
            let mut readers = Vec::new();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                if accepted.fetch_add(1, Ordering::SeqCst) == 99 {
                    break;
                }
                let received = Arc::clone(&received);
                readers.push(std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        received.fetch_add(n as u64, Ordering::SeqCst);
                    }
                }));
            }
        })
    };
    let connect = || {
        lab.tx
            .enter(|| TcpStream::connect_timeout(&addr, Duration::from_millis(1500)))
            .expect("netns")
    };
    let mut connections = Vec::new();
    let mut refused = 0;
    for _ in 0..5 {
        match connect() {
            Ok(stream) => connections.push(stream),
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((connections.len(), refused), (3, 2));
    let data = vec![7u8; 1 << 20];
    connections[0]
        .write_all(&data)
        .expect("writing on an established connection");
    drop(connections);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while received.load(Ordering::SeqCst) < data.len() as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the data did not arrive"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        3,
        "the listener's own count"
    );
    drop(server);
    running.stop().expect("limiter run stops cleanly");
}
