//! Calling the daemon: one connection per request, each reply typed.

use std::{
    io::{BufRead, BufReader},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde::de::DeserializeOwned;

use super::protocol::{Request, Response};
use crate::{
    trace::{TraceFilter, TraceLine},
    wire::{Change, Detached, RulesView, Snapshot, Status},
};

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

    /// Traces the kernel's decisions through the daemon: `started` is
    /// called once it traces, then `each` gets every line until it says
    /// stop (false), or `until` passes.
    pub fn trace(
        &self,
        filter: TraceFilter,
        until: Option<Duration>,
        started: impl FnOnce(),
        mut each: impl FnMut(TraceLine) -> Result<bool>,
    ) -> Result<()> {
        let mut started = Some(started);
        let stream = self.connect()?;
        let mut line = serde_json::to_string(&Request::Trace { filter })?;
        line.push('\n');
        send_all(&stream, line.as_bytes()).context("sending the request to the daemon")?;
        if let Some(until) = until {
            // Hanging up ends the trace: the read below then sees the end.
            let hang_up = stream.try_clone()?;
            std::thread::spawn(move || {
                std::thread::sleep(until);
                let _ = hang_up.shutdown(std::net::Shutdown::Both);
            });
        }
        let mut reader = BufReader::new(stream);
        let mut first = true;
        loop {
            let mut answer = String::new();
            if reader.read_line(&mut answer)? == 0 {
                if first {
                    bail!("the daemon hung up without answering");
                }
                return Ok(());
            }
            let result = reply(&answer)?;
            if first {
                first = false;
                if let Some(started) = started.take() {
                    started();
                }
                continue;
            }
            let traced: TraceLine = serde_json::from_value(result)
                .context("the daemon's trace line has an unexpected shape")?;
            if !each(traced)? {
                return Ok(());
            }
        }
    }

    fn connect(&self) -> Result<UnixStream> {
        UnixStream::connect(&self.socket).with_context(|| {
            format!(
                "no daemon answers on {} (is `limiter daemon` running? root only)",
                self.socket.display()
            )
        })
    }

    /// Sends one request and returns the daemon's reply, or its error.
    fn call<T: DeserializeOwned>(&self, request: &Request) -> Result<T> {
        let stream = self.connect()?;
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
        serde_json::from_value(reply(&answer)?)
            .context("the daemon's reply has an unexpected shape")
    }
}

/// The result in one of the daemon's response lines, or its error.
fn reply(answer: &str) -> Result<serde_json::Value> {
    let response: Response = serde_json::from_str(answer)
        .with_context(|| format!("the daemon's answer is not a response: {answer:?}"))?;
    if !response.ok {
        bail!(
            "{}",
            response
                .error
                .unwrap_or_else(|| "the daemon refused without saying why".into())
        );
    }
    Ok(response.result.unwrap_or(serde_json::Value::Null))
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
