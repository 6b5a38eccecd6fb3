//! Fragmented datagrams on real traffic: a veth pair between two
//! namespaces, the limiter attached natively on the receiving side, and
//! datagrams counted by the application they reach, after the receiver's
//! stack reassembled them (independently of the limiter's counters).
//!
//! The attack of issue 35: a datagram sent first fragment last. Its later
//! fragments carry no port; charged to the first rule their source and
//! protocol may match (here a looser port's, listed first), they carried
//! the datagram's bulk past its own port's byte limit (34 datagrams of
//! 8 kB reached a 20 kB/s port in 2 s that way; 40 of 40 here).

use std::{
    net::{IpAddr, Ipv4Addr, UdpSocket},
    time::{Duration, Instant},
};

use etherparse::PacketBuilder;
use limiter::{
    lab::{Lab, Target},
    session::Session,
    wire::Mode,
};
use limiter_tests::{rules, session_on_receiver};

/// Where the datagrams come from.
const SOURCE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 7);
/// The limited port, and what each datagram carries to it.
const PORT: u16 = 7000;
const PAYLOAD: usize = 8000;
/// Sent at 20 a second for 2 s: 160 kB/s offered to a 20 kB/s limit.
const DATAGRAMS: u32 = 40;
const GAP: Duration = Duration::from_millis(50);
/// The port's limit, bytes of frames, and its burst.
const BYTES_PER_SECOND: f64 = 20_000.0;
const BURST_BYTES: f64 = 20_000.0;

fn rule_file(policy: &str) -> String {
    format!(
        "fragments: {policy}
rules:
  - {{ name: loose, match: {{ source: 198.18.0.0/16, protocol: udp, dest_port: 53 }}, limit: {{ rate: 10000, unit: second }} }}
  - {{ name: port, match: {{ source: 198.18.0.0/16, protocol: udp, dest_port: {PORT} }}, limit: {{ bytes: {BYTES_PER_SECOND}, unit: second, burst_bytes: {BURST_BYTES} }} }}
"
    )
}

/// A UDP datagram from `source` to the receiver's `PORT`, as the Ethernet
/// frames of its IPv4 fragments (1,480 bytes of IP payload each), the
/// first fragment (with the UDP header) first.
fn fragments(target: &Target, source: Ipv4Addr, id: u16) -> Vec<Vec<u8>> {
    let mut whole = Vec::new();
    PacketBuilder::ethernet2(target.src_mac, target.dst_mac)
        .ipv4(source.octets(), target.v4.octets(), 64)
        .udp(40000, PORT)
        .write(&mut whole, &vec![0x5a; PAYLOAD])
        .expect("writing to a Vec");
    let (eth, ip) = (14, 20);
    let header = &whole[..eth + ip];
    let payload = &whole[eth + ip..];
    payload
        .chunks(1480)
        .enumerate()
        .map(|(i, chunk)| {
            let mut frame = header.to_vec();
            let offset = (i * 1480 / 8) as u16;
            let more = (i + 1) * 1480 < payload.len();
            let total = (ip + chunk.len()) as u16;
            frame[eth + 2..eth + 4].copy_from_slice(&total.to_be_bytes());
            frame[eth + 4..eth + 6].copy_from_slice(&id.to_be_bytes());
            let field = offset | if more { 0x2000 } else { 0 };
            frame[eth + 6..eth + 8].copy_from_slice(&field.to_be_bytes());
            frame[eth + 10..eth + 12].copy_from_slice(&[0, 0]);
            let checksum = ipv4_checksum(&frame[eth..eth + ip]);
            frame[eth + 10..eth + 12].copy_from_slice(&checksum.to_be_bytes());
            frame.extend_from_slice(chunk);
            frame
        })
        .collect()
}

fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// What reached the application: datagrams sent first fragment last under
/// `policy`, and the limiter's snapshot after them.
fn send_first_fragment_last(name: &str, policy: &str) -> (u32, Duration, Session) {
    let lab = Lab::create(name).expect("lab");
    // The lab's counters drop what they count; these frames must reach
    // the receiver's stack to be reassembled.
    lab.rx
        .exec("nft", &["delete", "table", "netdev", "limiter_lab"])
        .expect("removing the lab's counters");
    let set = rules(&rule_file(policy));
    let session = session_on_receiver(
        &lab,
        &set,
        Mode::Native,
        &format!("/sys/fs/bpf/limiter-test-{name}"),
    );
    let socket = lab
        .rx
        .enter(|| UdpSocket::bind(("0.0.0.0", PORT)))
        .expect("entering the namespace")
        .expect("binding the receiver");
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("a timeout");
    // Read as they arrive: a socket buffer full of reassembled datagrams
    // (each holds six frames' buffers) would drop what the limiter passed.
    let reader = std::thread::spawn(move || {
        let mut received = 0;
        let mut buffer = vec![0; 65536];
        while let Ok((n, from)) = socket.recv_from(&mut buffer) {
            assert_eq!((n, from.ip()), (PAYLOAD, IpAddr::V4(SOURCE)));
            received += 1;
        }
        received
    });
    let sender = lab.sender(0).expect("a packet socket");
    let target = lab.target(0);
    let source = SOURCE;
    let start = Instant::now();
    for id in 0..DATAGRAMS {
        let mut frames = fragments(&target, source, id as u16 + 1);
        // The first fragment, the one with the port, goes last.
        frames.rotate_left(1);
        for frame in &frames {
            while !sender.send(frame).expect("sending") {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        std::thread::sleep(GAP);
    }
    let elapsed = start.elapsed();
    let received = reader.join().expect("the reader");
    (received, elapsed, session)
}

/// Charged to the strictest rule they may belong to (the default), the
/// later fragments spend the port's budget: what reassembles is what its
/// byte limit allows, where every datagram got through before.
#[test]
fn datagrams_sent_first_fragment_last_are_held_to_their_ports_limit() {
    let (received, elapsed, session) = send_first_fragment_last("lt-frag-strict", "strictest");
    // Each datagram is 6 frames, 8,262 bytes of them: it reassembles only if
    // all of them passed, so at most this many fit the budget.
    let frame_bytes = PAYLOAD as f64 + 8.0 + 6.0 * (14.0 + 20.0);
    let allowed = (BURST_BYTES + BYTES_PER_SECOND * elapsed.as_secs_f64()) / frame_bytes;
    println!(
        "{received} of {DATAGRAMS} datagrams reassembled in {elapsed:?} (allowed {allowed:.1})"
    );
    assert!(
        received >= 1 && f64::from(received) <= allowed.ceil(),
        "{received} of {DATAGRAMS} datagrams reassembled in {elapsed:?}; the port's limit allows {allowed:.1}"
    );
    let snapshot = session.snapshot().expect("counters");
    assert_eq!(
        snapshot.orphan_fragments.charged,
        u64::from(DATAGRAMS) * 5,
        "every later fragment came before its first"
    );
    let loose = snapshot.rule("loose").expect("loose");
    assert_eq!(loose.passed_packets + loose.dropped_packets, 0);
}

/// With `fragments: drop`, a later fragment whose first was not seen is
/// dropped: no datagram sent first fragment last reassembles.
#[test]
fn with_fragments_drop_no_datagram_sent_first_fragment_last_arrives() {
    let (received, _, session) = send_first_fragment_last("lt-frag-drop", "drop");
    assert_eq!(received, 0);
    let snapshot = session.snapshot().expect("counters");
    assert_eq!(
        (
            snapshot.orphan_fragments.dropped,
            snapshot.orphan_fragments.charged
        ),
        (u64::from(DATAGRAMS) * 5, 0)
    );
}
