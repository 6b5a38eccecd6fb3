//! What clients send: bodies that trickle, stall or run long, uploads
//! charged as they stream, long keys, and hop-by-hop fields.

use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use limiter_tests::{TempDir, exchange, status};

use super::{OPEN, Proxy, closed_within, runtime, upstream};

/// A body that trickles in, never pausing for the body timeout, is cut at
/// the body deadline: one byte every 300 ms of a 1,000-byte body, with a
/// 2 s body timeout and a 3 s deadline, gets 408 after about 3 s.
#[test]
fn a_trickling_body_is_cut_at_the_body_deadline() {
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-trickle");
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        &["--body-timeout", "2s", "--body-deadline", "3s"],
        &[],
    );
    let mut stream = TcpStream::connect(p.addr).unwrap();
    stream
        .write_all(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        .unwrap();
    stream.set_nonblocking(true).unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    while started.elapsed() < Duration::from_secs(10) {
        let _ = stream.write_all(b"a");
        let mut buf = [0u8; 4096];
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if !answer.is_empty() && answer.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let answer = String::from_utf8_lossy(&answer);
    let took = started.elapsed();
    assert_eq!(status(&answer), "408", "{answer} after {took:?}");
    assert!(answer.contains("took longer than allowed"), "{answer}");
    assert!(
        took >= Duration::from_millis(2_500) && took < Duration::from_secs(6),
        "{took:?}"
    );
}

/// Guards the body: a declared size over the cap gets 413 before anything
/// is forwarded; a chunked body that grows past it is cut (413) and never
/// reaches the upstream whole; a body that stops arriving gets 408 at the
/// body timeout (not the upstream's).
#[test]
fn bodies_are_capped_and_stalled_ones_cut() {
    let rt = runtime();
    let (up, seen) = upstream(&rt);
    let dir = TempDir::new("proxy-body");
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        &[
            "--max-body-bytes",
            "100000",
            "--body-timeout",
            "1s",
            "--upstream-timeout",
            "60s",
        ],
        &[],
    );
    let declared = exchange(
        p.addr,
        b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n",
    );
    assert_eq!(status(&declared), "413", "{declared}");
    assert_eq!(seen.requests.load(Ordering::SeqCst), 0, "forwarded");

    let mut chunked =
        b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..20 {
        chunked.extend(format!("{:x}\r\n", 10_000).as_bytes());
        chunked.extend(std::iter::repeat_n(b'a', 10_000));
        chunked.extend(b"\r\n");
    }
    chunked.extend(b"0\r\n\r\n");
    let grown = exchange(p.addr, &chunked);
    assert_eq!(status(&grown), "413", "{grown}");
    assert_eq!(seen.complete_body_bytes.load(Ordering::SeqCst), 0);

    let mut stream = TcpStream::connect(p.addr).unwrap();
    stream
        .write_all(
            b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        )
        .unwrap();
    let started = Instant::now();
    let stalled = closed_within(&mut stream, Duration::from_secs(10)).expect("an answer");
    assert_eq!(status(&stalled), "408", "{stalled}");
    // The body timeout (1 s), not the upstream's (60 s) nor a read timeout.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // Under the cap, a chunked body goes through whole.
    let small = b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
    assert_eq!(status(&exchange(p.addr, small)), "200");
    assert_eq!(seen.complete_body_bytes.load(Ordering::SeqCst), 5);
}

/// Guards byte limits on uploads without Content-Length: before, two
/// 5 MiB chunked uploads passed a 1000 B/s limit whole. Now the body is
/// charged as it streams: the first upload is cut with 429 once past the
/// burst, and the upstream never gets a whole one.
#[test]
fn chunked_uploads_are_charged_as_they_stream() {
    let rt = runtime();
    let (up, seen) = upstream(&rt);
    let dir = TempDir::new("proxy-chunked");
    let rules =
        "rules:\n  - { name: uploads, limit: { bytes: 1000, unit: second, burst_bytes: 20000 } }\n";
    let p = Proxy::start(&dir, rules, up, &["--max-body-bytes", "10000000"], &[]);
    for _ in 0..2 {
        let mut upload =
            b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for _ in 0..80 {
            upload.extend(format!("{:x}\r\n", 65_536).as_bytes());
            upload.extend(std::iter::repeat_n(b'a', 65_536));
            upload.extend(b"\r\n");
        }
        upload.extend(b"0\r\n\r\n");
        let answer = exchange(p.addr, &upload);
        assert_eq!(status(&answer), "429", "{answer}");
    }
    assert_eq!(
        seen.complete_body_bytes.load(Ordering::SeqCst),
        0,
        "a whole upload reached the upstream"
    );
}

