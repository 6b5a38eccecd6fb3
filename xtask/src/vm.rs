//! `cargo xtask vm`: programs run inside Debian's own kernels, under qemu.
//!
//! The host runs one kernel; the limiter is meant for the kernels of
//! Debian's releases. This boots one of them (Debian's cloud kernel
//! package, fetched through the mirror the host's own apt sources name)
//! with an initramfs of busybox, iproute2, nft, the requested files at
//! their host paths and the libraries they link, runs the commands one
//! after the other, and reads their exit codes back from marker lines on
//! the serial console.
//!
//! Kernels and their apt lists are kept in /var/cache/limiter-vm (or
//! `$LIMITER_VM_CACHE`), one directory per suite, outside the repository:
//! a fresh clone on the same machine boots them without fetching.
//!
//! One guest at a time, TCG only: under KVM a guest never gets past its
//! first instructions on these machines (nested virtualisation: `-cpu
//! host` fails to set MSR 0x10a, `-cpu qemu64` stops on an emulation
//! failure; checked 2026-12-03).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque},
    fmt::Write as _,
    fs::File,
    io::{BufRead, BufReader, BufWriter, Read, Write},
    os::unix::fs::PermissionsExt,
    path::{Component, Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};

/// A Debian kernel the guests can boot.
#[derive(Debug)]
pub struct Kernel {
    /// Its name on the command line, e.g. "6.1".
    pub name: &'static str,
    /// The Debian release that ships it, e.g. "12".
    pub debian: &'static str,
    /// That release's apt suite.
    pub suite: &'static str,
    /// The package's name, `*` standing for any run of characters (the
    /// ABI number changes with each update): the newest match is booted.
    pub package: &'static str,
}

/// The kernels of Debian 11, 12 and 13, oldest first.
pub const MATRIX: [Kernel; 3] = [
    Kernel {
        name: "5.10",
        debian: "11",
        suite: "bullseye",
        package: "linux-image-5.10.0-*-cloud-amd64-unsigned",
    },
    Kernel {
        name: "6.1",
        debian: "12",
        suite: "bookworm",
        package: "linux-image-6.1.0-*-cloud-amd64-unsigned",
    },
    Kernel {
        name: "6.12",
        debian: "13",
        suite: "trixie",
        // `+deb13.1`-style rebuilds included.
        package: "linux-image-6.12.*+deb13*-cloud-amd64-unsigned",
    },
];

/// The kernel of `MATRIX` called `name`.
pub fn kernel(name: &str) -> Result<&'static Kernel> {
    MATRIX.iter().find(|k| k.name == name).with_context(|| {
        let names: Vec<&str> = MATRIX.iter().map(|k| k.name).collect();
        format!("no kernel {name:?}; known: {}", names.join(", "))
    })
}

/// Modules every guest loads: veth pairs, and nftables with what the
/// lab's arrival counters use (sets with counters, in the netdev family).
/// Debian's cloud kernels build network namespaces, BPF and XDP in, and
/// these as modules. A trailing `?` marks a module loaded only where the
/// kernel has it: nft_counter is one of its own on 5.10, part of
/// nf_tables.ko since. (Nothing loads modules on demand in a guest.)
pub const DEFAULT_MODULES: [&str; 3] = ["veth", "nf_tables", "nft_counter?"];

/// What a guest holds and runs.
#[derive(Debug, Clone)]
pub struct Guest {
    /// Host files, copied into the guest at the same absolute path (test
    /// binaries read `CARGO_MANIFEST_DIR`-relative paths); a directory
    /// brings its whole tree. ELF files bring the libraries `ldd` lists.
    pub files: Vec<PathBuf>,
    /// Environment of every command.
    pub env: Vec<(String, String)>,
    /// Kernel modules to load (with their dependencies, first); `NAME?`
    /// only where the kernel has it (see `DEFAULT_MODULES`).
    pub modules: Vec<String>,
    /// Run one after the other, in this order.
    pub commands: Vec<GuestCommand>,
    /// The guest's memory, at least: the initramfs (every file above)
    /// lives in it, and more is given when that needs it.
    pub memory_mib: u32,
    /// Print the console as it comes (the commands' output included).
    pub echo: bool,
    /// Keep the work directory (initramfs, console log, qemu command line).
    pub keep: bool,
    /// The whole run's limit; by default the commands' timeouts plus
    /// `BOOT_ALLOWANCE` and a little per command.
    pub overall_timeout: Option<Duration>,
}

impl Default for Guest {
    fn default() -> Self {
        Self {
            files: Vec::new(),
            env: Vec::new(),
            modules: DEFAULT_MODULES.iter().map(|m| (*m).to_owned()).collect(),
            commands: Vec::new(),
            memory_mib: 2048,
            echo: false,
            keep: false,
            overall_timeout: None,
        }
    }
}

/// One program run in the guest.
#[derive(Debug, Clone)]
pub struct GuestCommand {
    /// Its name in reports.
    pub name: String,
    /// Program and arguments; the program is looked up on the guest's
    /// PATH (the host's directories, then busybox's applets).
    pub argv: Vec<String>,
    /// Killed (with whatever it started) after this long.
    pub timeout: Duration,
    /// Its working directory (cargo runs a test binary in its package's
    /// directory); `/` by default.
    pub cwd: Option<PathBuf>,
}

impl GuestCommand {
    pub fn new(
        name: impl Into<String>,
        argv: impl IntoIterator<Item = impl Into<String>>,
        timeout: Duration,
    ) -> Self {
        Self {
            name: name.into(),
            argv: argv.into_iter().map(Into::into).collect(),
            timeout,
            cwd: None,
        }
    }
}

/// How one command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Its exit code; 128 + N when signal N killed it.
    Exited(i32),
    /// It ran past its own timeout and was killed.
    TimedOut,
    /// The guest died or was stopped while it ran.
    Lost,
    /// The guest never got to it.
    NotRun,
}

#[derive(Debug, Clone)]
// The command line shows the output as it comes; `output` is for callers
// that run many commands and report the failed ones'.
#[allow(dead_code)]
pub struct CommandOutcome {
    pub status: Status,
    pub elapsed: Duration,
    /// The last `OUTPUT_LINES` lines it printed (stdout and stderr both;
    /// kernel messages printed meanwhile among them).
    pub output: Vec<String>,
    /// How many earlier lines were left out of `output`.
    pub dropped_lines: usize,
}

impl CommandOutcome {
    pub fn success(&self) -> bool {
        self.status == Status::Exited(0)
    }
}

/// How the guest ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestEnd {
    /// It ran every command and powered off.
    PoweredOff,
    /// It ran past the overall timeout and was killed.
    TimedOut(Duration),
    /// qemu ended before the guest was done (a panic reboots, and
    /// `-no-reboot` makes that an exit).
    Died(String),
}

