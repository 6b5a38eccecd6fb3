//! Connections: one client's share of them, the cap and idle ones closed,
//! and descriptor exhaustion.

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use limiter_tests::{TempDir, exchange, status};

use super::{OPEN, Proxy, closed_within, runtime, upstream};

/// A connection from `source` (a loopback address) to `to`.
fn connect_from(source: [u8; 4], to: std::net::SocketAddr) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    let from = std::net::SocketAddr::from((source, 0));
    socket.bind(&from.into()).unwrap();
    socket.connect(&to.into()).unwrap();
    socket.into()
}

/// One client cannot hold every slot: with 8 connections and 2 per
/// source, 127.0.0.1's two idle connections fill its share, its third is
/// answered 503 at once, and 127.0.0.2 is served meanwhile.
#[test]
fn one_client_holds_at_most_its_share_of_connections() {
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-per-source");
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        &[
            "--max-connections",
            "8",
            "--max-connections-per-source",
            "2",
            "--header-timeout",
            "5s",
        ],
        &[],
    );
    // The readiness probe's connection ends first.
    std::thread::sleep(Duration::from_millis(300));
    let _idle: Vec<TcpStream> = (0..2)
        .map(|_| connect_from([127, 0, 0, 1], p.addr))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = connect_from([127, 0, 0, 1], p.addr);
    let refused = closed_within(&mut third, Duration::from_secs(3)).expect("answered and closed");
    assert_eq!(status(&refused), "503", "{refused}; {}", p.log());
    let mut other = connect_from([127, 0, 0, 2], p.addr);
    other
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let served = closed_within(&mut other, Duration::from_secs(3)).expect("answered");
    assert_eq!(status(&served), "200", "another client: {served}");
}

/// Guards the connection cap and the header deadline: two idle clients
/// (one with half a request line) fill a proxy capped at two; a third is
/// answered 503 at once; the idle two are closed at the deadline; then
/// requests are served again.
#[test]
fn connections_are_capped_and_idle_ones_closed() {
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-cap");
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        &[
            "--max-connections",
            "2",
            "--max-connections-per-source",
            "2",
            "--header-timeout",
            "3s",
        ],
        &[],
    );
    // The readiness probe's connection ends first.
    std::thread::sleep(Duration::from_millis(300));
    let mut idle: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(p.addr).unwrap())
        .collect();
    idle[0].write_all(b"GET / HT").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = TcpStream::connect(p.addr).unwrap();
    let t0 = Instant::now();
    let refused = closed_within(&mut third, Duration::from_secs(5)).expect("answered and closed");
    assert_eq!(
        status(&refused),
        "503",
        "{refused} after {:?}; {}",
        t0.elapsed(),
        p.log()
    );
    for stream in &mut idle {
        let closed = closed_within(stream, Duration::from_secs(5));
        assert!(closed.is_ok(), "an idle connection stayed open: {closed:?}");
    }
    let ok = exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&ok), "200", "{ok}");
    // A keep-alive connection has the header timeout from its last answer
    // on, not from its first request: served twice a second apart, it is
    // closed 3 s after the second answer.
    let mut kept = TcpStream::connect(p.addr).unwrap();
    let started = Instant::now();
    for _ in 0..2 {
        kept.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut answer = [0u8; 4096];
        assert!(kept.read(&mut answer).unwrap() > 0);
        std::thread::sleep(Duration::from_millis(1000));
    }
    let answered = started.elapsed() - Duration::from_millis(1000);
    let closed = closed_within(&mut kept, Duration::from_secs(6));
    let idle = started.elapsed() - answered;
    assert!(closed.is_ok(), "an idle keep-alive connection stayed open");
    assert!(
        idle > Duration::from_millis(2500) && idle < Duration::from_secs(5),
        "closed {idle:?} after its last answer (the header timeout is 3 s)"
    );
}

/// Guards the accept loop: with its descriptors exhausted (a limit of 64,
/// 100 clients connected), the proxy backs off instead of spinning, says
/// so in one log line a worker rather than one per attempt (before: 93 MB of lines
/// in 6 s), and serves again once the clients are gone.
#[test]
fn descriptor_exhaustion_backs_off_with_one_log_line() {
    const WORKERS: usize = 8;
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-nofile");
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        // Workers whose runtimes were built as the clients arrived found
        // no descriptor left, and the proxy stopped (before: with 8
        // workers, 10 runs of 10).
        &["--header-timeout", "30s", "--workers", &WORKERS.to_string()],
        &["prlimit", "--nofile=64:64", "--"],
    );
    let clients: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(p.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    let log = p.log();
    let lines = log.lines().filter(|l| l.contains("accept")).count();
    assert!(log.contains("cannot accept connections"), "{log}");
    // One a worker (each has its own listening socket).
    assert!(
        lines <= WORKERS,
        "{lines} log lines about accept errors in 3 s"
    );
    drop(clients);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        TcpStream::connect(p.addr).is_ok(),
        "the proxy stopped: {}",
        p.log()
    );
    let ok = exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&ok), "200", "{ok}");
}
