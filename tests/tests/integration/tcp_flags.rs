//! `match.tcp_flags`: a rule on connection attempts per source. Through
//! BPF_PROG_TEST_RUN on crafted segments (which rule each flag pattern
//! takes, IPv4 and IPv6), and on real TCP connections between two
//! namespaces, counted by the listener: the attempts beyond the budget
//! never connect, an established connection's data is not limited.

use std::{
    io::Write,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use limiter::lab::Lab;
use limiter_tests::{
    CountingListener, TempDir, XDP_DROP, XDP_PASS, connect_from_sender, frames, loaded, run_in_lab,
    snapshot, verdict,
};

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
    let run = |frame: &[u8]| verdict(&dp, frame);
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
    let dir = TempDir::new("tcpflags");
    let running = run_in_lab(
        &lab,
        &dir,
        "tcpflags",
        "rules:
  - { name: connects, match: { source: 198.19.0.1/32, protocol: tcp, dest_port: 8080, tcp_flags: \"syn,!ack\" }, key: source, limit: { rate: 1, unit: hour, burst: 3 } }
",
    );
    let addr: SocketAddr = "198.19.0.2:8080".parse().unwrap();
    let listener = CountingListener::start(&lab, addr);
    let connect = || connect_from_sender(&lab, addr, Duration::from_millis(1500));
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
    listener.wait_received(data.len() as u64);
    assert_eq!(listener.accepted(), 3, "the listener's own count");
    running.stop().expect("limiter run stops cleanly");
}
