//! The state the daemon's tasks share, and the engine's lock that survives
//! a panic.

use std::sync::{
    Mutex, MutexGuard,
    atomic::{AtomicBool, AtomicU64},
};

use tokio::sync::Notify;

use super::config::DaemonConfig;
use crate::{engine::Engine, fleet::Fleet, wire::Attachment};

/// State shared by the daemon's tasks.
pub struct Shared {
    /// Held only by blocking tasks; see [`Shared::engine`].
    pub engine: Mutex<Engine>,
    pub config: DaemonConfig,
    pub attachments: Vec<Attachment>,
    pub generation: AtomicU64,
    /// Rule files re-read (SIGHUP, `--watch`) and refused.
    pub rule_file_rejections: AtomicU64,
    pub tracked_keys: AtomicU64,
    /// The pins went missing and are not back yet.
    pub pins_missing: AtomicBool,
    pub shutdown: Notify,
    /// The fleet rules' loops, once the runtime runs.
    pub fleet: Mutex<Option<Fleet>>,
}

impl Shared {
    /// The engine, also after a task panicked while holding it: the engine
    /// writes a rule set into the inactive generation and flips to it last,
    /// so an interrupted change leaves the one in force whole, and a dead
    /// control plane would be worse than going on.
    pub fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|poisoned| {
            tracing::error!(
                "a task panicked while changing the rules; the rules in force are unchanged"
            );
            self.engine.clear_poison();
            poisoned.into_inner()
        })
    }
}