/// Guards key memory: keys named by a header are kept as fixed-size
/// digests. 3,000 requests with distinct 8 KB key values (24 MB of keys)
/// leave the proxy's resident memory within 8 MB of where it started
/// (before, each key kept its bytes: +24 MB and more).
#[test]
fn long_keys_cost_a_fixed_size() {
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-keys");
    let p = Proxy::start(&dir, OPEN, up, &["--key-header", "x-key"], &[]);
    let send = |from: usize, to: usize| {
        let mut stream = TcpStream::connect(p.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
        for i in from..to {
            let key = format!("{i:08}{}", "k".repeat(8_000));
            // One write: small segments would wait on delayed ACKs.
            let request = format!("GET / HTTP/1.1\r\nHost: x\r\nX-Key: {key}\r\n\r\n");
            stream.write_all(request.as_bytes()).unwrap();
            // Status line, fields, blank line, then the body by its length.
            let mut length = 0;
            loop {
                let mut line = String::new();
                std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
                assert!(i > from || !line.is_empty(), "closed");
                if let Some(n) = line.to_ascii_lowercase().strip_prefix("content-length: ") {
                    length = n.trim().parse().unwrap();
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
        }
    };
    send(0, 200);
    let before = p.rss_kb();
    send(200, 3_200);
    let grown = p.rss_kb().saturating_sub(before);
    assert!(
        grown < 8_192,
        "resident memory grew by {grown} kB for 3,000 keys"
    );
}

/// Guards what crosses the proxy: fields the client's `Connection` names
/// (and the other hop-by-hop fields) do not reach the upstream, which gets
/// the client's address added to `X-Forwarded-For`; CONNECT is
/// refused; a dead upstream's 502 says nothing of why.
#[test]
fn hop_by_hop_fields_connect_and_502_bodies() {
    let rt = runtime();
    let (up, seen) = upstream(&rt);
    let dir = TempDir::new("proxy-fields");
    let p = Proxy::start(&dir, OPEN, up, &[], &[]);
    let answer = exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close, x-secret\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Connection: keep-alive\r\nX-Normal: 1\r\nX-Forwarded-For: 198.51.100.9\r\n\r\n",
    );
    assert_eq!(status(&answer), "200", "{answer}");
    // The proxy's peer is added to what the client said (it trusts no one
    // here, so the client's word is passed on, not believed).
    assert!(
        answer.contains("\nx-forwarded-for: 198.51.100.9, 127.0.0.1\n"),
        "{answer}"
    );
    let fields = answer
        .lines()
        .find_map(|l| l.strip_prefix("fields: "))
        .expect("fields");
    let fields: Vec<&str> = fields.split(',').collect();
    assert!(fields.contains(&"x-normal"), "{fields:?}");
    for hop in [
        "x-secret",
        "keep-alive",
        "te",
        "proxy-connection",
        "connection",
    ] {
        assert!(
            !fields.contains(&hop),
            "{hop} reached the upstream: {fields:?}"
        );
    }
    // Behind a trusted proxy the client it names is the one judged, but
    // the upstream still gets the address the proxy saw added.
    let trusting_dir = TempDir::new("proxy-fields-trusting");
    let trusting = Proxy::start(
        &trusting_dir,
        OPEN,
        up,
        &["--trusted-proxy", "127.0.0.1/32"],
        &[],
    );
    let answer = exchange(
        trusting.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 198.51.100.9\r\nConnection: close\r\n\r\n",
    );
    assert!(
        answer.contains("\nx-forwarded-for: 198.51.100.9, 127.0.0.1\n"),
        "{answer}"
    );
    let connect = exchange(
        p.addr,
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    );
    assert_eq!(status(&connect), "405", "{connect}");
    assert_eq!(
        seen.requests.load(Ordering::SeqCst),
        2,
        "CONNECT was forwarded"
    );

    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dir = TempDir::new("proxy-dead");
    let p = Proxy::start(&dir, OPEN, dead, &[], &[]);
    let answer = exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&answer), "502", "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert_eq!(body, "502 Bad Gateway\n");
}
