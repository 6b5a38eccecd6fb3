//! Where the limiter keeps its state on the host, and the bpffs it needs.

use std::{
    fs::{self, File},
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
    mount::{MsFlags, mount},
    sys::statfs::{BPF_FS_MAGIC, statfs},
};

/// Where bpffs is mounted.
pub const BPFFS: &str = "/sys/fs/bpf";
/// Our directory below it: every pinned map of a running limiter.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/limiter";
/// Lock files that say which pin directory a live process owns (0700).
pub const RUN_DIR: &str = "/run/limiter";

/// Mounts bpffs at [`BPFFS`] unless a bpffs is already there.
pub fn ensure_bpffs() -> Result<()> {
    if is_bpffs(Path::new(BPFFS))? {
        return Ok(());
    }
    fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
    mount(
        Some("bpf"),
        BPFFS,
        Some("bpf"),
        MsFlags::empty(),
        None::<&str>,
    )
    .with_context(|| format!("mounting bpffs at {BPFFS}"))
}

fn is_bpffs(path: &Path) -> Result<bool> {
    match statfs(path) {
        Ok(stat) => Ok(stat.filesystem_type() == BPF_FS_MAGIC),
        Err(Errno::ENOENT) => Ok(false),
        Err(e) => Err(e).with_context(|| format!("statfs {}", path.display())),
    }
}

/// An exclusive claim on a pin directory, held for the life of a limiter.
/// The kernel drops it when the process dies, however it dies.
#[derive(Debug)]
pub struct PinLock {
    _lock: Flock<File>,
}

impl PinLock {
    /// Claims `pin_dir`, or says which process holds it.
    pub fn acquire(pin_dir: &Path) -> Result<Self> {
        fs::create_dir_all(RUN_DIR).with_context(|| format!("creating {RUN_DIR}"))?;
        fs::set_permissions(RUN_DIR, fs::Permissions::from_mode(0o700))?;
        let path = lock_path(pin_dir);
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((_, Errno::EWOULDBLOCK)) => {
                let owner = fs::read_to_string(&path).unwrap_or_default();
                bail!(
                    "another limiter (pid {}) is running with pin directory {}",
                    owner.trim(),
                    pin_dir.display()
                );
            }
            Err((_, e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
        };
        lock.set_len(0)?;
        io::Write::write_all(&mut *lock, std::process::id().to_string().as_bytes())?;
        Ok(Self { _lock: lock })
    }
}

fn lock_path(pin_dir: &Path) -> PathBuf {
    let name: String = pin_dir
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Path::new(RUN_DIR).join(format!("{name}.lock"))
}

/// Removes a pin directory and everything pinned in it.
pub fn remove_pins(pin_dir: &Path) -> Result<()> {
    match fs::remove_dir_all(pin_dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", pin_dir.display()))
        }
        _ => Ok(()),
    }
}
