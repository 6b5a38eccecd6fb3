//! The relay's waiting and writing: a deadline cheap to move at every
//! request, writes tried at once before any future waits, and a client
//! that leaves while its request waits.

use std::{future::Future, pin::Pin, time::Duration};

use tokio::{io::AsyncWriteExt, net::TcpStream, time::Instant};

use crate::listen::{ConnectionError, Limits};

/// A deadline moved at every request and seldom reached: moving it later
/// is a store, and the timer under it is re-armed only when it goes off
/// early (once a timeout's length, not once a request: arming a timer
/// for each request and disarming it was a tenth of the relay's time).
pub struct Deadline {
    due: Instant,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Deadline {
    pub fn new() -> Self {
        Self {
            due: Instant::now(),
            timer: None,
        }
    }

    /// Puts it `after` from now (far off for a duration too long to add).
    pub fn set(&mut self, after: Duration) {
        let now = Instant::now();
        self.due = now
            .checked_add(after)
            .unwrap_or_else(|| now + Duration::from_secs(1 << 30));
        match &mut self.timer {
            Some(timer) if timer.deadline() <= self.due => {}
            Some(timer) => timer.as_mut().reset(self.due),
            None => self.timer = Some(Box::pin(tokio::time::sleep_until(self.due))),
        }
    }

    /// `work`'s output, or `None` if the deadline passes first (never set:
    /// no deadline).
    pub async fn within<F: Future>(&mut self, work: F) -> Option<F::Output> {
        let due = self.due;
        let Some(timer) = self.timer.as_mut() else {
            return Some(work.await);
        };
        let passed = async {
            loop {
                timer.as_mut().await;
                if Instant::now() >= due {
                    return;
                }
                timer.as_mut().reset(due);
            }
        };
        tokio::select! {
            biased;
            out = work => Some(out),
            () = passed => None,
        }
    }
}

/// Writes all of `bytes`, trying at once first (a small message almost
/// always goes whole, and then no future waits on the socket).
pub async fn write_all(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let sent = write_now(stream, bytes)?;
    if sent < bytes.len() {
        stream.write_all(&bytes[sent..]).await?;
    }
    Ok(())
}

/// As much of `bytes` as the socket takes now.
pub fn write_now(stream: &TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
    match stream.try_write(bytes) {
        Ok(n) => Ok(n),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// Ends when the client closes its connection (or it fails) while its
/// request waits; never for a pipelined request, one sent with others
/// before their answers (a half close may well follow a pipeline: the
/// client has said all it will, and waits for every answer, the last
/// included). A client that half-closes after a request it sent alone is
/// taken to have left, as hyper and nginx take it.
pub async fn client_gone(client: &TcpStream, pipelined: bool) {
    if !pipelined && matches!(client.peek(&mut [0u8; 1]).await, Ok(0) | Err(_)) {
        return;
    }
    std::future::pending().await
}

/// Writes all of `bytes` to the client, which must read them within the
/// write timeout.
pub async fn write_client(
    client: &mut TcpStream,
    bytes: &[u8],
    limits: Limits,
) -> Result<(), ConnectionError> {
    // All of it at once, as an answer almost always goes: no timer.
    let sent = write_now(client, bytes)?;
    if sent == bytes.len() {
        return Ok(());
    }
    let rest = &bytes[sent..];
    match tokio::time::timeout(limits.write_timeout, client.write_all(rest)).await {
        Ok(written) => Ok(written?),
        Err(_) => Err("the client stopped reading".into()),
    }
}
