//! Helpers for the root-only integration tests: rule files, crafted frames,
//! the `limiter` binary run as a child process, and the bounds the tests
//! hold the limiter to.

pub mod frames;
pub mod generator;
pub mod nginx;
pub mod stack;
pub mod xlated;

pub use limiter_conformance::{reference, traces};

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::programs::{TestRun, TestRunOptions};
use limiter::lab::{self, FloodReport, FloodSource, Lab};
use limiter::{
    engine::Engine,
    kernel::Mode,
    kernel::{
        Datapath,
        counters::{self, Snapshot},
    },
    rules::RuleSet,
    session::Session,
};
use std::{collections::HashMap, net::IpAddr};

/// BPF_PROG_TEST_RUN's verdicts.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// The limiter in this process (`Session::start`) on the lab's receiving
/// interface in `mode`, started from inside the receiver's namespace, its
/// maps pinned at `pin_dir`.
pub fn session_on_receiver(lab: &Lab, set: &RuleSet, mode: Mode, pin_dir: &str) -> Session {
    lab.rx
        .enter(|| Session::start(set, &[lab::RX_IFACE.to_owned()], mode, Path::new(pin_dir)))
        .expect("entering the namespace")
        .expect("starting the limiter")
}

/// xorshift64*: a test's random choices, the same for the same seed (a
/// nonzero one), so a failure is reproduced from the seed it prints.
pub struct Rng(pub u64);

impl Rng {
    pub fn word(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.word() % n.max(1) as u64) as usize
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

/// Parses rule-file text (panicking with the error: a test bug).
pub fn rules(text: &str) -> RuleSet {
    RuleSet::parse(text, Path::new("test.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

/// A layer-7 request from `client`, known by its address alone (no port,
/// key, body or HTTP fields).
pub fn request_from(client: IpAddr) -> limiter::http::RequestMeta<'static> {
    limiter::http::RequestMeta {
        client,
        port: None,
        key: None,
        bytes: 0,
        http: None,
    }
}

/// The program loaded with a rule set, unattached (for BPF_PROG_TEST_RUN),
/// its maps pinned in a directory of its own that is removed on drop.
pub struct Loaded {
    // Field order is drop order: unload, then remove the pins.
    pub engine: Engine,
    _pins: PinDir,
}

/// A pin directory removed on drop, also when loading fails half-way
/// (the maps are pinned before the verifier has its say).
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

impl Loaded {
    /// Where its maps are pinned.
    pub fn pin_dir(&self) -> &Path {
        &self._pins.0
    }
}

impl std::ops::Deref for Loaded {
    type Target = Datapath;
    fn deref(&self) -> &Datapath {
        self.engine.datapath()
    }
}

/// The verdict of the test build of the program (`test_clock_object`)
/// on `frame`, with its clock set to `monotonic`.
pub fn run_at(dp: &mut Loaded, frame: &[u8], monotonic: u64) -> u32 {
    set_clock(dp, monotonic);
    dp.program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
}

/// Sets the test build's clock (`test_clock_object`) to `monotonic`.
pub fn set_clock(dp: &mut Loaded, monotonic: u64) {
    dp.engine
        .datapath_mut()
        .maps_mut()
        .test_clock
        .as_mut()
        .expect("the test build has CLOCK")
        .set(0, monotonic, 0)
        .expect("setting the clock");
}

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

/// Loads the program with `text`'s rules: the build the `limiter` binary
/// embeds, or the one `LIMITER_TEST_OBJECT` names (`cargo xtask mutants`
/// builds each mutant of the program and runs these tests on it).
pub fn loaded(text: &str) -> Loaded {
    match std::env::var_os("LIMITER_TEST_OBJECT") {
        Some(path) => loaded_object(
            &fs::read(&path).unwrap_or_else(|e| panic!("LIMITER_TEST_OBJECT {path:?}: {e}")),
            text,
        ),
        None => loaded_object(limiter::kernel::OBJECT, text),
    }
}

/// The build of the program that reads its clock from the `CLOCK` map,
/// which this crate's build script makes from the same tree (or the one
/// `LIMITER_TEST_CLOCK_OBJECT` names, as `LIMITER_TEST_OBJECT`).
pub fn test_clock_object() -> Vec<u8> {
    let path = std::env::var_os("LIMITER_TEST_CLOCK_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../limiter-ebpf/target/test-clock/bpfel-unknown-none/release/limiter")
        });
    fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run the tests with `cargo xtask test`, which builds it)",
            path.display()
        )
    })
}

/// Loads a given build of the program with `text`'s rules.
pub fn loaded_object(object: &[u8], text: &str) -> Loaded {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = PathBuf::from(format!(
        "/sys/fs/bpf/limiter-test-{}-{n}",
        std::process::id()
    ));
    limiter::kernel::pins::ensure_bpffs().expect("bpffs");
    let _ = fs::remove_dir_all(&dir);
    let pins = PinDir(dir);
    let set = rules(text);
    let mut engine =
        Engine::open_object(object, &pins.0, set.max_keys).expect("loading the XDP program");
    engine.apply(set).expect("applying the rules");
    Loaded {
        engine,
        _pins: pins,
    }
}