/// A guest's run.
#[derive(Debug)]
pub struct Run {
    /// The guest's `uname -r`, once it booted.
    pub release: Option<String>,
    /// From starting qemu to the guest's first command (modules loaded).
    pub boot: Option<Duration>,
    pub outcomes: Vec<(String, CommandOutcome)>,
    pub end: GuestEnd,
    /// The modules loaded, in order (dependencies first; those built
    /// into this kernel are not among them).
    pub modules: Vec<String>,
    /// Modules that did not load, and the like.
    pub warnings: Vec<String>,
    /// The console's last lines, kernel messages included.
    pub console_tail: Vec<String>,
    /// The work directory, when kept.
    pub workdir: Option<PathBuf>,
}

impl Run {
    /// Whether the guest ran every command and each exited 0.
    pub fn success(&self) -> bool {
        self.end == GuestEnd::PoweredOff && self.outcomes.iter().all(|(_, o)| o.success())
    }
}

/// Lines kept of each command's output, and of the console.
pub const OUTPUT_LINES: usize = 200;

/// Booting and loading modules under TCG, at most (6.12 boots in about
/// 6 s; module loading is slower on a busy host).
pub const BOOT_ALLOWANCE: Duration = Duration::from_secs(120);

/// Boots `kernel` with `guest`'s files and runs its commands. An error
/// means the guest could not be prepared or started; how the guest and
/// its commands ended is in the `Run`.
pub fn run(kernel: &Kernel, guest: &Guest) -> Result<Run> {
    crate::setup::vm_packages()?;
    let unpacked = unpack(kernel)?;
    let workdir = WorkDir::create(guest.keep)?;
    let nonce = nonce();
    let modules = resolve_modules(&unpacked, &guest.modules)?;
    if guest.echo {
        let names: Vec<&str> = modules.iter().map(|(name, _)| name.as_str()).collect();
        println!(
            "xtask: booting {} with modules: {}",
            unpacked.release,
            names.join(" ")
        );
    }
    let initramfs = workdir.path.join("initramfs.cpio");
    write_initramfs(&initramfs, guest, &unpacked, &modules, &nonce)
        .with_context(|| format!("writing {}", initramfs.display()))?;
    let qemu = qemu_command(
        &unpacked.vmlinuz,
        &initramfs,
        memory_mib(guest, &initramfs)?,
    );
    if guest.keep {
        let line = format!("{qemu:?}\n");
        std::fs::write(workdir.path.join("qemu-command"), line)?;
    }
    let limit = guest
        .overall_timeout
        .unwrap_or_else(|| overall_timeout(guest));
    let mut run = watch(
        qemu,
        guest,
        &nonce,
        limit,
        &workdir.path.join("console.log"),
    )
    .with_context(|| format!("running the {} guest", kernel.name))?;
    run.workdir = guest.keep.then(|| workdir.path.clone());
    run.modules = modules.into_iter().map(|(name, _)| name).collect();
    Ok(run)
}

/// `guest.memory_mib`, or more for a large initramfs: the kernel keeps
/// the archive in memory while it unpacks it into the rootfs, which is
/// memory too, and the programs need some of their own.
fn memory_mib(guest: &Guest, initramfs: &Path) -> Result<u32> {
    let archive = std::fs::metadata(initramfs)?.len() >> 20;
    let needed = u32::try_from(2 * archive + 1024).context("an initramfs of terabytes")?;
    Ok(guest.memory_mib.max(needed))
}

fn overall_timeout(guest: &Guest) -> Duration {
    let per_command = Duration::from_secs(10);
    guest
        .commands
        .iter()
        .map(|c| c.timeout + per_command)
        .sum::<Duration>()
        + BOOT_ALLOWANCE
}

// ---------------------------------------------------------------------
// The command line.

#[derive(clap::Args)]
pub struct Options {
    /// A kernel of the matrix (5.10, 6.1, 6.12), or `all`: one after the other.
    #[arg(long, default_value = "6.1")]
    kernel: String,
    /// A host file or directory to copy in, at the same path (repeatable).
    /// The command's program comes along when it is a host file or on the
    /// host's PATH.
    #[arg(long = "file", value_name = "PATH")]
    files: Vec<PathBuf>,
    /// NAME=VALUE in the command's environment (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// A module to load besides the usual (veth, nf_tables), with its
    /// dependencies (repeatable).
    #[arg(long = "module", value_name = "NAME")]
    modules: Vec<String>,
    /// Seconds the command may run.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// The command's working directory in the guest.
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Keep the work directory (initramfs, console log, qemu command line).
    #[arg(long)]
    keep: bool,
    /// Seconds the whole guest may run (default: the command's timeout
    /// and two minutes to boot).
    #[arg(long, value_name = "SECS")]
    guest_timeout: Option<u64>,
    /// The command and its arguments; `cat /proc/version` by default.
    #[arg(last = true)]
    command: Vec<String>,
}

/// `cargo xtask vm`: the command in each kernel asked for, its output
/// shown as it comes; fails unless it exits 0 in every one.
pub fn cli(options: &Options) -> Result<()> {
    let kernels: Vec<&Kernel> = if options.kernel == "all" {
        MATRIX.iter().collect()
    } else {
        vec![kernel(&options.kernel)?]
    };
    let guest = cli_guest(options)?;
    let mut failed = Vec::new();
    let mut summary = Vec::new();
    for kernel in kernels {
        crate::step(&format!(
            "guest: Debian {} ({}), kernel {}",
            kernel.debian, kernel.suite, kernel.name
        ));
        let run = run(kernel, &guest)?;
        report(&run);
        let boot = run.boot.map_or("no boot".to_owned(), |b| {
            format!("booted in {:.1} s", b.as_secs_f64())
        });
        let (_, outcome) = &run.outcomes[0];
        summary.push(format!(
            "{:>5}  {}  {boot}, {:?} after {:.1} s",
            kernel.name,
            run.release.as_deref().unwrap_or("?"),
            outcome.status,
            outcome.elapsed.as_secs_f64()
        ));
        if !run.success() {
            failed.push(kernel.name);
        }
    }
    println!("\nxtask: vm summary\n{}", summary.join("\n"));
    if !failed.is_empty() {
        bail!("failed in kernel {}", failed.join(", "));
    }
    Ok(())
}

