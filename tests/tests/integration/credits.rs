//! `cost`: what a packet (request) costs its packet meters by class, in
//! credits. Through BPF_PROG_TEST_RUN on crafted segments, on real TCP
//! connections (a connection attempt costs 10, each other segment 1;
//! the listener counts), and through the proxy (a POST costs 4).

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use limiter::lab::Lab;
use limiter_tests::{
    CountingListener, TempDir, XDP_DROP, XDP_PASS, connect_from_sender, exchange, frames, loaded,
    run_in_lab, snapshot, status, verdict,
};

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

/// 10 credits a minute, burst 10; a SYN costs 4: two SYNs (8), a third
/// refused; two ACKs (10); a third refused. UDP is in no class: 1.
#[test]
fn the_kernel_charges_each_class_its_credits() {
    let dp = loaded(
        "rules:
  - { name: tcp, match: { source: 198.18.0.0/16, protocol: tcp }, key: source, limit: { rate: 10, unit: minute, burst: 10 }, cost: [ { match: { tcp_flags: \"syn,!ack\" }, credits: 4 } ] }
  - { name: any, match: { source: 198.19.0.0/16 }, key: source, limit: { rate: 2, unit: minute, burst: 2 }, cost: [ { match: { tcp_flags: syn }, credits: 2 } ] }
",
    );
    let run = |frame: &[u8]| verdict(&dp, frame);
    let segment =
        |flags| frames::with_tcp_flags(frames::tcp4(Ipv4Addr::new(198, 18, 0, 1), 443), flags);
    let verdicts = [SYN, SYN, SYN, ACK, ACK, ACK].map(|flags| run(&segment(flags)));
    assert_eq!(
        verdicts,
        [XDP_PASS, XDP_PASS, XDP_DROP, XDP_PASS, XDP_PASS, XDP_DROP]
    );
    // UDP is in no class (a class of TCP flags holds TCP segments only).
    let udp = frames::udp4(Ipv4Addr::new(198, 19, 0, 1), 53, 0);
    assert_eq!(
        [run(&udp), run(&udp), run(&udp)],
        [XDP_PASS, XDP_PASS, XDP_DROP]
    );
    let counters = snapshot(&dp);
    let tcp = counters.rules.iter().find(|r| r.name == "tcp").unwrap();
    assert_eq!(
        (tcp.counters.passed_packets, tcp.counters.dropped_packets),
        (4, 2)
    );
}

/// 40 credits (an hour's: nothing refills during the test), a connection
/// attempt costing 10 and every other segment 1: the handshakes of three
/// connections take 33, the fourth attempt is refused (its SYN, and the
/// one retransmitted, dropped: it times out), and a short message on the
/// first connection still passes. The listener counts the connections.
#[test]
fn connection_attempts_cost_more_on_real_connections() {
    let lab = Lab::create("lt-credits").expect("lab");
    let dir = TempDir::new("credits");
    let running = run_in_lab(
        &lab,
        &dir,
        "credits",
        "rules:
  - { name: conns, match: { source: 198.19.0.1/32, protocol: tcp, dest_port: 8080 }, key: source, limit: { rate: 1, unit: hour, burst: 40 }, cost: [ { match: { tcp_flags: \"syn,!ack\" }, credits: 10 } ] }
",
    );
    let addr: SocketAddr = "198.19.0.2:8080".parse().unwrap();
    let listener = CountingListener::start(&lab, addr);
    let connect = || connect_from_sender(&lab, addr, Duration::from_millis(1500));
    let mut connections = Vec::new();
    for _ in 0..3 {
        connections.push(connect().expect("within the budget"));
    }
    let refused = connect().expect_err("a fourth attempt costs 10 of the 7 left");
    assert_eq!(refused.kind(), std::io::ErrorKind::TimedOut, "{refused}");
    std::io::Write::write_all(&mut connections[0], b"hello").expect("writing");
    listener.wait_received(5);
    assert_eq!(listener.accepted(), 3, "the listener's own count");
    drop(connections);
    running.stop().expect("limiter run stops cleanly");
}

/// Through the proxy: 10 credits a minute, burst 10, a POST costing 4:
/// POST, POST, then a POST refused (told to wait until 4 credits are
/// back); GET, GET, then a GET refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_charges_a_request_its_class_credits() {
    let (p, _dir) = limiter_tests::proxy_for(
        "proxy-credits",
        "rules:\n  - { name: api, match: { source: 127.0.0.0/8 }, limit: { rate: 10, unit: minute, burst: 10 }, cost: [ { match: { method: [POST, PUT] }, credits: 4 } ] }\n",
        &[],
    )
    .await;
    tokio::task::spawn_blocking(move || {
        let request = |method: &str| {
            let text = format!(
                "{method} /x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            exchange(p.addr, text.as_bytes())
        };
        let answers: Vec<String> = ["POST", "POST", "POST", "GET", "GET", "GET"]
            .iter()
            .map(|m| request(m))
            .collect();
        let statuses: Vec<&str> = answers.iter().map(|a| status(a)).collect();
        assert_eq!(statuses, ["200", "200", "429", "200", "200", "429"]);
        // The refused POST needs 4 credits with 2 left: 2 more at one
        // each 6 s, so about 12 s, not the 1 s a request of 1 would wait.
        let retry: u64 = answers[2]
            .to_ascii_lowercase()
            .lines()
            .find_map(|l| l.strip_prefix("retry-after: ").map(str::to_owned))
            .and_then(|v| v.trim().parse().ok())
            .expect("a Retry-After field");
        assert!(
            (10..=13).contains(&retry),
            "Retry-After {retry}: {}",
            answers[2]
        );
    })
    .await
    .unwrap();
}

/// Through the proxy, classes by path: under `/export/` a request costs 5
/// of 10 credits, elsewhere 1: two exports spend the budget, so the
/// next plain request is refused; a plain request alone would have left
/// 9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_charges_by_path() {
    let (p, _dir) = limiter_tests::proxy_for(
        "proxy-credits-path",
        "rules:\n  - { name: api, match: { source: 127.0.0.0/8 }, limit: { rate: 10, unit: minute, burst: 10 }, cost: [ { match: { path_prefix: /export/ }, credits: 5 } ] }\n",
        &[],
    )
    .await;
    tokio::task::spawn_blocking(move || {
        let get = |path: &str| {
            let text = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            status(&exchange(p.addr, text.as_bytes())).to_owned()
        };
        let statuses: Vec<String> = ["/export/a", "/export/b", "/x"]
            .iter()
            .map(|path| get(path))
            .collect();
        assert_eq!(statuses, ["200", "200", "429"]);
    })
    .await
    .unwrap();
}