pub fn snapshot(datapath: &Datapath) -> Snapshot {
    counters::read(datapath.maps()).expect("reading counters")
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
fn wait_for_exit(mut child: Child, failure: &str) -> Result<std::process::ExitStatus> {
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

/// Pins the calling thread to CPU `cpu` (per-CPU state in the kernel,
/// one sender per CPU).
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data, zero is an empty set; CPU_SET stays
    // inside it and the call only reads it.
    let result = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    anyhow::ensure!(
        result == 0,
        "pinning to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// The median of runs (the upper one of an even count).
pub fn median(runs: &[f64]) -> f64 {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
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

/// Asserts `got` is within `packets` of `expected`. Floods admitted by a
/// limit arrive exact to the packet or two (B + R × the flood's duration):
/// a tolerance well under the burst lets a wrong burst show.
#[track_caller]
pub fn assert_close(got: u64, expected: f64, packets: f64, what: &str) {
    let off = got as f64 - expected;
    assert!(
        off.abs() <= packets,
        "{what}: got {got}, expected {expected:.1} ± {packets} packets (off by {off:+.1})"
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
    lab.sources(pair, addrs, pps, payload)
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

/// The entry of rule `name` in `limiter stats --json` output.
pub fn stats_rule(stats: &serde_json::Value, name: &str) -> serde_json::Value {
    stats["rules"]
        .as_array()
        .expect("a rules array")
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no rule {name:?} in {stats}"))
        .clone()
}

/// Asserts a CLI run succeeded; returns its stdout.
#[track_caller]
pub fn ok(output: std::process::Output) -> String {
    assert!(
        output.status.success(),
        "exit {}: {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// One HTTP/1.0 GET with extra header lines from inside a namespace;
/// returns the status line and header block, and the body, whatever the
/// status.
pub fn http_request(
    ns: &limiter::lab::Netns,
    port: u16,
    path: &str,
    headers: &str,
) -> Result<(String, String)> {
    use std::io::{Read, Write};
    let (path, headers) = (path.to_owned(), headers.to_owned());
    ns.enter(move || -> Result<(String, String)> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "GET {path} HTTP/1.0\r\nHost: localhost\r\n{headers}\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("no HTTP header end")?;
        Ok((head.to_owned(), body.to_owned()))
    })?
}

/// One HTTP GET from inside a namespace; returns the body.
pub fn http_get(ns: &limiter::lab::Netns, port: u16, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let path = path.to_owned();
    ns.enter(move || -> Result<String> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        // HTTP/1.0: a plain body, no chunked encoding, closed at the end.
        write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("no HTTP header end")?;
        if head.split(' ').nth(1) != Some("200") {
            bail!("GET {path}: {head}");
        }
        Ok(body.to_owned())
    })?
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

/// One raw HTTP exchange: writes `bytes`, reads the answer to the end (or
/// 15 s).
pub fn exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    let _ = stream.write_all(bytes);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// The status code of an HTTP answer (`none` for no answer).
pub fn status(answer: &str) -> &str {
    answer.split_whitespace().nth(1).unwrap_or("none")
}

/// A `limiter proxy` child process, killed on drop.
pub struct Proxy {
    child: Child,
    pub addr: std::net::SocketAddr,
}

impl Proxy {
    /// Sends it SIGHUP (re-read the rule file).
    pub fn hang_up(&self) {
        hang_up(&self.child);
    }
}

/// The `Accept` field with which Prometheus asks for OpenMetrics.
pub const OPENMETRICS_ACCEPT: &str = "Accept: application/openmetrics-text;version=1.0.0\r\n";

/// Polls `what` every 50 ms until it holds; fails with `why` after 10 s.
pub fn wait_until(what: impl Fn() -> bool, why: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !what() {
        assert!(std::time::Instant::now() < deadline, "{why}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Sends SIGHUP (re-read the rule file) to a child of ours.
fn hang_up(child: &Child) {
    // SAFETY: a signal to a child of ours, still running (not reaped).
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGHUP) };
    assert_eq!(sent, 0, "kill -HUP failed");
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn proxy(config: &std::path::Path, upstream: &str, extra: &[&str]) -> Proxy {
    proxy_logging(config, upstream, extra, Stdio::null(), Stdio::null())
}

/// [`proxy`], what it prints (`--trace`) written to `out`.
pub fn proxy_printing(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    out: &std::path::Path,
) -> Proxy {
    let out = fs::File::create(out).expect("creating the proxy's output");
    proxy_logging(config, upstream, extra, Stdio::from(out), Stdio::null())
}

/// [`proxy`], its stdout a pipe nobody reads (a `--trace` reader that
/// stalls), its log (stderr) written to `log`.
pub fn proxy_unread(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    log: &std::path::Path,
) -> Proxy {
    proxy_logging_to(config, upstream, extra, Stdio::piped(), log)
}

/// [`proxy`], its log (stderr) written to `log`.
pub fn proxy_logged(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    log: &std::path::Path,
) -> Proxy {
    proxy_logging_to(config, upstream, extra, Stdio::null(), log)
}

fn proxy_logging_to(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    stdout: Stdio,
    log: &std::path::Path,
) -> Proxy {
    let log = fs::File::create(log).expect("creating the proxy's log");
    proxy_logging(config, upstream, extra, stdout, Stdio::from(log))
}

fn proxy_logging(
    config: &std::path::Path,
    upstream: &str,
    extra: &[&str],
    stdout: Stdio,
    stderr: Stdio,
) -> Proxy {
    let listen = free_loopback_addr();
    let mut args = vec![
        "proxy",
        "--listen",
        &listen,
        "--upstream",
        upstream,
        "--config",
    ];
    let config = config.to_string_lossy().into_owned();
    args.push(&config);
    args.extend_from_slice(extra);
    let child = limiter_command(None, &args)
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("proxy");
    let addr: std::net::SocketAddr = listen.parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the proxy did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Proxy { child, addr }
}

/// `127.0.0.1:PORT` with a port free a moment ago.
pub fn free_loopback_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    format!("127.0.0.1:{port}")
}

/// An upstream that answers "from upstream" to everything, on loopback.
pub async fn upstream() -> std::net::SocketAddr {
    use axum::{Router, routing::any};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/{*path}", any(|| async { "from upstream" }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The machine a benchmark ran on: CPU model, CPUs, kernel.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cpu}, {} CPUs, Linux {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel.trim()
    )
}

/// A layer-7 clock the test sets: monotonic and epoch time alike.
#[derive(Default)]
pub struct TestClock(pub std::sync::atomic::AtomicU64);

impl limiter::http::Clock for TestClock {
    fn monotonic_ns(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn epoch_ns(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Samples of an OpenMetrics exposition as parsed by the Prometheus
/// project's own Python parser: (name, labels, value).
pub fn parse_openmetrics(text: &str) -> Vec<(String, HashMap<String, String>, f64)> {
    let script = "import sys, json\n\
from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
out = [[s.name, s.labels, s.value] for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]\n\
print(json.dumps(out))\n";
    let out = piped(Command::new("python3").args(["-c", script]), text);
    assert!(
        out.status.success(),
        "the exposition does not parse: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("parser output")
}

/// Every line of a `--log-format json` log, each one JSON object.
pub fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
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

/// The verdict of a loaded program on `frame`, with its own clock.
pub fn verdict(datapath: &Datapath, frame: &[u8]) -> u32 {
    datapath
        .program()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        })
        .expect("BPF_PROG_TEST_RUN")
        .return_value
}

/// A TCP listener in the lab's receiving namespace that counts, itself,
/// the connections it accepts and the bytes it reads.
pub struct CountingListener {
    pub accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub received: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl CountingListener {
    /// Listens on `addr` (the receiver's side of the lab). The lab's
    /// arrival counters drop what they count: they are removed, so the
    /// segments reach the stack.
    pub fn start(lab: &Lab, addr: std::net::SocketAddr) -> Self {
        use std::sync::{Arc, atomic::Ordering};
        lab.rx
            .exec("nft", &["delete", "table", "netdev", "limiter_lab"])
            .expect("nft");
        let listener = lab
            .rx
            .enter(|| std::net::TcpListener::bind(addr))
            .expect("netns")
            .expect("bind");
        let counting = Self {
            accepted: Default::default(),
            received: Default::default(),
        };
        let (accepted, received) = (
            Arc::clone(&counting.accepted),
            Arc::clone(&counting.received),
        );
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                accepted.fetch_add(1, Ordering::SeqCst);
                let received = Arc::clone(&received);
                thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    while let Ok(n) = std::io::Read::read(&mut stream, &mut buf) {
                        if n == 0 {
                            break;
                        }
                        received.fetch_add(n as u64, Ordering::SeqCst);
                    }
                });
            }
        });
        counting
    }

    /// Waits until it has read `bytes` in all (panics after 10 s).
    pub fn wait_received(&self, bytes: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.received.load(std::sync::atomic::Ordering::SeqCst) < bytes {
            assert!(Instant::now() < deadline, "the data did not arrive");
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A TCP connection from the lab's sending namespace.
pub fn connect_from_sender(
    lab: &Lab,
    addr: std::net::SocketAddr,
    timeout: Duration,
) -> std::io::Result<std::net::TcpStream> {
    lab.tx
        .enter(|| std::net::TcpStream::connect_timeout(&addr, timeout))
        .expect("netns")
}

/// `limiter proxy` in front of a fresh upstream, with `rules`; the
/// directory holding them lives as long as it is kept.
pub async fn proxy_for(name: &str, rules: &str, extra: &[&str]) -> (Proxy, TempDir) {
    let upstream = format!("http://{}", upstream().await);
    let dir = TempDir::new(name);
    let config = dir.write("rules.yaml", rules);
    (proxy(&config, &upstream, extra), dir)
}
