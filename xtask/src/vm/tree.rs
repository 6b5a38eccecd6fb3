//! The initramfs's files: host files and directories at their paths,
//! the symbolic links on the way, and the libraries of ELF files.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{Read, Write},
    path::{Component, Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::{cpio::Newc, util::read_dir};

/// What goes into the initramfs, by path in the guest. Sorted, so every
/// directory is written before what it holds.
#[derive(Default)]
pub(super) struct Tree {
    pub(super) entries: BTreeMap<PathBuf, Entry>,
    /// ELF files, whose libraries are still to be added.
    elves: BTreeSet<PathBuf>,
}

pub(super) enum Entry {
    Dir,
    /// A host file's content, with its permissions.
    File(PathBuf),
    Symlink(PathBuf),
    Bytes(Vec<u8>, u32),
    CharDevice(u32, u32),
}

impl Tree {
    pub(super) fn insert(&mut self, path: impl AsRef<Path>, entry: Entry) {
        let path = path.as_ref();
        if let Some(parent) = path.parent() {
            self.dir(parent);
        }
        self.entries.insert(path.to_owned(), entry);
    }

    /// `path` and its parents as directories.
    pub(super) fn dir(&mut self, path: &Path) {
        for ancestor in path.ancestors().filter(|a| *a != Path::new("/")) {
            if self.entries.contains_key(ancestor) {
                break;
            }
            self.entries.insert(ancestor.to_owned(), Entry::Dir);
        }
    }

    /// A directory in the guest: as on the host (symbolic links on the
    /// way kept) when the host has it.
    pub(super) fn guest_dir(&mut self, path: &Path) -> Result<()> {
        let real = if path.exists() {
            self.resolve(path, 0)?
        } else {
            path.to_owned()
        };
        self.dir(&real);
        Ok(())
    }

    /// The host file `host` at `path` in the guest.
    pub(super) fn host_file_as(&mut self, path: &Path, host: &Path) -> Result<()> {
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
    pub(super) fn host_path(&mut self, path: &Path) -> Result<()> {
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
    pub(super) fn libraries(&mut self) -> Result<()> {
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

    pub(super) fn write(&self, out: &mut Newc<impl Write>) -> Result<()> {
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
