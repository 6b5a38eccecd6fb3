//! A `limiter daemon` child process in a lab's receiving namespace, with
//! its own pin directory, socket and metrics port.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use limiter::lab::Lab;

use crate::fixtures::TempDir;
use crate::process::{hang_up, limiter_bin, limiter_command, start_timeout, wait_for_exit};

/// A `limiter daemon` child process in a lab's receiving namespace, with
/// its own pin directory, socket and metrics port. Dropping it kills the
/// process and detaches whatever it left behind.
pub struct Daemon {
    child: Option<Child>,
    pub dir: TempDir,
    pub pin_dir: PathBuf,
    pub socket: PathBuf,
    pub metrics_port: u16,
    netns: String,
    starts: usize,
    /// A command the daemon runs under (`setpriv ...`), if any.
    wrapper: Vec<String>,
    /// More arguments for `limiter daemon`.
    args: Vec<String>,
}

impl Daemon {
    /// Writes a daemon config for `iface` and `rules`, and starts it.
    pub fn start(lab: &Lab, name: &str, ifaces: &[&str], rules: &str) -> Result<Self> {
        Self::start_with(lab, name, ifaces, rules, "", &[])
    }

    /// [`Daemon::start`] with more lines of daemon configuration, under
    /// `wrapper` (a command that execs the rest of its arguments).
    pub fn start_with(
        lab: &Lab,
        name: &str,
        ifaces: &[&str],
        rules: &str,
        extra_config: &str,
        wrapper: &[String],
    ) -> Result<Self> {
        let dir = TempDir::new(name);
        dir.write("rules.yaml", rules);
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/limiter-test-{name}"));
        // In a directory the daemon makes (0700), as /run/limiter is.
        let socket = dir.0.join("run").join("control.sock");
        let metrics_port = 19400 + (std::process::id() % 500) as u16;
        let interfaces: Vec<String> = ifaces
            .iter()
            .map(|i| format!("{{ name: {i}, mode: native }}"))
            .collect();
        dir.write(
            "daemon.yaml",
            &format!(
                "rules: rules.yaml\ninterfaces: [{}]\npin_dir: {}\nsocket: {}\nmetrics: 127.0.0.1:{metrics_port}\n{extra_config}",
                interfaces.join(", "),
                pin_dir.display(),
                socket.display()
            ),
        );
        let _ = datapath_detach(&pin_dir);
        let mut daemon = Self {
            child: None,
            dir,
            pin_dir,
            socket,
            metrics_port,
            netns: lab.rx.name().to_owned(),
            starts: 0,
            wrapper: wrapper.to_vec(),
            args: Vec::new(),
        };
        daemon.spawn()?;
        Ok(daemon)
    }

    /// Starts (again) with the same configuration; waits until it serves.
    pub fn spawn(&mut self) -> Result<()> {
        self.starts += 1;
        let log = fs::File::create(self.log_path())?;
        let config = self.dir.0.join("daemon.yaml");
        let limiter = limiter_bin();
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net=/run/netns/{}", self.netns))
            .args(&self.wrapper)
            .arg(limiter)
            .args(["daemon", "--config", &config.to_string_lossy()])
            .args(&self.args)
            .stdin(Stdio::null());
        let child = command
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning limiter daemon")?;
        self.child = Some(child);
        let deadline = Instant::now() + start_timeout();
        while !limiter::control::Client::new(&self.socket).daemon_running() {
            if let Some(status) = self.child.as_mut().expect("child").try_wait()? {
                bail!("limiter daemon exited ({status}):\n{}", self.log());
            }
            if Instant::now() > deadline {
                bail!(
                    "limiter daemon did not serve within {} s:\n{}",
                    start_timeout().as_secs(),
                    self.log()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.0.join(format!("daemon-{}.log", self.starts))
    }

    /// More arguments for the next [`Daemon::spawn`]'s `limiter daemon`.
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|a| (*a).to_owned()).collect();
    }

    /// The command the next [`Daemon::spawn`] runs the daemon under.
    pub fn set_wrapper(&mut self, wrapper: &[String]) {
        self.wrapper = wrapper.to_vec();
    }

    /// The daemon's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends it SIGHUP (re-read the rule file).
    pub fn hang_up(&self) {
        hang_up(self.child.as_ref().expect("the daemon is running"));
    }

    /// What the current process logged.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `kill -9`: no chance to clean up anything.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs a `limiter` subcommand against this daemon's socket.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let mut all: Vec<&str> = args.to_vec();
        let socket = self.socket.to_string_lossy().into_owned();
        let pin_dir = self.pin_dir.to_string_lossy().into_owned();
        match args[0] {
            "top" => all.extend(["--pin-dir", &pin_dir]),
            "stats" | "detach" => all.extend(["--pin-dir", &pin_dir, "--socket", &socket]),
            _ => all.extend(["--socket", &socket]),
        }
        limiter_command(None, &all)
            .output()
            .expect("running limiter")
    }

    /// Waits for the process to exit by itself (after `detach`).
    pub fn wait_exit(&mut self) -> Result<std::process::ExitStatus> {
        let child = self.child.take().context("not running")?;
        wait_for_exit(child, "the daemon did not exit within 10 s")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
        let _ = datapath_detach(&self.pin_dir);
    }
}

fn datapath_detach(pin_dir: &Path) -> Result<Vec<String>> {
    Ok(limiter::kernel::detach_all(pin_dir)?)
}
