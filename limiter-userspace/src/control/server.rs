//! The socket side of the protocol: a root-only (0600) Unix socket in a
//! root-only directory, one JSON request per line, one response per line.
//! Malformed, unknown and oversized requests get an error response and
//! never reach the handler; an oversized line (or `detach`) also ends the
//! connection, as does a request not complete within the deadline. The
//! connections served at once are capped by the caller ([`refuse`]).

use std::{future::Future, path::Path, time::Duration};

use anyhow::{Context, Result};
use futures_util::{SinkExt, StreamExt};
use nix::sys::stat::{Mode, umask};
use tokio::net::UnixStream;
use tokio_util::codec::{Framed, LinesCodec};

use tokio::sync::mpsc;

use super::protocol::{MAX_REQUEST, Request, Response};
use crate::trace::{TraceFilter, TraceLine};

/// Binds `socket` with no permissions for group and others from the start
/// (not chmod after bind, which would leave a window), in a directory no
/// one else can write. A std listener, non-blocking, for a runtime to take
/// over: the daemon binds before it starts any thread.
pub fn bind(socket: &Path) -> Result<std::os::unix::net::UnixListener> {
    // `control.sock` alone: in the current directory.
    let dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // Whoever can write in the directory can replace the socket.
    crate::kernel::pins::private_dir(dir)?;
    let _ = std::fs::remove_file(socket);
    let old = umask(Mode::from_bits_truncate(0o177));
    let bound = std::os::unix::net::UnixListener::bind(socket);
    umask(old);
    let listener = bound.with_context(|| format!("listening on {}", socket.display()))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Answers the requests of one connection with `handle` until the client
/// hangs up, or takes longer than `deadline` to send a whole request (or
/// to take an answer). A `trace` request is answered by `trace`'s lines
/// until the client hangs up (or the trace ends), which ends the
/// connection.
pub async fn serve_connection<F, Fut, T>(
    stream: UnixStream,
    deadline: Duration,
    handle: F,
    trace: T,
) where
    F: Fn(Request) -> Fut,
    Fut: Future<Output = Response>,
    T: Fn(TraceFilter) -> anyhow::Result<mpsc::Receiver<TraceLine>>,
{
    let mut lines = Framed::new(stream, LinesCodec::new_with_max_length(MAX_REQUEST));
    loop {
        let line = match tokio::time::timeout(deadline, lines.next()).await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(_) => {
                let late = Response::error(format!(
                    "no complete request within {}; closing",
                    humantime::format_duration(deadline)
                ));
                let text = serde_json::to_string(&late).expect("a response serializes");
                let _ = tokio::time::timeout(deadline, lines.send(text)).await;
                break;
            }
        };
        let (response, last) = match line {
            Ok(line) => match serde_json::from_str::<Request>(&line) {
                Ok(Request::Trace { filter }) => match trace(filter) {
                    Ok(lines_traced) => {
                        stream_trace(&mut lines, deadline, lines_traced).await;
                        break;
                    }
                    Err(e) => (Response::error(format!("{e:#}")), false),
                },
                Ok(request) => {
                    let detach = request == Request::Detach;
                    (handle(request).await, detach)
                }
                Err(e) => (Response::error(format!("bad request: {e}")), false),
            },
            // Too long, or not UTF-8: answer, then hang up.
            Err(e) => (Response::error(format!("bad request: {e}")), true),
        };
        let text = serde_json::to_string(&response).expect("a response serializes");
        let sent = tokio::time::timeout(deadline, lines.send(text)).await;
        if !matches!(sent, Ok(Ok(()))) || last {
            break;
        }
    }
}

/// Sends `null` (tracing), then each line traced, until the client hangs
/// up or stops reading for `deadline`, or the trace ends.
async fn stream_trace(
    lines: &mut Framed<UnixStream, LinesCodec>,
    deadline: Duration,
    mut traced: mpsc::Receiver<TraceLine>,
) {
    let mut next = Response::ok(());
    loop {
        let text = serde_json::to_string(&next).expect("a response serializes");
        if !matches!(
            tokio::time::timeout(deadline, lines.send(text)).await,
            Ok(Ok(()))
        ) {
            return;
        }
        tokio::select! {
            line = traced.recv() => match line {
                Some(line) => next = Response::ok(line),
                None => return,
            },
            // The client says nothing more: anything, or its hanging up,
            // ends the trace.
            _ = lines.next() => return,
        }
    }
}

/// Tells a client beyond the connection cap so, and hangs up.
pub async fn refuse(stream: UnixStream, max: usize) {
    let mut lines = Framed::new(stream, LinesCodec::new());
    let busy = Response::error(format!(
        "the daemon is serving {max} control connections already; try again"
    ));
    let text = serde_json::to_string(&busy).expect("a response serializes");
    let _ = tokio::time::timeout(Duration::from_secs(1), lines.send(text)).await;
}
