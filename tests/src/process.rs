//! The `limiter` binary as a child process: where it is (or built from
//! this tree), `limiter run` started and stopped, and the signals and
//! waits every child of the tests needs.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use limiter::lab::{self, Lab};

use crate::fixtures::TempDir;

/// How long a `limiter run` or `limiter daemon` may take to start
/// enforcing: 20 s, or `LIMITER_TEST_START_SECS` (the kernel matrix's
/// guests verify the program about a hundred times slower than a host).
pub fn start_timeout() -> Duration {
    let secs = std::env::var("LIMITER_TEST_START_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    Duration::from_secs(secs)
}

/// The `limiter` binary under test (`cargo xtask test` says where). With
/// `LIMITER_TESTS_BUILD_BIN` set (`cargo xtask mutants`), built first from
/// the tree this crate was built in, in a target directory of its own
/// (the `cargo test` running this holds the workspace's).
pub fn limiter_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("LIMITER_BIN") {
        return path.into();
    }
    if std::env::var_os("LIMITER_TESTS_BUILD_BIN").is_some() {
        return built_bin().clone();
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/limiter");
    assert!(
        path.exists(),
        "no limiter binary: run the tests with `cargo xtask test`"
    );
    path
}

/// `limiter` built from this tree, once per test process.
fn built_bin() -> &'static PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let target = root.join("target/tests-bin");
        let status = Command::new("cargo")
            .current_dir(&root)
            .args([
                "build",
                "--quiet",
                "--package",
                "limiter-userspace",
                "--bin",
                "limiter",
                // The crash points of the fault tests, as `cargo xtask
                // test` builds it.
                "--features",
                "faults",
            ])
            .arg("--target-dir")
            .arg(&target)
            .status()
            .expect("running cargo build for the limiter binary");
        assert!(status.success(), "building the limiter binary failed");
        target.join("debug/limiter")
    })
}

/// Runs `limiter` with `args` in the network namespace `netns` (if any),
/// sharing our mount namespace so its pins are visible to us.
pub fn limiter_command(netns: Option<&str>, args: &[&str]) -> Command {
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{ns}")).arg(limiter_bin());
            c
        }
        None => Command::new(limiter_bin()),
    };
    command.args(args).stdin(Stdio::null());
    command
}

/// A `limiter run` child process; interrupted (SIGINT) and reaped on drop.
pub struct RunningLimiter {
    child: Option<Child>,
    pub pin_dir: PathBuf,
    log: PathBuf,
}

impl RunningLimiter {
    /// Starts `limiter run` and waits until its maps are pinned.
    pub fn start(
        netns: &str,
        ifaces: &[&str],
        config: &Path,
        pin_dir: &Path,
        log: PathBuf,
    ) -> Result<Self> {
        Self::start_with(netns, ifaces, config, pin_dir, log, &[])
    }

    /// `limiter run` on the lab's receiving interface with the rule file
    /// `config`, logging to `run.log` in `dir`.
    pub fn on_receiver(lab: &Lab, dir: &TempDir, config: &Path, pin_dir: &Path) -> Result<Self> {
        Self::start(
            lab.rx.name(),
            &[lab::RX_IFACE],
            config,
            pin_dir,
            dir.0.join("run.log"),
        )
    }

    /// [`RunningLimiter::start`] with more arguments for `limiter run`.
    pub fn start_with(
        netns: &str,
        ifaces: &[&str],
        config: &Path,
        pin_dir: &Path,
        log: PathBuf,
        extra: &[&str],
    ) -> Result<Self> {
        let log_file = fs::File::create(&log)?;
        let (config, pins) = (config.to_string_lossy(), pin_dir.to_string_lossy());
        let mut args = vec![
            "run",
            "--config",
            &config,
            "--mode",
            "native",
            "--pin-dir",
            &pins,
            "--interval",
            "1s",
        ];
        for iface in ifaces {
            args.extend(["--iface", iface]);
        }
        args.extend_from_slice(extra);
        let child = limiter_command(Some(netns), &args)
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .context("spawning limiter run")?;
        let mut running = Self {
            child: Some(child),
            pin_dir: pin_dir.to_owned(),
            log,
        };
        let deadline = Instant::now() + start_timeout();
        // It prints this once every interface is attached.
        while !running.output().contains("limiter: enforcing") {
            if let Some(status) = running.child.as_mut().expect("child").try_wait()? {
                bail!(
                    "limiter run exited ({status}) before attaching:\n{}",
                    running.output()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "limiter run did not attach within {} s:\n{}",
                    start_timeout().as_secs(),
                    running.output()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(running)
    }

    /// Everything it printed so far.
    pub fn output(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGINT and waits for a clean exit; returns its output.
    pub fn stop(mut self) -> Result<String> {
        let status = self.interrupt()?;
        if !status.success() {
            bail!("limiter run exited with {status}:\n{}", self.output());
        }
        Ok(self.output())
    }

    fn interrupt(&mut self) -> Result<std::process::ExitStatus> {
        let child = self.child.take().context("already stopped")?;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        wait_for_exit(child, "limiter run ignored SIGINT for 10 s")
    }
}

/// Waits up to 10 s for a child to exit; kills it and fails after.
pub(crate) fn wait_for_exit(mut child: Child, failure: &str) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{failure}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for RunningLimiter {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.interrupt();
        }
        // If it died before cleaning up (a failed test), do it for it.
        let _ = fs::remove_dir_all(&self.pin_dir);
    }
}

/// Runs `command` with `input` on its stdin; what it printed and how it
/// ended.
pub fn piped(command: &mut Command, input: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?}: {e} (cargo xtask setup installs it)"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("writing stdin");
    child.wait_with_output().expect("waiting")
}

/// Sends SIGHUP (re-read the rule file) to a child of ours.
pub(crate) fn hang_up(child: &Child) {
    // SAFETY: a signal to a child of ours, still running (not reaped).
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGHUP) };
    assert_eq!(sent, 0, "kill -HUP failed");
}

/// `limiter run` on the lab's receiving side with `rules` (written to
/// `dir`), its pins under `/sys/fs/bpf/limiter-test-{name}`.
pub fn run_in_lab(lab: &Lab, dir: &TempDir, name: &str, rules: &str) -> RunningLimiter {
    let config = dir.write("rules.yaml", rules);
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/limiter-test-{name}"));
    RunningLimiter::start(
        lab.rx.name(),
        &[lab::RX_IFACE],
        &config,
        &pin_dir,
        dir.0.join("run.log"),
    )
    .expect("limiter run")
}
