//! Answers as they come: slow ones passed on whole, a pipeline then a half
//! close, a client that vanishes mid-answer.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use limiter_tests::{TempDir, exchange, status};

use super::{
    Proxy, closed_within, head_end,
    messages::{TRAILED, answers, framing_proxy, framing_upstream, pipeline},
    runtime, whole_message,
};

/// Sends `request` to `addr` and reads until the proxy closes: the bytes,
/// and how long passed between the first byte after the head and the
/// last byte.
fn answer_over_time(addr: SocketAddr, request: &[u8]) -> (Vec<u8>, Duration) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(request).unwrap();
    let (mut bytes, mut first_body, mut last) = (Vec::new(), None, Instant::now());
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).expect("closed within 10 s");
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&chunk[..n]);
        last = Instant::now();
        if first_body.is_none() && head_end(&bytes).is_some_and(|end| bytes.len() > end) {
            first_body = Some(last);
        }
    }
    let spread = first_body.map_or(Duration::ZERO, |first| last - first);
    (bytes, spread)
}

/// Guards answers that trickle in, a part every 50 ms (well within the
/// upstream timeout): a body with a length, a chunked one split mid-line
/// (trailers and all) and one delimited by the upstream's close each reach
/// the client whole, not cut at the first pause, and as they come: their
/// first bytes reach the client at least 150 ms before their last (sent
/// 250 to 450 ms apart).
#[test]
fn slow_answers_are_passed_on_whole_as_they_come() {
    let (_rt, _dir, p) = framing_proxy("proxy-slow", "2s");
    let expected = [
        ("/slow", "slow0slow1slow2slow3slow4slow5slow6slow7"),
        ("/trailers", "wikipedia"),
        ("/close-slow", "one two three four five six"),
    ];
    for (path, body) in expected {
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let (bytes, spread) = answer_over_time(p.addr, request.as_bytes());
        let got = answers(&bytes, &["GET"]);
        assert_eq!(got.len(), 1, "{path}: {got:?}\nlog:\n{}", p.log());
        assert_eq!(status(&got[0].0), "200", "{path}: {got:?}");
        assert_eq!(got[0].1, body, "{path}: {got:?}");
        assert!(
            spread >= Duration::from_millis(150),
            "{path}: all its body came at once ({spread:?} from first to last byte)"
        );
    }
    let (bytes, _) = answer_over_time(
        p.addr,
        b"GET /trailers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(
        bytes.ends_with(TRAILED),
        "{}",
        String::from_utf8_lossy(&bytes)
    );
}

/// Guards a client that pipelines its requests and then half-closes
/// (`shutdown(Write)`, as `nc -N` does, and clients that have sent all
/// they will): it has not left, and gets every answer in order, the last
/// one included, 204, 304 and HEAD answers among them, before the proxy
/// closes the connection (the last request of the pipeline was taken for
/// one whose client had left, and went unanswered).
#[test]
fn a_pipeline_then_a_half_close_gets_every_answer() {
    let (_rt, _dir, p) = framing_proxy("proxy-half-close", "3s");
    let paths = ["/echo/1", "/304", "/head", "/204", "/trailers", "/echo/2"];
    let methods = ["GET", "GET", "HEAD", "GET", "GET", "GET"];
    let requests = pipeline(&paths, &methods, false);
    let mut stream = TcpStream::connect(p.addr).unwrap();
    stream.write_all(&requests).unwrap();
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let closed = closed_within(&mut stream, Duration::from_secs(10));
    let answer = closed.expect("closed by the proxy within 10 s");
    let got = answers(answer.as_bytes(), &methods);
    let statuses: Vec<&str> = got.iter().map(|(head, _)| status(head)).collect();
    assert_eq!(
        statuses,
        ["200", "304", "200", "204", "200", "200"],
        "{got:?}\nlog:\n{}",
        p.log()
    );
    let bodies: Vec<&str> = got.iter().map(|(_, body)| body.as_str()).collect();
    assert_eq!(
        bodies,
        ["/echo/1", "", "", "", "wikipedia", "/echo/2"],
        "{got:?}"
    );
}

/// Guards the relay when a client vanishes mid-answer: one that reads the
/// head and first bytes of a 3 s answer and closes is let go at once (under
/// `concurrent: 1` its place is free within 2 s, not held to the end of
/// the upstream's answer), and the proxy goes on serving: a client kept
/// alive from before, and new ones.
#[test]
fn a_client_that_vanishes_mid_answer_leaves_the_others_served() {
    let rt = runtime();
    let up = framing_upstream(&rt);
    let dir = TempDir::new("proxy-vanish");
    let single = "rules:\n  - { name: single, limit: unlimited, concurrent: 1 }\n";
    let mut p = Proxy::start(&dir, single, up, &[], &[]);
    let mut kept = TcpStream::connect(p.addr).unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut ask_kept = |path: &str| {
        kept.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some((head, body, length)) = whole_message(&buf) {
                assert_eq!(length, buf.len(), "more than one answer: {buf:?}");
                let body = String::from_utf8_lossy(&buf[length - body..]).into_owned();
                return (status(&head).to_owned(), body);
            }
            let n = kept.read(&mut chunk).expect("an answer within 10 s");
            assert!(n > 0, "closed: {buf:?}");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    assert_eq!(
        ask_kept("/echo/before"),
        ("200".into(), "/echo/before".into())
    );

    let mut vanishing = TcpStream::connect(p.addr).unwrap();
    vanishing
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    vanishing
        .write_all(b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    // Its head and the first bytes of its body.
    while head_end(&got).is_none_or(|end| got.len() <= end) {
        let n = vanishing
            .read(&mut chunk)
            .expect("a first part within 10 s");
        assert!(n > 0, "closed: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(status(&String::from_utf8_lossy(&got)), "200");
    // In flight: another request waits its turn.
    let one = b"GET /echo/new HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    assert_eq!(status(&exchange(p.addr, one)), "429");
    drop(vanishing);
    let gone = Instant::now();
    loop {
        let answer = exchange(p.addr, one);
        if status(&answer) == "200" {
            assert!(answer.ends_with("\r\n\r\n/echo/new"), "{answer}");
            break;
        }
        assert_eq!(status(&answer), "429", "{answer}");
        assert!(
            gone.elapsed() < Duration::from_secs(2),
            "the vanished client's place was still held after {:?}\nlog:\n{}",
            gone.elapsed(),
            p.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        ask_kept("/echo/after"),
        ("200".into(), "/echo/after".into())
    );
    assert!(p.child.try_wait().unwrap().is_none(), "{}", p.log());
}
