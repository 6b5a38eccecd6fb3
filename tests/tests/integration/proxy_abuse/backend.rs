//! The upstream's side: connections kept alive and replaced, an upstream
//! that never answers, stops answering, or closes without answering.

use std::{
    io::{Read, Write},
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use limiter_tests::{TempDir, exchange, status};

use super::{OPEN, Proxy, head_end, runtime, statuses_on_one_connection, upstream};

/// An upstream written by hand, to count its connections: it answers each
/// request (a GET) with `ok`, and with `close_each` closes the connection
/// after each answer without having said so, as an upstream ending an idle
/// keep-alive connection does.
fn counting_upstream(
    runtime: &tokio::runtime::Runtime,
    close_each: bool,
) -> (SocketAddr, Arc<AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connections = Arc::new(AtomicU64::new(0));
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let counted = Arc::clone(&connections);
    runtime.spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let end = loop {
                        if let Some(end) = head_end(&buf) {
                            break end;
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    buf.drain(..end);
                    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n";
                    if stream.write_all(answer).await.is_err() || close_each {
                        return;
                    }
                }
            });
        }
    });
    (addr, connections)
}

/// Guards the upstream connections: a client's requests one after another
/// go over one upstream connection, kept alive; and an upstream that closes
/// each connection after its answer, without saying so, costs the clients
/// nothing (a closed connection is not used again, and a request it could
/// not send goes on a new one), rather than a 502.
#[test]
fn upstream_connections_are_kept_alive_and_closed_ones_replaced() {
    let rt = runtime();
    let dir = TempDir::new("proxy-reuse");
    let (up, connections) = counting_upstream(&rt, false);
    let p = Proxy::start(&dir, OPEN, up, &[], &[]);
    let statuses = statuses_on_one_connection(p.addr, 20, Duration::ZERO);
    assert!(statuses.iter().all(|s| s == "200"), "{statuses:?}");
    assert_eq!(statuses.len(), 20);
    let opened = connections.load(Ordering::SeqCst);
    assert!(
        opened <= 2,
        "20 requests one after another opened {opened} upstream connections"
    );
    drop(p);

    let dir = TempDir::new("proxy-reuse-closed");
    let (up, connections) = counting_upstream(&rt, true);
    let p = Proxy::start(&dir, OPEN, up, &[], &[]);
    // A pause between requests, so the upstream has closed the last
    // connection before the next request (a request written as it closes
    // is lost, and a 502 is then the right answer).
    let statuses = statuses_on_one_connection(p.addr, 20, Duration::from_millis(20));
    assert_eq!(statuses, vec!["200"; 20], "log:\n{}", p.log());
    assert_eq!(connections.load(Ordering::SeqCst), 20);
}

/// Guards the upstream's clock: it starts once the upstream has the whole
/// request, also for a body with a length (which ends with its last data
/// frame: nothing polls it again to see its end), so an upstream that
/// never answers a POST gets the client a 502 at the upstream timeout.
#[test]
fn an_upstream_that_never_answers_a_post_times_out() {
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-hang");
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        &["--upstream-timeout", "1s", "--body-timeout", "30s"],
        &[],
    );
    let started = Instant::now();
    let answer = exchange(
        p.addr,
        b"POST /hang HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
    );
    assert_eq!(status(&answer), "502", "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

/// Guards the answer's way back: an upstream that sends a head and part of
/// a body, then nothing, has the client's connection closed at the
/// upstream timeout (before, the client waited as long as it cared to,
/// holding its connection slot).
#[test]
fn an_answer_that_stops_arriving_is_cut() {
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up = upstream.local_addr().unwrap();
    let stalled = std::thread::spawn(move || {
        let (mut stream, _) = upstream.accept().unwrap();
        let mut request = [0u8; 4096];
        let _ = stream.read(&mut request);
        stream
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhello")
            .unwrap();
        std::thread::sleep(Duration::from_secs(20));
    });
    let dir = TempDir::new("proxy-stall");
    let p = Proxy::start(&dir, OPEN, up, &["--upstream-timeout", "1s"], &[]);
    let started = Instant::now();
    let answer = exchange(p.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("hello"),
        "{answer}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the connection stayed open {:?}",
        started.elapsed()
    );
    drop(p);
    drop(stalled);
}

/// Guards the one retry of `Relay::ask`: only a request that is safe to
/// repeat, sent on a kept-alive connection the upstream had closed, goes
/// again on a new one. An upstream that takes a GET on a new connection
/// and closes it without a word gets the request once, and the client a
/// 502 at once (asking again and again would hold it until the upstream
/// timeout, and send the upstream the request as many times).
#[test]
fn an_upstream_that_closes_without_answering_is_asked_once() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&connections);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            // The request read, then closed unanswered.
            let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
        }
    });
    let dir = TempDir::new("proxy-closes");
    let p = Proxy::start(&dir, OPEN, up, &["--upstream-timeout", "5s"], &[]);
    let started = Instant::now();
    let answer = exchange(
        p.addr,
        b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let took = started.elapsed();
    assert_eq!(status(&answer), "502", "{answer}");
    assert_eq!(
        connections.load(Ordering::SeqCst),
        1,
        "asked once, on a new connection"
    );
    assert!(took < Duration::from_secs(4), "answered in {took:?}");
}
