//! Installs what a fresh machine lacks, and nothing that is already there:
//! the nightly's rust-src, bpf-linker built against the nightly's own LLVM,
//! and the Debian packages the lab and the tests use.

use std::{
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{status, step};

/// Debian packages: (a command it provides, the package).
const PACKAGES: [(&str, &str); 10] = [
    ("ip", "iproute2"),
    ("nft", "nftables"),
    ("iptables", "iptables"),
    // `systemd-analyze security` rates the unit (no running systemd needed).
    ("systemd-analyze", "systemd"),
    ("setpriv", "util-linux"),
    // The fleet tests start their own on loopback; the package's service
    // is kept from starting (see `packages`).
    ("redis-server", "redis-server"),
    // The TLS test makes its certificates with it.
    ("openssl", "openssl"),
    // `cargo xtask bench l7`: the layer-7 peer (its service kept from
    // starting) and the load generator.
    ("nginx", "nginx-light"),
    ("wrk", "wrk"),
    // The layer-7 decision path counted (`--bench l7_counts`).
    ("valgrind", "valgrind"),
];

/// Debian packages of files no command finds: (the file, the package).
const FILES: [(&str, &str); 1] = [
    // `cargo xtask bench -- dashboard` draws its PNG with this font.
    (
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "fonts-dejavu-core",
    ),
];

/// bpf-linker releases that build with the toolchains here.
const BPF_LINKER_VERSION: &str = "^0.13";

pub fn all() -> Result<()> {
    toolchain()?;
    packages()?;
    promtool()?;
    python_modules()
}

/// Where `promtool` goes.
const PROMTOOL: &str = "/usr/local/bin/promtool";

/// `promtool check metrics` checks our exposition as Prometheus reads it.
/// It comes in Debian's `prometheus` package, whose installation would
/// start a Prometheus server listening on every address: only the tool is
/// taken out of the package, and nothing runs.
fn promtool() -> Result<()> {
    if on_path("promtool") {
        return Ok(());
    }
    step("installing promtool (from Debian's prometheus package, without the server)");
    let dir = std::env::temp_dir().join(format!("limiter-promtool-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = (|| {
        apt_update()?;
        status(
            Command::new("apt-get")
                .args(["download", "prometheus"])
                .current_dir(&dir),
        )?;
        let deb = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .context("apt-get download left no .deb")?;
        status(
            Command::new("dpkg-deb")
                .arg("-x")
                .arg(&deb)
                .arg(dir.join("root")),
        )?;
        std::fs::copy(dir.join("root/usr/bin/promtool"), PROMTOOL)
            .with_context(|| format!("copying promtool to {PROMTOOL}"))?;
        anyhow::Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Python modules the tests use: the Prometheus project's own client
/// parses our metrics exposition, as a Prometheus server would.
const PYTHON_MODULES: [(&str, &str); 1] = [("prometheus_client", "prometheus-client==0.26.0")];

fn python_modules() -> Result<()> {
    for (module, requirement) in PYTHON_MODULES {
        if succeeds(Command::new("python3").args(["-c", &format!("import {module}")])) {
            continue;
        }
        step(&format!("installing the Python module {requirement}"));
        status(Command::new("python3").args(["-m", "pip", "install", "--quiet", requirement]))?;
    }
    Ok(())
}

/// cargo-mutants, for `cargo xtask mutants` only (27.1 builds with Rust 1.88+).
const CARGO_MUTANTS_VERSION: &str = "27.1.0";

pub fn cargo_mutants() -> Result<()> {
    let version = output(Command::new("cargo").args(["mutants", "--version"])).unwrap_or_default();
    if version.contains(CARGO_MUTANTS_VERSION) {
        return Ok(());
    }
    step(&format!(
        "installing cargo-mutants {CARGO_MUTANTS_VERSION} (a few minutes)"
    ));
    status(Command::new("cargo").args([
        "install",
        "--locked",
        "cargo-mutants",
        "--version",
        CARGO_MUTANTS_VERSION,
    ]))
}

/// The nightly with rust-src and clippy, and a bpf-linker that matches its LLVM.
pub fn toolchain() -> Result<()> {
    if !succeeds(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        step("installing the nightly toolchain");
        status(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]))?;
    for component in ["rust-src", "clippy"] {
        if !installed.lines().any(|l| l.starts_with(component)) {
            step(&format!("adding {component} to the nightly toolchain"));
            status(Command::new("rustup").args([
                "component",
                "add",
                component,
                "--toolchain",
                "nightly",
            ]))?;
        }
    }
    let llvm = NightlyLlvm::find()?;
    if bpf_linker_matches(&llvm) {
        return Ok(());
    }
    step(&format!(
        "building bpf-linker {BPF_LINKER_VERSION} against the nightly's LLVM {} (about a minute)",
        llvm.major
    ));
    let prefix = llvm.prefix_dir()?;
    status(
        Command::new("cargo")
            .args([
                "install",
                "--force",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{}", llvm.major),
            ])
            .env("LLVM_PREFIX", &prefix)
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("RUSTC"),
    )?;
    if !bpf_linker_matches(&llvm) {
        bail!("bpf-linker was installed but does not run; is ~/.cargo/bin on PATH?");
    }
    Ok(())
}

/// The LLVM library shipped inside the nightly toolchain.
struct NightlyLlvm {
    major: String,
    /// e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`
    library: PathBuf,
}

impl NightlyLlvm {
    fn find() -> Result<Self> {
        let version = output(Command::new("rustc").args(["+nightly", "-vV"]))?;
        let major = version
            .lines()
            .find_map(|l| l.strip_prefix("LLVM version: "))
            .and_then(|v| v.split('.').next())
            .context("`rustc +nightly -vV` names no LLVM version")?
            .to_owned();
        let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
        let lib = Path::new(sysroot.trim()).join("lib");
        let library = std::fs::read_dir(&lib)
            .with_context(|| format!("reading {}", lib.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libLLVM.so.") && n.contains("-rust-"))
            })
            .with_context(|| format!("no libLLVM.so.*-rust-* in {}", lib.display()))?;
        Ok(Self { major, library })
    }

    /// A folder laid out like an LLVM install (`lib/libLLVM.so` and the
    /// soname), pointing at the nightly's library. bpf-linker keeps an rpath
    /// to it, so it lives in CARGO_HOME, not in a temporary folder.
    fn prefix_dir(&self) -> Result<PathBuf> {
        let file_name = self.library.file_name().expect("a file").to_owned();
        let dir = cargo_home()?.join("limiter-llvm").join(&file_name);
        let lib = dir.join("lib");
        std::fs::create_dir_all(&lib)?;
        for link in [lib.join("libLLVM.so"), lib.join(&file_name)] {
            let _ = std::fs::remove_file(&link);
            symlink(&self.library, &link).with_context(|| format!("linking {}", link.display()))?;
        }
        Ok(dir)
    }
}

/// Whether the installed bpf-linker runs and was built for this LLVM.
fn bpf_linker_matches(llvm: &NightlyLlvm) -> bool {
    if !succeeds(Command::new("bpf-linker").arg("--version")) {
        return false;
    }
    // It must load the very libLLVM of this nightly: one built for another
    // nightly would emit objects this rustc's bitcode does not fit.
    let Some(path) = which("bpf-linker") else {
        return false;
    };
    let Ok(libraries) = output(Command::new("ldd").arg(path)) else {
        return false;
    };
    let name = llvm
        .library
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("?");
    libraries
        .lines()
        .any(|l| l.contains(name) && l.contains("=> /"))
}

pub fn which(command: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|dir| dir.join(command))
        .find(|p| p.is_file())
}

fn cargo_home() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        return Ok(home.into());
    }
    let home = std::env::var_os("HOME").context("neither CARGO_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cargo"))
}

