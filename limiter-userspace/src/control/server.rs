//! The socket side of the protocol: a root-only (0600) Unix socket, one
//! JSON request per line, one response per line. Malformed, unknown and
//! oversized requests get an error response and never reach the handler;
//! an oversized line (or `detach`) also ends the connection.

use std::{future::Future, path::Path};

use anyhow::{Context, Result};
use futures_util::{SinkExt, StreamExt};
use nix::sys::stat::{Mode, umask};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::{Framed, LinesCodec};

use super::protocol::{MAX_REQUEST, Request, Response};

/// Binds `socket` with no permissions for group and others from the start
/// (not chmod after bind, which would leave a window).
pub fn bind(socket: &Path) -> Result<UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(socket);
    let old = umask(Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(socket);
    umask(old);
    bound.with_context(|| format!("listening on {}", socket.display()))
}

/// Answers the requests of one connection with `handle` until the client
/// hangs up.
pub async fn serve_connection<F, Fut>(stream: UnixStream, handle: F)
where
    F: Fn(Request) -> Fut,
    Fut: Future<Output = Response>,
{
    let mut lines = Framed::new(stream, LinesCodec::new_with_max_length(MAX_REQUEST));
    while let Some(line) = lines.next().await {
        let (response, last) = match line {
            Ok(line) => match serde_json::from_str::<Request>(&line) {
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
        if lines.send(text).await.is_err() || last {
            break;
        }
    }
}
