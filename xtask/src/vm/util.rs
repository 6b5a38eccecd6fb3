//! Small helpers.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};

/// A directory for one run's initramfs and console log, removed after
/// unless kept.
pub(super) struct WorkDir {
    pub(super) path: PathBuf,
    keep: bool,
}

impl WorkDir {
    pub(super) fn create(keep: bool) -> Result<Self> {
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

pub(super) fn read_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()).map_err(Into::into))
        .collect()
}

pub(super) fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Runs `command`; its output is shown only when it fails.
pub(super) fn quiet(command: &mut Command) -> Result<()> {
    captured(command).map(drop)
}

/// Runs `command`, returning its stdout; its stderr is shown if it fails.
pub(super) fn captured(command: &mut Command) -> Result<String> {
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
