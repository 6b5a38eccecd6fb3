//! Where the limiter keeps its state on the host, and the bpffs it needs.

use std::{
    ffi::CString,
    fs::{self, File},
    io,
    os::{fd::AsRawFd, unix::fs::PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

/// Where bpffs is mounted.
pub const BPFFS: &str = "/sys/fs/bpf";
/// Our directory below it: every pinned map of a running limiter.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/limiter";
/// Lock files that say which pin directory a live process owns (0700).
pub const RUN_DIR: &str = "/run/limiter";

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Mounts bpffs at [`BPFFS`] unless a bpffs is already there.
pub fn ensure_bpffs() -> Result<()> {
    if is_bpffs(Path::new(BPFFS))? {
        return Ok(());
    }
    fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
    let target = CString::new(BPFFS).expect("no NUL");
    let fstype = CString::new("bpf").expect("no NUL");
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error()).context(format!("mounting bpffs at {BPFFS}"));
    }
    Ok(())
}

fn is_bpffs(path: &Path) -> Result<bool> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).context("path has a NUL")?;
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        let error = io::Error::last_os_error();
        if error.kind() == io::ErrorKind::NotFound {
            return Ok(false);
        }
        return Err(error).context(format!("statfs {}", path.display()));
    }
    Ok(stat.f_type as i64 == BPF_FS_MAGIC)
}

/// An exclusive claim on a pin directory, held for the life of a limiter.
/// The kernel drops it when the process dies, however it dies.
#[derive(Debug)]
pub struct PinLock {
    _file: File,
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
        // SAFETY: valid fd.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let owner = fs::read_to_string(&path).unwrap_or_default();
            bail!(
                "another limiter (pid {}) is running with pin directory {}",
                owner.trim(),
                pin_dir.display()
            );
        }
        file.set_len(0)?;
        fs::write(&path, std::process::id().to_string())?;
        Ok(Self { _file: file })
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
