//! Where a chunked message body ends (RFC 9112 7.1), found while its bytes
//! are passed on as they are: the relay needs to know when the answer is
//! over, not what is in it.

/// A size line (with its extensions) or a trailer line may be this long.
const MAX_LINE: usize = 4096;
/// The trailer section may be this long.
const MAX_TRAILERS: usize = 65536;

/// How far into a chunked body the bytes seen so far are.
#[derive(Debug, Default)]
pub struct ChunkedEnd {
    state: State,
    /// The size line read so far.
    line: Vec<u8>,
    /// Bytes of trailer section seen.
    trailers: usize,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    Size,
    Data(u64),
    /// The CRLF after a chunk's data: how many of its bytes were seen.
    DataEnd(u8),
    /// Trailer lines: how long the current one is so far, and whether
    /// its CR came.
    Trailers {
        line: usize,
        cr: bool,
    },
    Done,
}

/// A body that does not follow the chunked framing.
#[derive(Debug, thiserror::Error)]
#[error("the upstream's chunked body is malformed")]
pub struct Malformed;

impl ChunkedEnd {
    /// Looks at the next `bytes` of the body: how many of them are the
    /// body's (fewer than all only when it ended within them).
    pub fn advance(&mut self, bytes: &[u8]) -> Result<usize, Malformed> {
        let mut at = 0;
        while at < bytes.len() {
            match &mut self.state {
                State::Done => break,
                State::Size => {
                    let byte = bytes[at];
                    at += 1;
                    self.line.push(byte);
                    if self.line.len() > MAX_LINE {
                        return Err(Malformed);
                    }
                    if byte == b'\n' {
                        // CRLF only, and a size of at least one digit.
                        let well_formed =
                            self.line.ends_with(b"\r\n") && self.line[0].is_ascii_hexdigit();
                        if !well_formed {
                            return Err(Malformed);
                        }
                        let size = match httparse::parse_chunk_size(&self.line) {
                            Ok(httparse::Status::Complete((_, size))) => size,
                            _ => return Err(Malformed),
                        };
                        self.line.clear();
                        self.state = match size {
                            0 => State::Trailers { line: 0, cr: false },
                            n => State::Data(n),
                        };
                    }
                }
                State::Data(left) => {
                    let n = (bytes.len() - at).min(usize::try_from(*left).unwrap_or(usize::MAX));
                    at += n;
                    *left -= n as u64;
                    if *left == 0 {
                        self.state = State::DataEnd(0);
                    }
                }
                State::DataEnd(seen) => {
                    let expected = if *seen == 0 { b'\r' } else { b'\n' };
                    if bytes[at] != expected {
                        return Err(Malformed);
                    }
                    at += 1;
                    *seen += 1;
                    if *seen == 2 {
                        self.state = State::Size;
                    }
                }
                State::Trailers { line, cr } => {
                    let byte = bytes[at];
                    at += 1;
                    self.trailers += 1;
                    if self.trailers > MAX_TRAILERS || *line > MAX_LINE {
                        return Err(Malformed);
                    }
                    // Lines end with CRLF, nothing else (as hyper reads
                    // them): the empty one ends the section.
                    match (byte, *cr) {
                        (b'\n', true) if *line == 0 => self.state = State::Done,
                        (b'\n', true) => (*line, *cr) = (0, false),
                        (b'\r', false) => *cr = true,
                        (b'\n', false) | (_, true) => return Err(Malformed),
                        _ => *line += 1,
                    }
                }
            }
        }
        Ok(at)
    }

    /// Whether the body has ended.
    pub fn done(&self) -> bool {
        matches!(self.state, State::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fed `body` in pieces of every size: where the end was found.
    fn ends_at(body: &[u8]) -> Vec<Result<usize, ()>> {
        (1..=body.len())
            .map(|piece| {
                let mut end = ChunkedEnd::default();
                let mut seen = 0;
                for chunk in body.chunks(piece) {
                    let n = end.advance(chunk).map_err(|_| ())?;
                    seen += n;
                    if end.done() {
                        return Ok(seen);
                    }
                    assert_eq!(n, chunk.len(), "stopped before the end");
                }
                Ok(usize::MAX)
            })
            .collect()
    }

    #[test]
    fn the_end_is_found_however_the_bytes_arrive() {
        let body = b"5\r\nhello\r\n1a;ext=\"x\"\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\nGET / HTTP/1.1\r\n";
        let end = body.len() - b"GET / HTTP/1.1\r\n".len();
        assert!(ends_at(body).iter().all(|at| *at == Ok(end)));
        let trailers = b"3\r\nabc\r\n0\r\nx-checksum: 1\r\nx-more: 2\r\n\r\nnext";
        let end = trailers.len() - 4;
        assert!(ends_at(trailers).iter().all(|at| *at == Ok(end)));
        // Chunk data may hold anything, CRLF and "0\r\n\r\n" included.
        let tricky = b"7\r\n0\r\n\r\nab\r\n0\r\n\r\n";
        assert!(ends_at(tricky).iter().all(|at| *at == Ok(tricky.len())));
    }

    #[test]
    fn an_unfinished_body_has_not_ended() {
        assert!(
            ends_at(b"5\r\nhello\r\n0\r\n")
                .iter()
                .all(|at| *at == Ok(usize::MAX))
        );
    }

    #[test]
    fn malformed_framing_is_refused() {
        for bad in [
            &b"zz\r\nhello\r\n"[..],
            b"5\r\nhelloXX0\r\n\r\n",
            b"-1\r\n",
            b"fffffffffffffffffffff\r\n",
            // Bare LFs, an empty size line.
            b"3\nabc\r\n0\r\n\r\n",
            b"3\r\nabc\r\n0\r\n\n",
            b"3\r\nabc\r\n0\r\nx: 1\n\r\n",
            b"\r\n",
        ] {
            assert!(ends_at(bad).iter().all(|at| at.is_err()), "{bad:?}");
        }
        let long = [b'1'; MAX_LINE + 1];
        assert!(ChunkedEnd::default().advance(&long).is_err());
    }

    #[test]
    fn a_trailer_line_may_be_as_long_as_a_line_and_no_longer() {
        // The last chunk, then one trailer line of `n` bytes.
        let body = |n: usize| [&b"0\r\nx:"[..], &vec![b'a'; n - 2], b"\r\n\r\n"].concat();
        let mut end = ChunkedEnd::default();
        assert_eq!(end.advance(&body(MAX_LINE)).ok(), Some(MAX_LINE + 7));
        assert!(end.done());
        assert!(ChunkedEnd::default().advance(&body(MAX_LINE + 1)).is_err());
    }
}
