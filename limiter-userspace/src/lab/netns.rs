//! Network namespaces that we create, enter from one thread, and always
//! delete again.

use std::{
    fs::File,
    process::{Command, Stdio},
    thread,
};

use anyhow::{Context, Result, bail};

/// Runs a command, failing with its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program} (is it installed?)"))?;
    if !output.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A named network namespace (`ip netns`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `name`, replacing a leftover of the same name.
    pub fn create(name: &str) -> Result<Self> {
        let _ = run("ip", &["netns", "del", name]);
        run("ip", &["netns", "add", name])?;
        let ns = Self {
            name: name.to_owned(),
        };
        ns.exec("ip", &["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs a command inside the namespace.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String> {
        let mut full = vec!["netns", "exec", &self.name, program];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// Runs `f` on a thread that has entered the namespace; only that
    /// thread changes namespace, so the caller is unaffected. Sockets and
    /// XDP attachments made inside stay with the namespace.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        enter(&self.name, f)
    }
}

/// [`Netns::enter`] by name.
pub fn enter<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let path = format!("/run/netns/{name}");
    let file = File::open(&path).with_context(|| format!("opening {path}"))?;
    thread::scope(|scope| {
        scope
            .spawn(|| {
                // Affects this thread only.
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("entering network namespace {name}"))?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("thread in namespace {name} panicked"))?
    })
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run("ip", &["netns", "del", &self.name]) {
            eprintln!("warning: {e:#}");
        }
    }
}
