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
//!
//! The submodules, one job each:
//! - `kernels`: Debian's kernel packages, fetched with an apt state of
//!   their own and kept unpacked in the cache;
//! - `modules`: the kernel modules a guest loads, with their dependencies,
//!   as plain `.ko` files;
//! - `initramfs`: the guest's root, with its init and job scripts;
//! - `tree`: what goes into it: host files and directories at their
//!   paths, the symbolic links on the way, the libraries `ldd` lists;
//! - `cpio`: the newc cpio writer;
//! - `qemu`: starting qemu and following its console until the guest is
//!   done, dies or runs past its time;
//! - `console`: the marker lines on the console, and what the commands
//!   printed between them;
//! - `cli`: `cargo xtask vm`;
//! - `util`: the work directory, reading directories, running host tools.

mod cli;
mod console;
mod cpio;
mod initramfs;
mod kernels;
mod modules;
mod qemu;
mod tree;
mod util;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};

pub use self::cli::{Options, cli};
use self::{
    console::nonce,
    initramfs::write_initramfs,
    kernels::unpack,
    modules::resolve_modules,
    qemu::{qemu_command, watch},
    util::WorkDir,
};

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

/// How one command ended, and what it printed last.
#[derive(Debug, Clone)]
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
