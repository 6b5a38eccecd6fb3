//! HTTP/1.1 messages relayed whole and in order: framing, answers without
//! a body, pipelines, conflicting lengths. The upstream and proxy these
//! tests share are here too.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use limiter_tests::{TempDir, exchange, status};

use super::{OPEN, Proxy, head_end, runtime, upstream, whole_message};

/// An upstream written by hand, to answer in every framing HTTP/1.1 has,
/// as real servers answer: by the request's path, a chunked answer sent in
/// two parts, one with both `Transfer-Encoding` and `Content-Length`, a
/// 103 or a 100 before the answer, fields its `Connection` names, one
/// delimited by its close, a 204, a 304 with the entity's length and no
/// body, conflicting and repeated `Content-Length`s, and bodies that
/// trickle in (`/slow`, chunked with trailers split mid-line, up to its
/// close; `/long` for 3 s), a part every 50 ms. `/echo/...` answers with
/// its path. It reads request bodies by their length, and otherwise says
/// how many body bytes it got.
pub(super) fn framing_upstream(runtime: &tokio::runtime::Runtime) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    runtime.spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                // Each part in a segment of its own.
                let _ = stream.set_nodelay(true);
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let (head, body) = loop {
                        if let Some((head, body, length)) = whole_message(&buf) {
                            buf.drain(..length);
                            break (head, body);
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    let parts: Vec<Vec<u8>> = match path.as_str() {
                        "/chunked" => vec![
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel".to_vec(),
                            b"lo\r\n6\r\n world\r\n0\r\nx-sum: 1\r\n\r\n".to_vec(),
                        ],
                        "/both" => vec![b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec()],
                        "/early" => vec![b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfinal".to_vec()],
                        "/head" => vec![b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n".to_vec()],
                        "/hop" => vec![b"HTTP/1.1 200 OK\r\nConnection: x-private\r\nX-Private: 1\r\nKeep-Alive: timeout=5\r\nX-Public: 1\r\nContent-Length: 3\r\n\r\nhop".to_vec()],
                        "/close" => vec![b"HTTP/1.1 200 OK\r\n\r\nuntil the end".to_vec()],
                        "/close-slow" => [&b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\none "[..], b"two ", b"three ", b"four ", b"five ", b"six"]
                            .into_iter()
                            .map(<[u8]>::to_vec)
                            .collect(),
                        "/204" => vec![b"HTTP/1.1 204 No Content\r\nX-Id: 204\r\n\r\n".to_vec()],
                        "/304" => vec![b"HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\nContent-Length: 7\r\n\r\n".to_vec()],
                        "/continue" => vec![
                            b"HTTP/1.1 100 Continue\r\n\r\n".to_vec(),
                            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\ncontinued".to_vec(),
                        ],
                        "/trailers" => [
                            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r"[..],
                            b"\nwi",
                            b"ki\r",
                            b"\n5;e",
                            b"xt=1\r\npedia\r\n0",
                            b"\r\nx-check",
                            b"sum: 42\r\n",
                            b"x-more: 1\r",
                            b"\n\r",
                            b"\n",
                        ]
                        .into_iter()
                        .map(<[u8]>::to_vec)
                        .collect(),
                        "/slow" => std::iter::once(b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n".to_vec())
                            .chain((0..8).map(|i| format!("slow{i}").into_bytes()))
                            .collect(),
                        "/long" => std::iter::once(b"HTTP/1.1 200 OK\r\nContent-Length: 60000\r\n\r\n".to_vec())
                            .chain((0..60).map(|_| vec![b'x'; 1000]))
                            .collect(),
                        "/cl-fields" => vec![b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!".to_vec()],
                        "/cl-list" => vec![b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello!".to_vec()],
                        "/cl-same" => vec![b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello".to_vec()],
                        "/cl-same-list" => vec![b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello".to_vec()],
                        echo if echo.starts_with("/echo/") => vec![format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{echo}", echo.len()).into_bytes()],
                        _ => vec![format!("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{body:02}").into_bytes()],
                    };
                    for (i, part) in parts.iter().enumerate() {
                        if i > 0 {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        if stream.write_all(part).await.is_err() {
                            return;
                        }
                    }
                    if path.starts_with("/close") {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// The answers in `bytes`, read as a client does: (head, body), each body
/// by its framing (a chunked one decoded, trailers dropped; the answer to
/// a HEAD, a 1xx, a 204 and a 304 have none; one with no length runs to
/// the end).
pub(super) fn answers(bytes: &[u8], methods: &[&str]) -> Vec<(String, String)> {
    let mut rest = bytes;
    let mut answers = Vec::new();
    for method in methods {
        let Some(end) = head_end(rest) else { break };
        let head = String::from_utf8_lossy(&rest[..end]).to_lowercase();
        rest = &rest[end..];
        let field = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_owned())
        };
        let mut body = Vec::new();
        let bodiless = matches!(status(&head), "204" | "304") || status(&head).starts_with('1');
        if *method == "HEAD" || bodiless {
        } else if field("transfer-encoding:").as_deref() == Some("chunked") {
            loop {
                let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
                let line = String::from_utf8_lossy(&rest[..line_end]).into_owned();
                let size = usize::from_str_radix(line.split(';').next().unwrap(), 16).unwrap();
                rest = &rest[line_end + 2..];
                if size == 0 {
                    let trailers_end = if rest.starts_with(b"\r\n") {
                        2
                    } else {
                        head_end(rest).unwrap()
                    };
                    rest = &rest[trailers_end..];
                    break;
                }
                body.extend_from_slice(&rest[..size]);
                rest = &rest[size + 2..];
            }
        } else if let Some(length) = field("content-length:") {
            let length: usize = length.parse().unwrap();
            body.extend_from_slice(&rest[..length]);
            rest = &rest[length..];
        } else {
            body.extend_from_slice(rest);
            rest = &[];
        }
        answers.push((head, String::from_utf8_lossy(&body).into_owned()));
    }
    assert!(rest.is_empty(), "bytes after the answers: {rest:?}");
    answers
}

/// Guards the proxy's own relay of requests without a body: requests sent
/// all at once on one connection (pipelined) are answered in order, each
/// answer framed as the upstream framed it or as a client can read it
/// (a chunked one passed on with its end found, `Content-Length` dropped
/// beside `Transfer-Encoding`, a 103 left out, no body for a HEAD, one
/// delimited by the upstream's close closing the client's connection),
/// without hop-by-hop fields; and a request with a body on a relayed
/// connection hands it over to hyper with nothing lost, before or after.
#[test]
fn relayed_answers_keep_their_framing_and_order() {
    let rt = runtime();
    let up = framing_upstream(&rt);
    let dir = TempDir::new("proxy-framing");
    let p = Proxy::start(&dir, OPEN, up, &[], &[]);
    let requests = ["/chunked", "/head", "/early", "/both", "/hop", "/close"];
    let methods = ["GET", "HEAD", "GET", "GET", "GET", "GET"];
    let pipelined: String = requests
        .iter()
        .zip(methods)
        .map(|(path, method)| format!("{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n"))
        .collect();
    let mut stream = TcpStream::connect(p.addr).unwrap();
    let answer = closed_within_after(&mut stream, pipelined.as_bytes());
    let got = answers(&answer, &methods);
    let statuses: Vec<&str> = got.iter().map(|(head, _)| status(head)).collect();
    assert_eq!(statuses, vec!["200"; 6], "{got:?}\nlog:\n{}", p.log());
    let bodies: Vec<&str> = got.iter().map(|(_, body)| body.as_str()).collect();
    assert_eq!(
        bodies,
        ["hello world", "", "final", "abc", "hop", "until the end"],
        "{got:?}"
    );
    let heads: Vec<&str> = got.iter().map(|(head, _)| head.as_str()).collect();
    assert!(heads[1].contains("content-length: 1000"), "{}", heads[1]);
    assert!(!heads[3].contains("content-length"), "{}", heads[3]);
    assert!(heads[4].contains("x-public: 1"), "{}", heads[4]);
    for hop in ["x-private", "keep-alive", "connection: x-private"] {
        assert!(
            !heads[4].contains(hop),
            "{hop} reached the client: {}",
            heads[4]
        );
    }
    assert!(heads[5].contains("connection: close"), "{}", heads[5]);
    assert!(got.iter().all(|(head, _)| !head.contains("103")), "{got:?}");

    let mixed = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n\
POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 42\r\n\r\n012345678901234567890123456789012345678901\
GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let mut stream = TcpStream::connect(p.addr).unwrap();
    let answer = closed_within_after(&mut stream, mixed);
    let got = answers(&answer, &["GET", "POST", "GET"]);
    let bodies: Vec<&str> = got.iter().map(|(_, body)| body.as_str()).collect();
    // Each answer is the body length the upstream read.
    assert_eq!(bodies, ["00", "42", "00"], "{got:?}\nlog:\n{}", p.log());
}

/// Writes `request` and reads until the peer closes (10 s at most).
fn closed_within_after(stream: &mut TcpStream, request: &[u8]) -> Vec<u8> {
    stream.write_all(request).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).expect("closed within 10 s");
    answer
}

/// Guards the proxy's own answers on a relayed connection: a HEAD that is
/// refused gets the 429's head and no body (a body would be read as the
/// next answer), and the connection goes on; and a client that leaves
/// while its request waits on the upstream takes the request with it, so
/// it no longer counts in flight (as hyper drops a request whose client
/// has gone).
#[test]
fn refused_heads_have_no_body_and_leaving_clients_free_their_place() {
    let rt = runtime();
    let (up, _) = upstream(&rt);
    let dir = TempDir::new("proxy-head-429");
    let one = "rules:\n  - { name: one, limit: { rate: 1, unit: minute, burst: 1 } }\n";
    let p = Proxy::start(&dir, one, up, &[], &[]);
    let mut stream = TcpStream::connect(p.addr).unwrap();
    let heads = b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\nHEAD /b HTTP/1.1\r\nHost: x\r\n\r\n\
GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let answer = closed_within_after(&mut stream, heads);
    let got = answers(&answer, &["HEAD", "HEAD", "GET"]);
    let statuses: Vec<&str> = got.iter().map(|(head, _)| status(head)).collect();
    assert_eq!(statuses, ["200", "429", "429"], "{got:?}");
    assert!(got[1].0.contains("content-length: "), "{got:?}");
    assert_eq!(got[1].1, "", "{got:?}");
    assert!(got[2].1.starts_with("429 Too Many Requests"), "{got:?}");
    drop(p);

    let dir = TempDir::new("proxy-leaving");
    let single = "rules:\n  - { name: single, limit: unlimited, concurrent: 1 }\n";
    let p = Proxy::start(&dir, single, up, &[], &[]);
    let mut leaving = TcpStream::connect(p.addr).unwrap();
    leaving
        .write_all(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // In flight now: the next one is refused until it leaves.
    std::thread::sleep(Duration::from_millis(300));
    let refused = exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&refused), "429", "{refused}");
    drop(leaving);
    std::thread::sleep(Duration::from_millis(300));
    let served = exchange(
        p.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status(&served), "200", "{served}\nlog:\n{}", p.log());
}

/// Requests for `paths` (each with its method of `methods`) as one write,
/// the last asking to close if `close`.
pub(super) fn pipeline(paths: &[&str], methods: &[&str], close: bool) -> Vec<u8> {
    let last = paths.len() - 1;
    paths
        .iter()
        .zip(methods)
        .enumerate()
        .flat_map(|(i, (path, method))| {
            let close = if close && i == last {
                "Connection: close\r\n"
            } else {
                ""
            };
            format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{close}\r\n").into_bytes()
        })
        .collect()
}

/// The chunked body `/trailers` sends, trailers and all.
pub(super) const TRAILED: &[u8] =
    b"4\r\nwiki\r\n5;ext=1\r\npedia\r\n0\r\nx-checksum: 42\r\nx-more: 1\r\n\r\n";

/// Guards which answers the relay takes to have no body (RFC 9112 6.3),
/// as a pipelining client sees them: requests in one write get a 304 with
/// the entity's `Content-Length: 7` and no body, a 204, a HEAD's answer
/// with `Content-Length: 1000` and no body, a 100 Continue (a write of its
/// own) and a 103 before their final answers, a chunked body with
/// trailers trickling in split mid-line, and a body delimited by the
/// upstream's close. Each answer arrives whole and in order, the chunked
/// one byte for byte with its trailers and final CRLF, no 1xx, and none
/// takes the next one's bytes for its body (a 304 relayed as having a
/// body waits for 7 bytes that never come, and the answers after it
/// never arrive).
#[test]
fn answers_without_a_body_keep_pipelined_answers_in_step() {
    let (_rt, _dir, p) = framing_proxy("proxy-bodiless", "3s");
    let paths = [
        "/304",
        "/echo/1",
        "/204",
        "/head",
        "/echo/2",
        "/continue",
        "/early",
        "/trailers",
        "/304",
        "/close-slow",
    ];
    let methods = [
        "GET", "GET", "GET", "HEAD", "GET", "GET", "GET", "GET", "HEAD", "GET",
    ];
    let mut stream = TcpStream::connect(p.addr).unwrap();
    let answer = closed_within_after(&mut stream, &pipeline(&paths, &methods, true));
    let got = answers(&answer, &methods);
    let statuses: Vec<&str> = got.iter().map(|(head, _)| status(head)).collect();
    assert_eq!(
        statuses,
        [
            "304", "200", "204", "200", "200", "200", "200", "200", "304", "200"
        ],
        "{got:?}\nlog:\n{}",
        p.log()
    );
    let bodies: Vec<&str> = got.iter().map(|(_, body)| body.as_str()).collect();
    assert_eq!(
        bodies,
        [
            "",
            "/echo/1",
            "",
            "",
            "/echo/2",
            "continued",
            "final",
            "wikipedia",
            "",
            "one two three four five six"
        ],
        "{got:?}"
    );
    let heads: Vec<&str> = got.iter().map(|(head, _)| head.as_str()).collect();
    for at in [0, 8] {
        assert!(
            heads[at].contains("\r\ncontent-length: 7\r\n"),
            "{}",
            heads[at]
        );
        assert!(heads[at].contains("\r\netag: \"v1\"\r\n"), "{}", heads[at]);
    }
    assert!(heads[2].contains("\r\nx-id: 204\r\n"), "{}", heads[2]);
    assert!(
        heads[3].contains("\r\ncontent-length: 1000\r\n"),
        "{}",
        heads[3]
    );
    for at in [0, 2, 3, 8] {
        assert!(!heads[at].contains("transfer-encoding"), "{}", heads[at]);
    }
    assert!(!heads[2].contains("content-length"), "{}", heads[2]);
    assert!(
        heads[9].contains("\r\nconnection: close\r\n"),
        "{}",
        heads[9]
    );
    // The chunked body as the upstream framed it, the next answer right
    // after its last CRLF.
    let mut framed = b"\r\n\r\n".to_vec();
    framed.extend_from_slice(TRAILED);
    framed.extend_from_slice(b"HTTP/1.1 304 ");
    assert!(
        answer.windows(framed.len()).any(|w| w == framed),
        "{}",
        String::from_utf8_lossy(&answer)
    );
}

/// `limiter proxy` (no rule) in front of [`framing_upstream`], with this
/// upstream timeout: the upstream's runtime, the proxy's directory and
/// the proxy (bound in this order, dropped the proxy first).
pub(super) fn framing_proxy(
    name: &str,
    upstream_timeout: &str,
) -> (tokio::runtime::Runtime, TempDir, Proxy) {
    let rt = runtime();
    let up = framing_upstream(&rt);
    let dir = TempDir::new(name);
    let p = Proxy::start(
        &dir,
        OPEN,
        up,
        &["--upstream-timeout", upstream_timeout],
        &[],
    );
    (rt, dir, p)
}

/// Guards the upstream's `Content-Length` (RFC 9112 6.3): an answer with
/// two lengths, in two fields or in one list, is refused with the proxy's
/// 502 (none of its bytes reach the client, whose next answers stay in
/// step on the same connection), while one length said twice is one
/// length, passed on once.
#[test]
fn conflicting_content_lengths_get_a_502() {
    let (_rt, _dir, p) = framing_proxy("proxy-lengths", "3s");
    let paths = [
        "/cl-fields",
        "/cl-same",
        "/cl-list",
        "/cl-same-list",
        "/echo/end",
    ];
    let methods = ["GET"; 5];
    let mut stream = TcpStream::connect(p.addr).unwrap();
    let answer = closed_within_after(&mut stream, &pipeline(&paths, &methods, true));
    let got = answers(&answer, &methods);
    let statuses: Vec<&str> = got.iter().map(|(head, _)| status(head)).collect();
    assert_eq!(
        statuses,
        ["502", "200", "502", "200", "200"],
        "{got:?}\nlog:\n{}",
        p.log()
    );
    let bodies: Vec<&str> = got.iter().map(|(_, body)| body.as_str()).collect();
    assert_eq!(
        bodies,
        [
            "502 Bad Gateway\n",
            "hello",
            "502 Bad Gateway\n",
            "hello",
            "/echo/end"
        ],
        "{got:?}"
    );
    for (head, _) in [&got[1], &got[3]] {
        assert_eq!(head.matches("content-length").count(), 1, "{head}");
        assert!(head.contains("\r\ncontent-length: 5\r\n"), "{head}");
    }
}