fn cli_guest(options: &Options) -> Result<Guest> {
    let argv = if options.command.is_empty() {
        vec!["cat".to_owned(), "/proc/version".to_owned()]
    } else {
        options.command.clone()
    };
    let mut files = options.files.clone();
    // The program itself: a host file, or what the host's PATH finds
    // (else the guest's PATH finds it, or busybox's applet of that name).
    let program = Path::new(&argv[0]);
    if program.is_absolute() {
        files.push(program.to_owned());
    } else if !options.command.is_empty()
        && let Some(found) = crate::setup::which(&argv[0])
    {
        files.push(found);
    }
    let env = options
        .env
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("--env {pair}: not NAME=VALUE"))
        })
        .collect::<Result<_>>()?;
    let mut modules = Guest::default().modules;
    modules.extend(options.modules.iter().cloned());
    let mut command = GuestCommand::new(argv.join(" "), argv, Duration::from_secs(options.timeout));
    command.cwd.clone_from(&options.cwd);
    Ok(Guest {
        files,
        env,
        modules,
        commands: vec![command],
        echo: true,
        keep: options.keep,
        overall_timeout: options.guest_timeout.map(Duration::from_secs),
        ..Guest::default()
    })
}

/// What the console showed does not need repeating; how the guest ended does.
fn report(run: &Run) {
    for warning in &run.warnings {
        println!("xtask: guest warning: {warning}");
    }
    match &run.end {
        GuestEnd::PoweredOff => {}
        GuestEnd::TimedOut(limit) => {
            println!(
                "xtask: the guest ran past {limit:?} and was killed; its console's last lines:"
            );
            print_tail(&run.console_tail);
        }
        GuestEnd::Died(why) => {
            println!("xtask: the guest died: {why}; its console's last lines:");
            print_tail(&run.console_tail);
        }
    }
    if let Some(dir) = &run.workdir {
        println!("xtask: kept {}", dir.display());
    }
}

fn print_tail(lines: &[String]) {
    for line in &lines[lines.len().saturating_sub(30)..] {
        println!("    {line}");
    }
}

// ---------------------------------------------------------------------
// Kernels: Debian's packages, in a cache outside the repository.

/// Where kernels and apt lists are kept, per suite: outside the
/// repository, so a fresh clone on the same machine reuses them.
fn cache_root() -> PathBuf {
    std::env::var_os("LIMITER_VM_CACHE")
        .map_or_else(|| PathBuf::from("/var/cache/limiter-vm"), PathBuf::from)
}

/// A kernel package unpacked in the cache.
struct Unpacked {
    /// Its `uname -r`.
    release: String,
    vmlinuz: PathBuf,
    /// `lib/modules/<release>` inside it.
    modules: PathBuf,
    /// Where modules are kept decompressed.
    decompressed: PathBuf,
}

/// The newest package of `kernel` that the cache has unpacked, or else
/// the newest the mirror serves, downloaded and unpacked once. The lists
/// are fetched only when missing (then what is unpacked stays what is
/// booted), or when no package they name can be downloaded any more
/// (kernel updates replace their predecessors).
fn unpack(kernel: &Kernel) -> Result<Unpacked> {
    let apt = Apt::open(kernel.suite)?;
    let mut refreshed = !apt.has_lists();
    if refreshed {
        apt.update()?;
    }
    loop {
        let candidates = apt.candidates(kernel.package)?;
        let unpacked = candidates
            .iter()
            .map(|package| apt.dir.join(package))
            .find(|dir| dir.join(COMPLETE).exists());
        if let Some(dir) = unpacked {
            return Unpacked::find(&dir);
        }
        // A mirror may lack some (this machine's answers 404 for every
        // bullseye-security kernel): the next newest, then.
        let mut failure = None;
        for package in &candidates {
            crate::step(&format!(
                "fetching {package} (Debian {}, {})",
                kernel.debian, kernel.suite
            ));
            let dir = apt.dir.join(package);
            match apt.download_and_unpack(package, &dir) {
                Ok(()) => {
                    apt.remove_other_kernels(package);
                    return Unpacked::find(&dir);
                }
                Err(e) => {
                    println!("xtask: {e:#}");
                    failure = Some(e);
                }
            }
        }
        let failure = failure.context("no package to fetch")?;
        if refreshed {
            return Err(failure.context(format!("fetching a {} kernel", kernel.name)));
        }
        apt.update()?;
        refreshed = true;
    }
}

/// Marks a completely unpacked package directory.
const COMPLETE: &str = ".complete";

impl Unpacked {
    fn find(dir: &Path) -> Result<Self> {
        let boot = dir.join("boot");
        let vmlinuz = read_dir(&boot)?
            .into_iter()
            .find(|p| file_name(p).starts_with("vmlinuz-"))
            .with_context(|| format!("no vmlinuz-* in {}", boot.display()))?;
        let release = file_name(&vmlinuz)["vmlinuz-".len()..].to_owned();
        // bullseye's packages predate the merged /usr.
        let modules = ["usr/lib/modules", "lib/modules"]
            .iter()
            .map(|base| dir.join(base).join(&release))
            .find(|p| p.is_dir())
            .with_context(|| format!("no lib/modules/{release} in {}", dir.display()))?;
        Ok(Self {
            release,
            vmlinuz,
            modules,
            decompressed: dir.join("decompressed-modules"),
        })
    }
}

/// apt with a state of its own for one suite: the host's mirrors, another
/// release, nothing of the host's own apt state touched.
struct Apt {
    /// `<cache>/<suite>`
    dir: PathBuf,
}

