//! `limiter run`: the program loaded with a rule set, its maps pinned,
//! attached to interfaces for the life of the process. Dropping it
//! detaches the program everywhere and removes the pins. (The daemon, by
//! contrast, pins its links so that enforcement outlives it.)

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::{
    engine::Engine,
    kernel::{
        if_index,
        links::LINKS_DIR,
        pins::{self, PinLock},
        require_root,
    },
    rules::RuleSet,
    wire::{Attachment, Mode, Snapshot},
};

/// A `limiter run`: the program attached for as long as this value lives.
pub struct Session {
    // Field order is drop order: detach (engine) before removing the pins.
    engine: Engine,
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

impl Session {
    /// Loads `rules`, pins the maps under `pin_dir` and attaches to every
    /// interface (in the calling thread's network namespace). On any error
    /// nothing stays attached or pinned.
    pub fn start(rules: &RuleSet, ifaces: &[String], mode: Mode, pin_dir: &Path) -> Result<Self> {
        require_root()?;
        if ifaces.is_empty() {
            bail!("no interface given (--iface)");
        }
        for iface in ifaces {
            if_index(iface)?;
        }
        pins::ensure_bpffs()?;
        let lock = PinLock::acquire(pin_dir)?;
        // Refused, not cleaned up: another user's directory is not ours to
        // delete, and what is in it is not ours to trust.
        pins::private_dir(pin_dir)?;
        if pin_dir.join(LINKS_DIR).exists() {
            bail!(
                "{} holds a daemon's pinned state (links that keep enforcing); \
                 use `limiter detach --pin-dir {0}` first, or another --pin-dir",
                pin_dir.display()
            );
        }
        // We hold the lock, so pins left here belong to a `run` that died.
        if std::fs::read_dir(pin_dir).is_ok_and(|mut entries| entries.next().is_some()) {
            tracing::warn!(
                "removing stale pins of a limiter that died: {}",
                pin_dir.display()
            );
            pins::remove_pins(pin_dir)?;
        }
        let guard = PinGuard(pin_dir.to_owned());
        let mut engine = Engine::open(pin_dir, rules.max_keys)?;
        engine.apply(rules.clone())?.log("the rule file");
        let mut attachments = Vec::new();
        for iface in ifaces {
            attachments.push(engine.attach(iface, mode, false)?);
        }
        engine.datapath_mut().log_reports();
        Ok(Self {
            engine,
            pins: guard,
            _lock: lock,
            attachments,
        })
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        self.engine.snapshot()
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pins.0
    }

    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}
