//! Helpers for the root-only integration tests: rule files, crafted frames,
//! the `limiter` binary run as a child process, and the bounds the tests
//! hold the limiter to.

pub mod frames;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use limiter::lab::{self, FloodReport, FloodSource, Lab, udp_frame};
use limiter::{
    config::RuleSet,
    datapath::Datapath,
    engine::Engine,
    stats::{CounterMaps, Snapshot},
};
use std::{collections::HashMap, net::IpAddr};

/// Parses rule-file text (panicking with the error: a test bug).
pub fn rules(text: &str) -> RuleSet {
    RuleSet::parse(text, Path::new("test.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

/// The program loaded with a rule set, unattached (for BPF_PROG_TEST_RUN),
/// its maps pinned in a directory of its own that is removed on drop.
pub struct Loaded {
    pub engine: Engine,
    dir: PathBuf,
}

impl std::ops::Deref for Loaded {
    type Target = Datapath;
    fn deref(&self) -> &Datapath {
        self.engine.datapath()
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Loads the program with `text`'s rules.
pub fn loaded(text: &str) -> Loaded {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = PathBuf::from(format!(
        "/sys/fs/bpf/limiter-test-{}-{n}",
        std::process::id()
    ));
    limiter::pins::ensure_bpffs().expect("bpffs");
    let _ = fs::remove_dir_all(&dir);
    let set = rules(text);
    let mut engine = Engine::open(&dir, set.max_keys).expect("loading the XDP program");
    engine.apply(set).expect("applying the rules");
    Loaded { engine, dir }
}

pub fn snapshot(datapath: &Datapath) -> Snapshot {
    CounterMaps::from_datapath(datapath)
        .and_then(|m| m.read())
        .expect("reading counters")
}

/// A scratch directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("limiter-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("creating a temp dir");
        Self(dir)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, text).expect("writing a temp file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The `limiter` binary under test (`cargo xtask test` says where).
pub fn limiter_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("LIMITER_BIN") {
        return path.into();
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/limiter");
    assert!(
        path.exists(),
        "no limiter binary: run the tests with `cargo xtask test`"
    );
    path
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
        let deadline = Instant::now() + Duration::from_secs(20);
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
                    "limiter run did not attach within 20 s:\n{}",
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
        let mut child = self.child.take().context("already stopped")?;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("limiter run ignored SIGINT for 10 s");
            }
            thread::sleep(Duration::from_millis(20));
        }
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

/// Asserts `got` is within `percent` % of `expected`.
#[track_caller]
pub fn assert_within(got: u64, expected: f64, percent: f64, what: &str) {
    let error = (got as f64 - expected).abs() / expected * 100.0;
    assert!(
        error <= percent,
        "{what}: got {got}, expected {expected:.0} ± {percent}% (off by {error:.1}%)"
    );
}

/// Sources flooding at `pps` each with UDP frames of `payload` bytes, over
/// veth pair `pair`.
pub fn sources(
    lab: &Lab,
    pair: u8,
    addrs: &[IpAddr],
    pps: u64,
    payload: usize,
) -> Vec<FloodSource> {
    let target = lab.target(pair);
    addrs
        .iter()
        .map(|&addr| FloodSource {
            addr,
            frame: udp_frame(&target, addr, payload),
            pps,
        })
        .collect()
}

/// Floods over every given veth pair at once for `duration`, lets the last
/// frames land, and returns what was sent on each pair and what the
/// receiver counted per source (over all pairs).
pub fn flood_pairs(
    lab: &Lab,
    per_pair: &[(u8, Vec<FloodSource>)],
    duration: Duration,
) -> (Vec<FloodReport>, HashMap<IpAddr, u64>) {
    let reports = thread::scope(|scope| {
        let floods: Vec<_> = per_pair
            .iter()
            .map(|(pair, sources)| {
                let socket = lab.sender(*pair).expect("opening the sender");
                scope.spawn(move || {
                    lab::flood(&socket, sources, duration, |_| {}).expect("flooding")
                })
            })
            .collect();
        floods
            .into_iter()
            .map(|f| f.join().expect("flood thread"))
            .collect()
    });
    thread::sleep(Duration::from_millis(300));
    (
        reports,
        lab.received().expect("reading the receiver's counters"),
    )
}

/// [`flood_pairs`] over the first pair only.
pub fn flood(
    lab: &Lab,
    sources: &[FloodSource],
    duration: Duration,
) -> (FloodReport, HashMap<IpAddr, u64>) {
    let (mut reports, received) = flood_pairs(lab, &[(0, sources.to_vec())], duration);
    (reports.remove(0), received)
}

/// Whether any XDP program is attached to `iface` in `netns`.
pub fn xdp_attached(netns: &str, iface: &str) -> bool {
    let out = Command::new("ip")
        .args(["-n", netns, "-j", "link", "show", iface])
        .output()
        .expect("running ip");
    assert!(out.status.success(), "ip link show {iface} failed");
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    links[0].get("xdp").is_some()
}