impl Apt {
    fn open(suite: &str) -> Result<Self> {
        let dir = cache_root().join(suite);
        for sub in ["lists/partial", "apt/archives/partial"] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path)
                .with_context(|| format!("creating {}", path.display()))?;
        }
        let list = host_sources(suite)?;
        std::fs::write(dir.join("sources.list"), list)
            .with_context(|| format!("writing {}", dir.join("sources.list").display()))?;
        Ok(Self { dir })
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        let d = |sub: &str| self.dir.join(sub).display().to_string();
        for option in [
            format!("Dir::Etc::SourceList={}", d("sources.list")),
            "Dir::Etc::SourceParts=/dev/null".to_owned(),
            format!("Dir::State::Lists={}", d("lists")),
            format!("Dir::Cache={}", d("apt")),
            // The cache belongs to root; apt's `_apt` user may not write it.
            "APT::Sandbox::User=root".to_owned(),
        ] {
            command.arg("-o").arg(option);
        }
        command
    }

    fn has_lists(&self) -> bool {
        read_dir(&self.dir.join("lists"))
            .is_ok_and(|files| files.iter().any(|p| file_name(p).contains("_Packages")))
    }

    fn update(&self) -> Result<()> {
        crate::step(&format!(
            "apt lists of {} (kept in {})",
            file_name(&self.dir),
            self.dir.display()
        ));
        quiet(self.command("apt-get").args(["-q", "update"]))
    }

    /// The packages whose names match `pattern`, newest first.
    fn candidates(&self, pattern: &str) -> Result<Vec<String>> {
        let out = captured(
            self.command("apt-cache")
                .args(["search", "--names-only"])
                .arg(glob_regex(pattern)),
        )?;
        let mut names: Vec<&str> = out
            .lines()
            .filter_map(|line| line.split(" - ").next())
            .filter(|name| glob_match(pattern, name))
            .collect();
        if names.is_empty() {
            bail!("no package matches {pattern} in {}", self.dir.display());
        }
        names.sort_by_cached_key(|name| std::cmp::Reverse(natural_key(name)));
        Ok(names.into_iter().map(str::to_owned).collect())
    }

    /// Downloads `package` and unpacks it into `dir` (through a temporary
    /// directory, so an interrupted run leaves no half-unpacked kernel).
    fn download_and_unpack(&self, package: &str, dir: &Path) -> Result<()> {
        let partial = self.dir.join(format!("{package}.partial"));
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial)?;
        let out = self
            .command("apt-get")
            .args(["-q", "download", package])
            .current_dir(&partial)
            .output()
            .context("starting apt-get download")?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = stderr.lines().rfind(|l| l.starts_with("E:")).unwrap_or("");
            bail!("apt-get download {package} failed: {why}");
        }
        let deb = read_dir(&partial)?
            .into_iter()
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .context("apt-get download left no .deb")?;
        let root = partial.join("root");
        quiet(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        std::fs::write(root.join(COMPLETE), "")?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&root, dir)
            .with_context(|| format!("moving the unpacked kernel to {}", dir.display()))?;
        let _ = std::fs::remove_dir_all(&partial);
        Ok(())
    }

    /// Earlier kernels of this suite (about 150 MB each unpacked).
    fn remove_other_kernels(&self, keep: &str) {
        for dir in read_dir(&self.dir).unwrap_or_default() {
            let name = file_name(&dir);
            if name.starts_with("linux-image-") && name != keep && dir.is_dir() {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

/// The host's Debian mirrors (the `URIs:` of its deb822 sources), as
/// one-line sources for `suite`: each suite of the host's release renamed
/// to `suite`'s (`bookworm-security` becomes `trixie-security`).
fn host_sources(suite: &str) -> Result<String> {
    const SOURCES: &str = "/etc/apt/sources.list.d/debian.sources";
    let text = std::fs::read_to_string(SOURCES).with_context(|| format!("reading {SOURCES}"))?;
    let host = host_codename()?;
    let mut lines = BTreeSet::new();
    for stanza in text.split("\n\n") {
        let field = |name: &str| -> Vec<String> {
            stanza
                .lines()
                .filter_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .flat_map(|v| v.split_whitespace().map(str::to_owned))
                .collect()
        };
        // An inline key (not a path) is left out: apt's keyrings know
        // Debian's keys anyway.
        let options = match field("Signed-By").first() {
            Some(path) if path.starts_with('/') => format!("[signed-by={path}] "),
            _ => String::new(),
        };
        for uri in field("URIs") {
            for host_suite in field("Suites") {
                if let Some(rest) = host_suite.strip_prefix(&host) {
                    lines.insert(format!("deb {options}{uri} {suite}{rest} main\n"));
                }
            }
        }
    }
    if lines.is_empty() {
        bail!("{SOURCES} names no mirror of {host}'s suites");
    }
    Ok(lines.into_iter().collect())
}

/// The host's Debian codename (`bookworm`).
fn host_codename() -> Result<String> {
    let text = std::fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .filter(|v| !v.is_empty())
        .context("/etc/os-release has no VERSION_CODENAME")
}

/// `*` matches any run of characters; nothing else is special.
fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len())
                .filter(|&i| rest.is_char_boundary(i))
                .any(|i| glob_match(tail, &rest[i..]))
        }
    }
}

/// The glob as a POSIX regular expression for `apt-cache search`.
fn glob_regex(pattern: &str) -> String {
    let mut regex = String::from("^");
    for c in pattern.chars() {
        match c {
            '*' => regex.push_str(".*"),
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => regex.push(c),
            c => {
                regex.push('\\');
                regex.push(c);
            }
        }
    }
    regex.push('$');
    regex
}

/// Orders names as versions: runs of digits by value (6.12.10 after 6.12.9).
fn natural_key(name: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = name;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let (number, after) = rest.split_at(digits);
        let text_len = after.len()
            - after
                .trim_start_matches(|c: char| !c.is_ascii_digit())
                .len();
        let (text, after) = after.split_at(text_len);
        key.push((number.parse().unwrap_or(0), text.to_owned()));
        rest = after;
    }
    key
}

// ---------------------------------------------------------------------
// Modules.

