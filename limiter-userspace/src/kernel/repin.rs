//! Pins lost under a running daemon (bpffs unmounted, the pin directory
//! deleted): the program keeps enforcing, because the daemon holds its own
//! reference to every map and every XDP link, not only the pins; the loss
//! is reported, and the pins are written again as soon as a bpffs is
//! mounted where they lived, so a later daemon can adopt the state. A
//! detach releases the links first, so nothing pins them again.

use std::{
    ffi::CString,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use aya::maps::MapData;

use super::{KernelError, maps::pinned_data, pins};

/// The daemon's own references: a handle on each pinned map, and a file
/// descriptor of each pinned link with where it was pinned.
#[derive(Default)]
pub struct Held {
    maps: Vec<(String, MapData)>,
    links: Vec<(PathBuf, OwnedFd)>,
    /// Detached: nothing is pinned again.
    released: bool,
}

/// `bpf(2)`'s attributes for `BPF_OBJ_PIN` and `BPF_OBJ_GET`.
#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;

fn obj(command: libc::c_long, path: &Path, fd: u32) -> std::io::Result<libc::c_long> {
    let name = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let attr = ObjAttr {
        pathname: name.as_ptr() as u64,
        bpf_fd: fd,
        file_flags: 0,
    };
    // SAFETY: `attr` and the path it points to outlive the call, and the
    // size passed is the size of `attr`.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            &attr as *const ObjAttr,
            std::mem::size_of::<ObjAttr>(),
        )
    };
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

impl Held {
    /// Opens every map pinned under `pin_dir` once more: a handle that
    /// outlives the pins.
    pub fn maps(pin_dir: &Path, names: &[String]) -> Result<Self, KernelError> {
        let maps = names
            .iter()
            .map(|name| pinned_data(pin_dir, name).map(|data| (name.clone(), data)))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            maps,
            ..Self::default()
        })
    }

    /// Keeps a reference to the link pinned at `path`.
    pub fn link(&mut self, path: &Path) -> Result<(), KernelError> {
        let fd = obj(BPF_OBJ_GET, path, 0).map_err(|source| KernelError::Io {
            path: path.to_owned(),
            source,
        })?;
        // SAFETY: BPF_OBJ_GET returned a new descriptor, ours alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        self.links.push((path.to_owned(), fd));
        Ok(())
    }

    /// Whether everything pinned is still there (the maps' and the links'
    /// pins).
    pub fn intact(&self, pin_dir: &Path) -> bool {
        self.maps
            .iter()
            .all(|(name, _)| pin_dir.join(name).exists())
            && self.links.iter().all(|(path, _)| path.exists())
    }

    /// Lets go of the links (a detach): they live on only by their pins,
    /// which the detach removes, and are never pinned again.
    pub fn release_links(&mut self) {
        self.links.clear();
        self.released = true;
    }

    /// Pins again what is missing, once the nearest existing ancestor of
    /// the pin directory is a bpffs; returns how many pins were written
    /// (0: nothing to do, or no bpffs to write them in yet).
    pub fn repin(&mut self, pin_dir: &Path) -> Result<usize, KernelError> {
        if self.released || self.intact(pin_dir) {
            return Ok(0);
        }
        let absolute = std::path::absolute(pin_dir).map_err(|source| KernelError::Io {
            path: pin_dir.to_owned(),
            source,
        })?;
        let existing = absolute
            .ancestors()
            .find(|a| a.exists())
            .unwrap_or(Path::new("/"));
        if !pins::is_bpffs(existing).unwrap_or(false) {
            return Ok(0);
        }
        pins::private_dir(pin_dir)?;
        let mut written = 0;
        for (name, data) in &self.maps {
            let path = pin_dir.join(name);
            if !path.exists() {
                data.pin(&path).map_err(|e| KernelError::Adopt {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
                written += 1;
            }
        }
        // A borrowed descriptor: a failure here loses no link.
        for (path, fd) in &self.links {
            if !path.exists() {
                pins::private_dir(path.parent().expect("a links dir"))?;
                obj(BPF_OBJ_PIN, path, fd.as_raw_fd() as u32).map_err(|source| {
                    KernelError::Io {
                        path: path.clone(),
                        source,
                    }
                })?;
                written += 1;
            }
        }
        Ok(written)
    }
}
