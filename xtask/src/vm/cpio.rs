//! The initramfs's archive format.

use std::{
    fmt::Write as _,
    fs::File,
    io::{Read, Write},
    os::unix::fs::PermissionsExt,
    path::Path,
};

use anyhow::{Context, Result, bail};

/// A cpio archive in the "newc" format the kernel's initramfs unpacker
/// reads (Documentation/driver-api/early-userspace/buffer-format.rst).
pub(super) struct Newc<W: Write> {
    out: W,
    written: u64,
    inode: u32,
}

impl<W: Write> Newc<W> {
    pub(super) fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            inode: 0,
        }
    }

    pub(super) fn entry(&mut self, path: &Path, mode: u32, data: &[u8]) -> Result<()> {
        let size = u32::try_from(data.len()).context("an initramfs file over 4 GiB")?;
        self.header(path, mode, size, (0, 0))?;
        self.bytes(data)?;
        self.pad()
    }

    pub(super) fn device(&mut self, path: &Path, mode: u32, major: u32, minor: u32) -> Result<()> {
        self.header(path, mode, 0, (major, minor))
    }

    /// A host file's content, streamed (test binaries are large).
    pub(super) fn host_file(&mut self, path: &Path, host: &Path) -> Result<()> {
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

    pub(super) fn finish(mut self) -> Result<()> {
        self.header(Path::new("TRAILER!!!"), 0, 0, (0, 0))?;
        self.out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_headers_are_aligned() -> Result<()> {
        let mut out = Newc::new(Vec::new());
        out.entry(Path::new("/init"), 0o100_755, b"#!/bin/sh\n")?;
        assert_eq!(out.written % 4, 0);
        assert!(out.out.starts_with(b"070701"));
        Ok(())
    }
}