/// `names` and the modules they depend on, dependencies first, as
/// decompressed files; those built into the kernel are left out.
fn resolve_modules(kernel: &Unpacked, names: &[String]) -> Result<Vec<(String, PathBuf)>> {
    let index = ModuleIndex::read(kernel)?;
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    for name in names {
        let (name, optional) = match name.strip_suffix('?') {
            Some(name) => (normalize(name), true),
            None => (normalize(name), false),
        };
        if optional && !index.files.contains_key(&name) {
            continue;
        }
        index.visit(kernel, &name, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// Module names, as the kernel compares them (`-` and `_` alike).
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

struct ModuleIndex {
    files: HashMap<String, PathBuf>,
    builtin: HashSet<String>,
}

impl ModuleIndex {
    /// The package has no modules.dep (depmod writes it at install): every
    /// module file is indexed by name, and `modinfo` gives dependencies.
    fn read(kernel: &Unpacked) -> Result<Self> {
        let mut files = HashMap::new();
        let mut dirs = vec![kernel.modules.join("kernel")];
        while let Some(dir) = dirs.pop() {
            for path in read_dir(&dir)? {
                if path.is_dir() {
                    dirs.push(path);
                } else if let Some(name) = module_name(&path) {
                    files.insert(name, path);
                }
            }
        }
        let builtin_list = kernel.modules.join("modules.builtin");
        let builtin = std::fs::read_to_string(&builtin_list)
            .with_context(|| format!("reading {}", builtin_list.display()))?
            .lines()
            .filter_map(|l| module_name(Path::new(l)))
            .collect();
        Ok(Self { files, builtin })
    }

    fn visit(
        &self,
        kernel: &Unpacked,
        name: &str,
        seen: &mut HashSet<String>,
        order: &mut Vec<(String, PathBuf)>,
    ) -> Result<()> {
        if self.builtin.contains(name) || !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let file = self.files.get(name).with_context(|| {
            format!(
                "kernel {} has no module {name} (neither a .ko nor built in)",
                kernel.release
            )
        })?;
        let ko = decompressed(kernel, name, file)?;
        let depends = captured(Command::new("modinfo").args(["-F", "depends"]).arg(&ko))?;
        for dependency in depends.trim().split(',').filter(|d| !d.is_empty()) {
            self.visit(kernel, &normalize(dependency), seen, order)?;
        }
        order.push((name.to_owned(), ko));
        Ok(())
    }
}

/// `veth` for `.../veth.ko`, `.ko.xz` or `.ko.zst`.
fn module_name(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let stem = [".ko", ".ko.xz", ".ko.zst"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))?;
    Some(normalize(stem))
}

/// The module as a plain `.ko` (busybox's insmod hands the file to the
/// kernel as it is; 6.12's are xz-compressed), decompressed once.
fn decompressed(kernel: &Unpacked, name: &str, file: &Path) -> Result<PathBuf> {
    let tool = match file.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        _ => return Ok(file.to_owned()),
    };
    let ko = kernel.decompressed.join(format!("{name}.ko"));
    if ko.exists() {
        return Ok(ko);
    }
    std::fs::create_dir_all(&kernel.decompressed)?;
    let partial = ko.with_extension("partial");
    let out = File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    quiet(Command::new(tool).arg("-dc").arg(file).stdout(out))?;
    std::fs::rename(&partial, &ko)?;
    Ok(ko)
}

// ---------------------------------------------------------------------
// The initramfs.

const INIT: &str = include_str!("../vm/init.sh");

/// Base files the guest gets unless the requested files bring their own.
const ETC: [(&str, &str); 4] = [
    ("/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
    ("/etc/group", "root:x:0:\n"),
    ("/etc/hosts", "127.0.0.1 localhost\n::1 localhost\n"),
    (
        "/etc/nsswitch.conf",
        "passwd: files\ngroup: files\nhosts: files\n",
    ),
];

/// Writes the guest's root: a newc cpio the kernel unpacks into its
/// rootfs. Written here rather than by `cpio`, so host files go in
/// straight from their paths and /dev/console needs no mknod.
fn write_initramfs(
    to: &Path,
    guest: &Guest,
    kernel: &Unpacked,
    modules: &[(String, PathBuf)],
    nonce: &str,
) -> Result<()> {
    let mut tree = Tree::default();
    for dir in ["/proc", "/sys", "/dev", "/run", "/tmp", "/root", "/vm/ko"] {
        tree.dir(Path::new(dir));
    }
    // The kernel opens it for init's output before init mounts devtmpfs.
    tree.insert("/dev/console", Entry::CharDevice(5, 1));
    tree.insert("/init", Entry::Bytes(INIT.as_bytes().to_vec(), 0o755));
    let busybox = crate::setup::which("busybox").context("busybox is not installed")?;
    tree.host_file_as(Path::new("/vm/busybox"), &busybox)?;
    for (name, ko) in modules {
        tree.host_file_as(&Path::new("/vm/ko").join(format!("{name}.ko")), ko)?;
    }
    // Where `bpftool feature probe` (and libbpf's Kconfig externs) look.
    let config = format!("config-{}", kernel.release);
    let boot = kernel.vmlinuz.with_file_name(&config);
    if boot.exists() {
        tree.host_file_as(&Path::new("/boot").join(&config), &boot)?;
    }
    // iproute2's own `ip` (busybox's cannot make veth pairs), nft, the
    // host's /bin/sh, and the setsid that starts the commands: a program
    // that busybox starts, or a script its sh runs, would get busybox's
    // applet for any name it has (`ip` included), whatever PATH says.
    let setsid = host_tool("setsid")?;
    for tool in [host_tool("ip")?, setsid.clone(), PathBuf::from("/bin/sh")] {
        tree.host_path(&tool)?;
    }
    if let Some(nft) = crate::setup::which("nft") {
        tree.host_path(&nft)?;
    }
    for file in &guest.files {
        tree.host_path(file)?;
    }
    for command in &guest.commands {
        if let Some(cwd) = &command.cwd {
            tree.guest_dir(cwd)?;
        }
    }
    for (path, text) in ETC {
        if !tree.entries.contains_key(Path::new(path)) {
            tree.insert(path, Entry::Bytes(text.as_bytes().to_vec(), 0o644));
        }
    }
    let job = job_script(guest, modules, nonce, &setsid)?;
    tree.insert("/vm/job.sh", Entry::Bytes(job.into_bytes(), 0o644));
    tree.libraries()?;
    let file = File::create(to).with_context(|| format!("creating {}", to.display()))?;
    let mut out = Newc::new(BufWriter::new(file));
    tree.write(&mut out)?;
    out.finish()
}

fn host_tool(name: &str) -> Result<PathBuf> {
    crate::setup::which(name).with_context(|| format!("{name} is not installed on the host"))
}

/// `/vm/job.sh`: the nonce, the modules to load and the commands to run
/// (the functions init.sh calls).
fn job_script(
    guest: &Guest,
    modules: &[(String, PathBuf)],
    nonce: &str,
    setsid: &Path,
) -> Result<String> {
    let mut script = format!(
        "NONCE={nonce}\nSETSID={}\nmodules() {{\n    :\n",
        shell_quote(&setsid.to_string_lossy())
    );
    for (name, _) in modules {
        writeln!(script, "    load {name}")?;
    }
    script.push_str("}\ncommands() {\n    :\n");
    for (name, value) in &guest.env {
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            bail!("{name:?} is not an environment variable's name");
        }
        writeln!(script, "    export {name}={}", shell_quote(value))?;
    }
    for (index, command) in guest.commands.iter().enumerate() {
        if command.argv.is_empty() {
            bail!("command {:?} has no program", command.name);
        }
        let cwd = command.cwd.as_deref().unwrap_or(Path::new("/"));
        let argv: Vec<String> = command.argv.iter().map(|a| shell_quote(a)).collect();
        writeln!(
            script,
            "    run {index} {} {} {}",
            command.timeout.as_millis().div_ceil(1000).max(1),
            shell_quote(&cwd.to_string_lossy()),
            argv.join(" ")
        )?;
    }
    script.push_str("}\n");
    Ok(script)
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// What goes into the initramfs, by path in the guest. Sorted, so every
/// directory is written before what it holds.
#[derive(Default)]
struct Tree {
    entries: BTreeMap<PathBuf, Entry>,
    /// ELF files, whose libraries are still to be added.
    elves: BTreeSet<PathBuf>,
}

enum Entry {
    Dir,
    /// A host file's content, with its permissions.
    File(PathBuf),
    Symlink(PathBuf),
    Bytes(Vec<u8>, u32),
    CharDevice(u32, u32),
}

impl Tree {
    fn insert(&mut self, path: impl AsRef<Path>, entry: Entry) {
        let path = path.as_ref();
        if let Some(parent) = path.parent() {
            self.dir(parent);
        }
        self.entries.insert(path.to_owned(), entry);
    }

    /// `path` and its parents as directories.
    fn dir(&mut self, path: &Path) {
        for ancestor in path.ancestors().filter(|a| *a != Path::new("/")) {
            if self.entries.contains_key(ancestor) {
                break;
            }
            self.entries.insert(ancestor.to_owned(), Entry::Dir);
        }
    }

    /// A directory in the guest: as on the host (symbolic links on the
    /// way kept) when the host has it.
    fn guest_dir(&mut self, path: &Path) -> Result<()> {
        let real = if path.exists() {
            self.resolve(path, 0)?
        } else {
            path.to_owned()
        };
        self.dir(&real);
        Ok(())
    }

    /// The host file `host` at `path` in the guest.
    fn host_file_as(&mut self, path: &Path, host: &Path) -> Result<()> {
        let real =
            std::fs::canonicalize(host).with_context(|| format!("finding {}", host.display()))?;
        if is_elf(&real)? {
            self.elves.insert(real.clone());
        }
        self.insert(path, Entry::File(real));
        Ok(())
    }

    /// The host path `path`, at the same path: a file, or a directory and
    /// all it holds. Symbolic links on the way are kept as links (as
    /// `/lib -> usr/lib`), and what they point at comes along.
    fn host_path(&mut self, path: &Path) -> Result<()> {
        let real = self.resolve(path, 0)?;
        let meta =
            std::fs::metadata(&real).with_context(|| format!("reading {}", real.display()))?;
        if meta.is_dir() {
            self.dir(&real);
            for child in read_dir(&real)? {
                self.host_path(&child)?;
            }
        } else if meta.is_file() {
            if is_elf(&real)? {
                self.elves.insert(real.clone());
            }
            self.insert(&real, Entry::File(real.clone()));
        } else {
            bail!("{} is neither a file nor a directory", real.display());
        }
        Ok(())
    }

    /// `path` with every symbolic link on it followed, each link added.
    fn resolve(&mut self, path: &Path, depth: u32) -> Result<PathBuf> {
        if depth > 40 {
            bail!("too many symbolic links at {}", path.display());
        }
        if !path.is_absolute() {
            bail!("{} is not an absolute path", path.display());
        }
        let mut real = PathBuf::from("/");
        for component in path.components() {
            match component {
                Component::Normal(part) => {
                    let next = real.join(part);
                    let meta = std::fs::symlink_metadata(&next)
                        .with_context(|| format!("reading {}", next.display()))?;
                    if meta.file_type().is_symlink() {
                        let target = std::fs::read_link(&next)?;
                        self.insert(&next, Entry::Symlink(target.clone()));
                        real = self.resolve(&real.join(target), depth + 1)?;
                    } else {
                        real = next;
                    }
                }
                Component::ParentDir => {
                    real.pop();
                }
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
        Ok(real)
    }

    /// The shared libraries of every ELF file (and theirs: `ldd` lists
    /// the whole closure), and the dynamic loader.
    fn libraries(&mut self) -> Result<()> {
        let mut libraries = BTreeSet::from([PathBuf::from("/lib64/ld-linux-x86-64.so.2")]);
        for elf in std::mem::take(&mut self.elves) {
            libraries.extend(ldd(&elf)?);
        }
        for library in libraries {
            self.host_path(&library)?;
        }
        // Libraries have no further libraries ldd did not list.
        self.elves.clear();
        Ok(())
    }

    fn write(&self, out: &mut Newc<impl Write>) -> Result<()> {
        for (path, entry) in &self.entries {
            match entry {
                // /tmp as on a host: anyone may create files, sticky.
                Entry::Dir if path == Path::new("/tmp") => out.entry(path, 0o041_777, &[])?,
                Entry::Dir => out.entry(path, 0o040_755, &[])?,
                Entry::Symlink(target) => {
                    out.entry(path, 0o120_777, target.as_os_str().as_encoded_bytes())?;
                }
                Entry::Bytes(data, mode) => out.entry(path, 0o100_000 | mode, data)?,
                Entry::CharDevice(major, minor) => out.device(path, 0o020_600, *major, *minor)?,
                Entry::File(host) => out.host_file(path, host)?,
            }
        }
        Ok(())
    }
}

fn is_elf(path: &Path) -> Result<bool> {
    let mut magic = [0u8; 4];
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let read = file.read(&mut magic)?;
    Ok(read == 4 && magic == *b"\x7fELF")
}

/// The libraries `ldd` lists for `elf` (none for a static one).
fn ldd(elf: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(elf)
        .output()
        .with_context(|| format!("running ldd {}", elf.display()))?;
    // ldd fails on static executables ("not a dynamic executable").
    if !out.status.success() {
        return Ok(Vec::new());
    }
    let mut libraries = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line = line.trim();
        let path = match line.split_once("=>") {
            Some((name, target)) => {
                if target.trim().starts_with("not found") {
                    bail!(
                        "{} needs {}, which is not installed",
                        elf.display(),
                        name.trim()
                    );
                }
                target.split_whitespace().next()
            }
            None => line.split_whitespace().next(),
        };
        // Leaves out linux-vdso.so.1, which the kernel provides.
        if let Some(path) = path.filter(|p| p.starts_with('/')) {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

/// A cpio archive in the "newc" format the kernel's initramfs unpacker
/// reads (Documentation/driver-api/early-userspace/buffer-format.rst).
struct Newc<W: Write> {
    out: W,
    written: u64,
    inode: u32,
}

impl<W: Write> Newc<W> {
    fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            inode: 0,
        }
    }

    fn entry(&mut self, path: &Path, mode: u32, data: &[u8]) -> Result<()> {
        let size = u32::try_from(data.len()).context("an initramfs file over 4 GiB")?;
        self.header(path, mode, size, (0, 0))?;
        self.bytes(data)?;
        self.pad()
    }

    fn device(&mut self, path: &Path, mode: u32, major: u32, minor: u32) -> Result<()> {
        self.header(path, mode, 0, (major, minor))
    }

    /// A host file's content, streamed (test binaries are large).
    fn host_file(&mut self, path: &Path, host: &Path) -> Result<()> {
        let file = File::open(host).with_context(|| format!("opening {}", host.display()))?;
        let meta = file.metadata()?;
        let size = u32::try_from(meta.len())
            .with_context(|| format!("{} is over 4 GiB", host.display()))?;
        let mode = 0o100_000 | (meta.permissions().mode() & 0o7777);
        self.header(path, mode, size, (0, 0))?;
        let copied = std::io::copy(&mut file.take(u64::from(size)), &mut self.out)
            .with_context(|| format!("copying {}", host.display()))?;
        if copied != u64::from(size) {
            bail!("{} shrank while it was being copied", host.display());
        }
        self.written += copied;
        self.pad()
    }

    fn header(&mut self, path: &Path, mode: u32, size: u32, rdev: (u32, u32)) -> Result<()> {
        let name = path
            .strip_prefix("/")
            .unwrap_or(path)
            .as_os_str()
            .as_encoded_bytes();
        self.inode += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.inode,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            size,
            0, // dev major
            0, // dev minor
            rdev.0,
            rdev.1,
            u32::try_from(name.len() + 1)?,
            0, // check
        ];
        let mut header = String::from("070701");
        for field in fields {
            write!(header, "{field:08X}")?;
        }
        self.bytes(header.as_bytes())?;
        self.bytes(name)?;
        self.bytes(&[0])?;
        self.pad()
    }

    fn bytes(&mut self, data: &[u8]) -> Result<()> {
        self.out.write_all(data)?;
        self.written += data.len() as u64;
        Ok(())
    }

    /// Headers and contents start on 4-byte boundaries.
    fn pad(&mut self) -> Result<()> {
        let padding = (4 - self.written % 4) % 4;
        self.bytes(&[0; 3][..padding as usize])
    }

    fn finish(mut self) -> Result<()> {
        self.header(Path::new("TRAILER!!!"), 0, 0, (0, 0))?;
        self.out.flush()?;
        Ok(())
    }
}

// ---------------------------------------------------------------------
// qemu, and what its console says.

fn qemu_command(vmlinuz: &Path, initramfs: &Path, memory_mib: u32) -> Command {
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(["-accel", "tcg", "-cpu", "max", "-smp", "2"])
        .args(["-m", &memory_mib.to_string()])
        // No default devices (network card, VGA): the guests need none.
        .args(["-nodefaults", "-no-user-config", "-nographic"])
        .args(["-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initramfs)
        // loglevel=4: the kernel's warnings and errors on the console,
        // not its boot chatter. trust_cpu: 5.10 would otherwise wait for
        // entropy (tokio, rustls) on an idle guest.
        .args([
            "-append",
            "console=ttyS0 panic=-1 loglevel=4 random.trust_cpu=on rdinit=/init",
        ]);
    command
}

/// Starts qemu and follows its console until the guest is done, dies, or
/// runs past `limit`.
fn watch(
    mut qemu: Command,
    guest: &Guest,
    nonce: &str,
    limit: Duration,
    log: &Path,
) -> Result<Run> {
    let started = Instant::now();
    let mut child = qemu
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let lines = console_lines(&mut child)?;
    let stderr = child.stderr.take().map(|mut stderr| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        })
    });
    let mut log =
        BufWriter::new(File::create(log).with_context(|| format!("creating {}", log.display()))?);
    let mut console = Console::new(guest, nonce, started);
    let deadline = started + limit;
    let timed_out = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                writeln!(log, "{line}")?;
                console.line(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => break true,
            Err(mpsc::RecvTimeoutError::Disconnected) => break false,
        }
    };
    log.flush()?;
    if timed_out {
        // Ours to end: qemu, started above.
        let _ = child.kill();
    }
    let status = child.wait().context("waiting for qemu")?;
    let stderr = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    let end = if timed_out {
        GuestEnd::TimedOut(limit)
    } else if console.done {
        GuestEnd::PoweredOff
    } else {
        GuestEnd::Died(format!("qemu exited ({status}) {}", stderr.trim()))
    };
    Ok(console.finish(end))
}

/// qemu's stdout (the serial console), line by line, from a thread.
fn console_lines(child: &mut Child) -> Result<mpsc::Receiver<String>> {
    let stdout = child.stdout.take().context("qemu's stdout")?;
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = Vec::new();
        while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            let text = without_escapes(&String::from_utf8_lossy(&line));
            line.clear();
            if send.send(text).is_err() {
                break;
            }
        }
    });
    Ok(receive)
}