/// Installs the Debian packages whose commands are missing.
pub fn packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(command, _)| !on_path(command))
        .chain(FILES.iter().filter(|(file, _)| !Path::new(file).exists()))
        .map(|(_, package)| *package)
        .collect();
    install(&missing)
}

/// What `cargo xtask vm` needs on the host: (a command, its package).
const VM_PACKAGES: [(&str, &str); 9] = [
    ("qemu-system-x86_64", "qemu-system-x86"),
    // Static: the guest's shell, init and tools, with no library of its own.
    ("busybox", "busybox-static"),
    // The guests get the host's own `ip` and `nft`.
    ("ip", "iproute2"),
    ("nft", "nftables"),
    // 6.12's modules are xz-compressed.
    ("xz", "xz-utils"),
    ("modinfo", "kmod"),
    ("dpkg-deb", "dpkg"),
    ("ldd", "libc-bin"),
    // For programs run in the guests (`bpftool prog`, `feature probe`).
    ("bpftool", "bpftool"),
];

/// Installs what `cargo xtask vm` needs and the host lacks.
pub fn vm_packages() -> Result<()> {
    let missing: Vec<&str> = VM_PACKAGES
        .iter()
        .filter(|(command, _)| !on_path(command))
        .map(|(_, package)| *package)
        .collect();
    install(&missing)
}

fn install(missing: &[&str]) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    step(&format!(
        "installing Debian packages: {}",
        missing.join(" ")
    ));
    apt_update()?;
    // Packages install services (redis-server's listens): none is started
    // (policy-rc.d's "101: action forbidden", for this install only).
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        std::fs::write(policy, "#!/bin/sh\nexit 101\n")?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(policy, std::fs::Permissions::from_mode(0o755))?;
    }
    let installed = status(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    );
    if ours {
        let _ = std::fs::remove_file(policy);
    }
    installed
}

/// `apt-get update`, once per run (the packages and promtool both need it).
fn apt_update() -> Result<()> {
    static UPDATED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if UPDATED.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    status(
        Command::new("apt-get")
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    UPDATED.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

fn on_path(command: &str) -> bool {
    which(command).is_some()
}

fn succeeds(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn output(command: &mut Command) -> Result<String> {
    let out = command
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!("{command:?} failed");
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
