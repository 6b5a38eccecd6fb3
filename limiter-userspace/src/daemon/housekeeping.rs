//! The daemon's periodic work, once a second: expired blocks removed,
//! escalations made and logged, keys counted, the pins and the rule file
//! watched.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use super::{apply::reload_file, shared::Shared};
use crate::{engine::Engine, kernel, rules::watch::FileWatch};

/// Logs each escalation as an `escalated` event.
pub fn log_escalations(escalated: &[crate::engine::escalate::Escalated]) {
    for e in escalated {
        let for_secs = e.block.as_secs_f64();
        if e.enforced && e.hold.is_some() {
            tracing::warn!(event = "escalated", prefix = %e.prefix, rule = %e.rule, for_secs, enforced = true, scope = "key",
                "{} stayed over rule {:?}'s limit: held by the rule for {} (its other traffic passes)", e.prefix, e.rule, humantime::format_duration(e.block));
        } else if e.enforced {
            tracing::warn!(event = "escalated", prefix = %e.prefix, rule = %e.rule, for_secs, enforced = true,
                "{} stayed over rule {:?}'s limit: blocked for {}", e.prefix, e.rule, humantime::format_duration(e.block));
        } else {
            tracing::warn!(event = "escalated", prefix = %e.prefix, rule = %e.rule, for_secs, enforced = false,
                "{} stayed over rule {:?}'s limit: would be blocked for {} (dry run)", e.prefix, e.rule, humantime::format_duration(e.block));
        }
    }
}

/// Expired blocks are removed, tracked keys counted, and the rule file
/// watched (if configured).
pub async fn housekeeping(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut rule_file = FileWatch::new(&shared.config.rules);
    let mut ticks = 0u64;
    loop {
        tick.tick().await;
        ticks += 1;
        let work = Arc::clone(&shared);
        let _ = tokio::task::spawn_blocking(move || {
            let mut engine = work.engine();
            watch_pins(&work, &mut engine);
            if let Err(e) = engine.remove_expired_blocks() {
                tracing::warn!(event = "error", error = %format!("{e:#}"), "removing expired blocks: {e:#}");
            }
            if let Err(e) = engine.refresh_clock() {
                tracing::warn!(event = "error", error = %format!("{e:#}"), "refreshing the clock offset: {e:#}");
            }
            match engine.escalate() {
                Ok(escalated) => log_escalations(&escalated),
                Err(e) => {
                    tracing::warn!(event = "error", error = %format!("{e:#}"), "escalating: {e:#}")
                }
            }
            // Counting a million keys scans their tags: every 5 s is enough.
            if ticks % 5 == 1 {
                let n = engine.datapath().maps().keys.count();
                work.tracked_keys.store(n as u64, Ordering::Relaxed);
                if let Err(e) = engine.datapath_mut().refresh_key_filter(n) {
                    tracing::warn!(event = "error", error = %format!("{e:#}"), "rebuilding the key table's filter: {e:#}");
                }
                if let Ok(true) = kernel::trace::stop_abandoned(&work.config.pin_dir) {
                    tracing::info!(event = "trace_stopped", "stopped a trace whose tracer died");
                }
            }
        })
        .await;
        if shared.config.watch && rule_file.changed() {
            tracing::info!(
                "{} changed on disk: re-applying",
                shared.config.rules.display()
            );
            reload_file(&shared).await;
        }
    }
}

/// Reports pins that went missing (bpffs unmounted, the directory
/// deleted) once, and writes them again once there is a bpffs to write
/// them in. The program enforces throughout: the daemon holds the maps and
/// links itself.
fn watch_pins(shared: &Shared, engine: &mut Engine) {
    let datapath = engine.datapath_mut();
    if datapath.pins_intact() {
        shared.pins_missing.store(false, Ordering::Relaxed);
        return;
    }
    if !shared.pins_missing.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "the pins under {} are gone (bpffs unmounted?); the program keeps enforcing, \
             held by this daemon; they are written again when a bpffs is mounted there",
            shared.config.pin_dir.display()
        );
    }
    match datapath.repin() {
        Ok(0) => {}
        Ok(n) => {
            shared.pins_missing.store(false, Ordering::Relaxed);
            tracing::info!(
                "pinned {n} maps and links again under {}",
                shared.config.pin_dir.display()
            );
        }
        // Once a second until it works: at debug level after the report.
        Err(e) => tracing::debug!("pinning again: {e:#}"),
    }
}