/// A console line without its end, and without the terminal escapes the
/// firmware prints (clear screen, line wrap), which garble a terminal.
fn without_escapes(line: &str) -> String {
    let mut text = String::with_capacity(line.len());
    let mut chars = line.trim_end_matches(['\n', '\r']).chars();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            text.push(c);
            continue;
        }
        // ESC [ parameters final-letter, or ESC and one character.
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        }
    }
    text
}

/// Reads the console: markers, and the output between them.
struct Console {
    nonce: String,
    echo: bool,
    started: Instant,
    names: Vec<String>,
    timeouts: Vec<Duration>,
    outcomes: Vec<Option<CommandOutcome>>,
    /// The command running: its index, start, output so far.
    current: Option<(usize, Instant, Tail)>,
    release: Option<String>,
    boot: Option<Duration>,
    warnings: Vec<String>,
    done: bool,
    tail: Tail,
}

/// The last `OUTPUT_LINES` lines of something.
#[derive(Default)]
struct Tail {
    lines: VecDeque<String>,
    dropped: usize,
}

impl Tail {
    fn push(&mut self, line: String) {
        if self.lines.len() == OUTPUT_LINES {
            self.lines.pop_front();
            self.dropped += 1;
        }
        self.lines.push_back(line);
    }
}

impl Console {
    fn new(guest: &Guest, nonce: &str, started: Instant) -> Self {
        Self {
            nonce: nonce.to_owned(),
            echo: guest.echo,
            started,
            names: guest.commands.iter().map(|c| c.name.clone()).collect(),
            timeouts: guest.commands.iter().map(|c| c.timeout).collect(),
            outcomes: vec![None; guest.commands.len()],
            current: None,
            release: None,
            boot: None,
            warnings: Vec::new(),
            done: false,
            tail: Tail::default(),
        }
    }

