//! A running limiter: the program loaded with a rule set, its maps pinned,
//! attached to interfaces. Dropping it detaches the program everywhere and
//! removes the pins.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{
    config::RuleSet,
    datapath::{Attachment, Datapath, Mode},
    pins::{self, PinLock},
    stats::{CounterMaps, Snapshot},
    tables,
};

pub struct Limiter {
    // Field order is drop order: detach (datapath) before removing the pins.
    datapath: Datapath,
    pins: PinGuard,
    _lock: PinLock,
    pub attachments: Vec<Attachment>,
}

struct PinGuard(PathBuf);

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Err(e) = pins::remove_pins(&self.0) {
            tracing::warn!("{e:#}");
        }
    }
}

impl Limiter {
    /// Loads `rules`, pins the maps under `pin_dir` and attaches to every
    /// interface (in the calling thread's network namespace). On any error
    /// nothing stays attached or pinned.
    pub fn start(rules: &RuleSet, ifaces: &[String], mode: Mode, pin_dir: &Path) -> Result<Self> {
        require_root()?;
        if ifaces.is_empty() {
            bail!("no interface given (--iface)");
        }
        for iface in ifaces {
            crate::datapath::if_index(iface)?;
        }
        pins::ensure_bpffs()?;
        let lock = PinLock::acquire(pin_dir)?;
        // We hold the lock, so pins left here belong to a limiter that died.
        if pin_dir.exists() {
            tracing::warn!(
                "removing stale pins of a limiter that died: {}",
                pin_dir.display()
            );
            pins::remove_pins(pin_dir)?;
        }
        let mut datapath = Datapath::load(rules.max_keys)?;
        datapath
            .write_tables(&tables::build(rules))
            .context("writing the rules into the kernel maps")?;
        let guard = PinGuard(pin_dir.to_owned());
        datapath.pin(pin_dir)?;
        let mut attachments = Vec::new();
        for iface in ifaces {
            attachments.push(datapath.attach(iface, mode)?);
        }
        Ok(Self {
            datapath,
            pins: guard,
            _lock: lock,
            attachments,
        })
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        CounterMaps::from_datapath(&self.datapath)?.read()
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pins.0
    }

    pub fn datapath(&self) -> &Datapath {
        &self.datapath
    }
}

/// Fails with a clear message unless running as root.
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("this needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN for bpffs); try sudo");
    }
    Ok(())
}
