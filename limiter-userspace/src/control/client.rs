//! Calling the daemon: one connection per request, each reply typed.

use std::{
    io::{BufRead, BufReader},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde::de::DeserializeOwned;

use super::protocol::{Change, Detached, Request, Response, RulesView, Snapshot, Status};

/// The daemon at a control socket.
pub struct Client {
    socket: PathBuf,
}

impl Client {
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_owned(),
        }
    }

    /// Whether a daemon answers on the socket.
    pub fn daemon_running(&self) -> bool {
        UnixStream::connect(&self.socket).is_ok()
    }

    pub fn status(&self) -> Result<Status> {
        self.call(&Request::Status)
    }

    pub fn stats(&self) -> Result<Snapshot> {
        self.call(&Request::Stats)
    }

    /// Validates and applies rule-file text; `origin` names it in errors.
    pub fn rules_apply(&self, text: String, origin: String) -> Result<Change> {
        self.call(&Request::RulesApply { text, origin })
    }

    pub fn rules_show(&self) -> Result<RulesView> {
        self.call(&Request::RulesShow)
    }

    pub fn block(&self, prefix: String, for_secs: Option<f64>) -> Result<()> {
        self.call(&Request::Block { prefix, for_secs })
    }

    pub fn unblock(&self, prefix: String) -> Result<()> {
        self.call(&Request::Unblock { prefix })
    }

    pub fn shadow(&self, rule: Option<String>, on: bool) -> Result<()> {
        self.call(&Request::Shadow { rule, on })
    }

    pub fn detach(&self) -> Result<Detached> {
        self.call(&Request::Detach)
    }

    /// Sends one request and returns the daemon's reply, or its error.
    fn call<T: DeserializeOwned>(&self, request: &Request) -> Result<T> {
        let stream = UnixStream::connect(&self.socket).with_context(|| {
            format!(
                "no daemon answers on {} (is `limiter daemon` running? root only)",
                self.socket.display()
            )
        })?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        let mut line = serde_json::to_string(request)?;
        line.push('\n');
        let sent = send_all(&stream, line.as_bytes());
        // A daemon that refuses a request (too long, too many clients)
        // answers why and hangs up, maybe before it has all been sent: its
        // answer says more than the broken pipe.
        let mut answer = String::new();
        let read = BufReader::new(stream).read_line(&mut answer);
        if answer.is_empty() {
            sent.context("sending the request to the daemon")?;
        }
        read.context("reading the daemon's answer")?;
        let response: Response = serde_json::from_str(&answer)
            .with_context(|| format!("the daemon's answer is not a response: {answer:?}"))?;
        if !response.ok {
            bail!(
                "{}",
                response
                    .error
                    .unwrap_or_else(|| "the daemon refused without saying why".into())
            );
        }
        let result = response.result.unwrap_or(serde_json::Value::Null);
        serde_json::from_value(result).context("the daemon's reply has an unexpected shape")
    }
}

/// Writes all of `bytes` without SIGPIPE (which the CLI leaves fatal, for
/// its output to a closed pipe): a daemon that hung up is an error here.
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    use nix::sys::socket::{MsgFlags, send};
    use std::os::fd::AsRawFd;
    while !bytes.is_empty() {
        match send(stream.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => bytes = &bytes[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