    fn line(&mut self, line: String) {
        self.tail.push(line.clone());
        let Some(at) = line.find(&self.nonce) else {
            self.output(line);
            return;
        };
        // What came before the marker on its line: a program's last line
        // without its newline, or a kernel message.
        if !line[..at].trim().is_empty() {
            self.output(line[..at].to_owned());
        }
        let words: Vec<&str> = line[at + self.nonce.len()..].split_whitespace().collect();
        self.marker(&words);
    }

    /// A line of the running command's output (or of the kernel's).
    fn output(&mut self, line: String) {
        // Not before the guest is ready: the firmware's and the kernel's
        // boot, shown from the tail when the guest does not get that far.
        if self.echo && self.boot.is_some() {
            println!("{line}");
        }
        if let Some((_, _, output)) = &mut self.current {
            output.push(line);
        }
    }

    fn marker(&mut self, words: &[&str]) {
        let index = || words.get(1).and_then(|i| i.parse::<usize>().ok());
        match words.first().copied() {
            Some("ready") => {
                let boot = self.started.elapsed();
                self.release = words.get(1).map(|r| (*r).to_owned());
                self.boot = Some(boot);
                self.say(format!(
                    "guest: {} booted in {:.1} s",
                    self.release.as_deref().unwrap_or("?"),
                    boot.as_secs_f64()
                ));
            }
            Some("warn") => {
                let warning = words[1..].join(" ");
                self.say(format!("guest: warning: {warning}"));
                self.warnings.push(warning);
            }
            Some("start") => {
                if let Some(index) = index().filter(|&i| i < self.names.len()) {
                    self.say(format!("guest: running {}", self.names[index]));
                    self.current = Some((index, Instant::now(), Tail::default()));
                }
            }
            Some("end") => {
                let status = match (words.get(2).copied(), words.get(3)) {
                    (Some("exit"), Some(code)) => Status::Exited(code.parse().unwrap_or(-1)),
                    _ => Status::TimedOut,
                };
                if let Some((current, _, _)) = &self.current
                    && Some(*current) == index()
                {
                    self.end_current(status);
                }
            }
            Some("done") => self.done = true,
            _ => {}
        }
    }

