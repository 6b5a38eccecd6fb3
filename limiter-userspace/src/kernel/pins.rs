//! Where the limiter keeps its state on the host, and the bpffs it needs.

use std::{
    fs::{self, File},
    io,
    os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt},
    path::{Component, Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
    mount::{MsFlags, mount},
    sys::statfs::{BPF_FS_MAGIC, statfs},
    unistd::geteuid,
};

/// Where bpffs is mounted.
pub const BPFFS: &str = "/sys/fs/bpf";
/// Our directory below it: every pinned map of a running limiter.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/limiter";
/// Lock files that say which pin directory a live process owns (0700).
pub const RUN_DIR: &str = "/run/limiter";

/// A directory the limiter would keep its state in, refused because another
/// user could change what is in it.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct UnsafeDir {
    pub path: PathBuf,
    pub reason: String,
}

/// Makes sure `dir` is ours alone: created mode 0700 (with any missing
/// parent) if it is missing; if it exists, owned by us with mode 0700
/// (refused otherwise, never repaired: it may not be ours to change). Then every ancestor, checked after the
/// creation so none can be slipped in between, must be owned by root or us
/// and either writable by no one else or sticky (as `/sys/fs/bpf` and
/// `/tmp` are), so no other user can swap a directory on the way. Anything
/// else is refused rather than repaired: on bpffs, whoever can write in
/// the directory can unpin or replace the maps (an unprivileged user who
/// creates `/sys/fs/bpf/limiter` first owns every pin in it).
pub fn private_dir(dir: &Path) -> Result<(), UnsafeDir> {
    let refuse = |reason: String| UnsafeDir {
        path: dir.to_owned(),
        reason,
    };
    let me = geteuid().as_raw();
    let absolute = std::path::absolute(dir).map_err(|e| refuse(e.to_string()))?;
    if fs::symlink_metadata(&absolute).is_err() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&absolute)
            .map_err(|e| refuse(format!("cannot create: {e}")))?;
        // Whatever the umask took away: exactly 0700.
        fs::set_permissions(&absolute, fs::Permissions::from_mode(0o700))
            .map_err(|e| refuse(format!("cannot set its mode: {e}")))?;
    }
    for ancestor in absolute.ancestors().skip(1) {
        let meta = fs::metadata(ancestor).map_err(|e| refuse(e.to_string()))?;
        let sticky = meta.mode() & 0o1000 != 0;
        if (meta.uid() != 0 && meta.uid() != me) || (meta.mode() & 0o022 != 0 && !sticky) {
            return Err(refuse(format!(
                "its parent {} (uid {}, mode {:04o}) can be changed by another user; \
                 use a directory below ones only root can write",
                ancestor.display(),
                meta.uid(),
                meta.mode() & 0o7777
            )));
        }
    }
    let meta = fs::symlink_metadata(&absolute).map_err(|e| refuse(e.to_string()))?;
    if !meta.file_type().is_dir() {
        return Err(refuse(
            "is not a directory (a symbolic link or a file)".into(),
        ));
    }
    if meta.uid() != me {
        return Err(refuse(format!(
            "owned by uid {}, not by uid {me}: another user made it and could unpin or \
             replace what is kept there; use a directory of the limiter's own",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "mode {:04o}: other users could unpin or replace what is kept there; \
             use a directory of the limiter's own, writable by its owner only",
            meta.mode() & 0o7777
        )));
    }
    if meta.mode() & 0o7777 != 0o700 {
        return Err(refuse(format!(
            "mode {:04o}, not 0700: what is kept there is for its owner alone \
             (`chmod 700 {}` if it is the limiter's own)",
            meta.mode() & 0o7777,
            dir.display()
        )));
    }
    Ok(())
}

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
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        // Root only, unlike the sticky 1777 some distributions mount.
        Some("mode=0700"),
    )
    .with_context(|| format!("mounting bpffs at {BPFFS}"))
}

/// Whether a bpffs is mounted at `path`.
pub fn is_bpffs(path: &Path) -> Result<bool> {
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
        let lock = exclusive(&lock_path(pin_dir, "lock"), |owner| {
            format!(
                "another limiter (pid {owner}) is running with pin directory {}",
                pin_dir.display()
            )
        })?;
        Ok(Self { _lock: lock })
    }

    /// Claims the tracing of the limiter at `pin_dir` (one tracer at a
    /// time), or says which process traces.
    pub fn trace(pin_dir: &Path) -> Result<Self> {
        let lock = exclusive(&lock_path(pin_dir, "trace"), |owner| {
            format!(
                "another `limiter trace` (pid {owner}) is tracing the limiter at {}",
                pin_dir.display()
            )
        })?;
        Ok(Self { _lock: lock })
    }
}

/// An exclusive lock on the file at `path` with our pid written in it, or
/// `busy(pid of the holder)` as the error.
fn exclusive(path: &Path, busy: impl Fn(&str) -> String) -> Result<Flock<File>> {
    private_dir(Path::new(RUN_DIR))?;
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((_, Errno::EWOULDBLOCK)) => {
            let owner = fs::read_to_string(path).unwrap_or_default();
            bail!("{}", busy(owner.trim()));
        }
        Err((_, e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
    };
    lock.set_len(0)?;
    io::Write::write_all(&mut *lock, std::process::id().to_string().as_bytes())?;
    Ok(lock)
}

/// The lock file of `pin_dir` of that kind (`lock`, `trace`), the same
/// for every spelling of it (`limiter`, `limiter/`, `./limiter`,
/// `a//limiter`).
fn lock_path(pin_dir: &Path, kind: &str) -> PathBuf {
    let absolute = std::path::absolute(pin_dir).unwrap_or_else(|_| pin_dir.to_owned());
    let normal: PathBuf = absolute
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect();
    // Escaped, not replaced: `a-b`, `a_b` and `a/b` are three directories.
    let name: String = normal
        .to_string_lossy()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_string()
            } else {
                format!("_{:x}", u32::from(c))
            }
        })
        .collect();
    Path::new(RUN_DIR).join(format!("{name}.{kind}"))
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::lock_path;

    fn lock_path_of(pin_dir: &Path) -> std::path::PathBuf {
        lock_path(pin_dir, "lock")
    }

    #[test]
    fn every_spelling_of_a_pin_directory_has_one_lock() {
        let lock = lock_path_of(Path::new("/sys/fs/bpf/limiter"));
        for spelling in [
            "/sys/fs/bpf/limiter/",
            "/sys/fs/bpf//limiter",
            "/sys/fs/bpf/./limiter",
        ] {
            assert_eq!(lock_path_of(Path::new(spelling)), lock, "{spelling}");
        }
        assert_ne!(lock_path_of(Path::new("/sys/fs/bpf/limiter2")), lock);
        assert_ne!(
            lock_path_of(Path::new("/sys/fs/bpf/limiter-a")),
            lock_path_of(Path::new("/sys/fs/bpf/limiter_a"))
        );
    }
}