    fn end_current(&mut self, status: Status) {
        let Some((index, started, output)) = self.current.take() else {
            return;
        };
        let elapsed = started.elapsed();
        let shown = match &status {
            Status::Exited(code) => format!("exit {code}"),
            Status::TimedOut => format!("timed out after {:?}", self.timeouts[index]),
            Status::Lost => "lost with the guest".to_owned(),
            Status::NotRun => "not run".to_owned(),
        };
        self.say(format!(
            "guest: {}: {shown} ({:.1} s)",
            self.names[index],
            elapsed.as_secs_f64()
        ));
        self.outcomes[index] = Some(CommandOutcome {
            status,
            elapsed,
            output: output.lines.into(),
            dropped_lines: output.dropped,
        });
    }

    fn say(&self, text: String) {
        if self.echo {
            println!("xtask: {text}");
        }
    }

    fn finish(mut self, end: GuestEnd) -> Run {
        if self.current.is_some() {
            self.end_current(Status::Lost);
        }
        let outcomes = self
            .names
            .iter()
            .cloned()
            .zip(self.outcomes)
            .map(|(name, outcome)| {
                let outcome = outcome.unwrap_or(CommandOutcome {
                    status: Status::NotRun,
                    elapsed: Duration::ZERO,
                    output: Vec::new(),
                    dropped_lines: 0,
                });
                (name, outcome)
            })
            .collect();
        Run {
            release: self.release,
            boot: self.boot,
            outcomes,
            end,
            modules: Vec::new(),
            warnings: self.warnings,
            console_tail: self.tail.lines.into(),
            workdir: None,
        }
    }
}

/// Marks the guest's own lines: unlike anything a program prints.
fn nonce() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("@@xtask-vm-{:x}{nanos:x}@@", std::process::id())
}

/// A directory for one run's initramfs and console log, removed after
/// unless kept.
struct WorkDir {
    path: PathBuf,
    keep: bool,
}

impl WorkDir {
    fn create(keep: bool) -> Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "limiter-vm-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis())
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path, keep })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

// ---------------------------------------------------------------------
// Small helpers.

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()).map_err(Into::into))
        .collect()
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Runs `command`; its output is shown only when it fails.
fn quiet(command: &mut Command) -> Result<()> {
    captured(command).map(drop)
}

/// Runs `command`, returning its stdout; its stderr is shown if it fails.
fn captured(command: &mut Command) -> Result<String> {
    let shown = format!("{command:?}");
    let out = command
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("starting {shown}"))?;
    if !out.status.success() {
        bail!(
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_package_names() {
        let p = "linux-image-6.12.*+deb13*-cloud-amd64-unsigned";
        assert!(glob_match(
            p,
            "linux-image-6.12.118+deb13-cloud-amd64-unsigned"
        ));
        assert!(glob_match(
            p,
            "linux-image-6.12.115+deb13.1-cloud-amd64-unsigned"
        ));
        assert!(!glob_match(p, "linux-image-6.12.118+deb13-cloud-amd64-dbg"));
        assert!(!glob_match(p, "linux-image-6.12.118+deb13-cloud-amd64"));
        assert_eq!(
            glob_regex("linux-image-6.1.0-*-cloud"),
            r"^linux-image-6\.1\.0-.*-cloud$"
        );
    }

    #[test]
    fn newest_is_by_version() {
        let mut names = [
            "linux-image-6.12.9+deb13-cloud",
            "linux-image-6.12.118+deb13-cloud",
            "linux-image-6.12.115+deb13.1-cloud",
            "linux-image-6.12.115+deb13-cloud",
        ];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names[3], "linux-image-6.12.118+deb13-cloud");
        assert_eq!(names[0], "linux-image-6.12.9+deb13-cloud");
        assert!(natural_key("6.12.115+deb13.1-c") > natural_key("6.12.115+deb13-c"));
    }

    #[test]
    fn console_lines_lose_terminal_escapes() {
        let line = "\x1bc\x1b[?7l\x1b[2J\x1b[0mSeaBIOS (version 1.16.2)\r\n";
        assert_eq!(without_escapes(line), "SeaBIOS (version 1.16.2)");
    }

    #[test]
    fn arguments_are_quoted_for_the_shell() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    /// `cargo test -p xtask -- --ignored`: several commands in one guest.
    #[test]
    #[ignore = "boots a qemu guest: needs root, qemu and Debian's mirror (about 20 s)"]
    fn a_guest_runs_its_commands_in_order() -> Result<()> {
        let second = Duration::from_secs(1);
        let sh =
            |name: &str, script: &str| GuestCommand::new(name, ["sh", "-c", script], 30 * second);
        let guest = Guest {
            env: vec![("GREETING".into(), "it's here".into())],
            commands: vec![
                // No newline before the end marker.
                sh("exits 3", "printf %s \"$GREETING\"; exit 3"),
                GuestCommand::new("sleeps", ["sleep", "60"], 2 * second),
                // Not started as a background job: SIGINT still stops it.
                sh("signals", "grep SigIgn /proc/self/status"),
                sh(
                    "veth",
                    "ip link add x0 type veth peer name x1 && ip -br link show x1",
                ),
            ],
            ..Guest::default()
        };
        let run = run(kernel("6.12")?, &guest)?;
        assert_eq!(run.end, GuestEnd::PoweredOff, "{:#?}", run.console_tail);
        let [exits, sleeps, signals, veth] = &run.outcomes[..] else {
            panic!("{:?}", run.outcomes);
        };
        assert_eq!(exits.1.status, Status::Exited(3));
        assert_eq!(exits.1.output, ["it's here"]);
        assert_eq!(sleeps.1.status, Status::TimedOut);
        assert_eq!(signals.1.output, ["SigIgn:\t0000000000000000"]);
        assert!(veth.1.success(), "{:?}", veth.1);
        assert!(run.modules.contains(&"veth".to_owned()));
        Ok(())
    }

    #[test]
    fn newc_headers_are_aligned() -> Result<()> {
        let mut out = Newc::new(Vec::new());
        out.entry(Path::new("/init"), 0o100_755, b"#!/bin/sh\n")?;
        assert_eq!(out.written % 4, 0);
        assert!(out.out.starts_with(b"070701"));
        Ok(())
    }
}
