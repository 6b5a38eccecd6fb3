//! `limiter run`: enforce until told to stop.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use limiter::{render::text, rules::RuleSet, session::Session, wire::Mode};
use tokio::signal::unix::{SignalKind, signal};

/// How often the key table's filter is checked for bits of keys gone
/// (`Datapath::refresh_key_filter`), as the daemon does.
const FILTER_CHECK: Duration = Duration::from_secs(5);

pub fn run(
    ifaces: &[String],
    config: &Path,
    mode: Mode,
    pin_dir: &Path,
    interval: Duration,
) -> Result<()> {
    // Validate before touching anything.
    let rules = RuleSet::load(config)?;
    for rule in rules.rules.iter().filter(|r| r.fleet.is_some()) {
        tracing::warn!(
            "rule {:?} is fleet-wide: `limiter run` leases nothing and enforces its reserve \
             (`limiter daemon` with a `fleet:` store shares the budget)",
            rule.name
        );
    }
    let mut session = Session::start(&rules, ifaces, mode, pin_dir)?;
    let attached: Vec<String> = session
        .attachments
        .iter()
        .map(|a| format!("{} ({:?})", a.iface, a.mode).to_lowercase())
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Handled before the line that says it runs (what scripts and tests
    // wait for): a SIGINT right after it stops it cleanly.
    let (mut interrupt, mut terminate) = {
        let _runtime = runtime.enter();
        (
            signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
            signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
        )
    };
    println!(
        "limiter: enforcing {} rules from {} on {}; maps pinned at {}",
        rules.rules.len(),
        config.display(),
        attached.join(", "),
        session.pin_dir().display()
    );
    runtime.block_on(async {
        let mut ticker = tokio::time::interval(interval);
        ticker.tick().await;
        let mut previous = session.snapshot()?;
        let mut filter_checked = Instant::now();
        // Escalation looks at the keys once a second, as the daemon does.
        let mut escalation = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = escalation.tick() => {
                    let engine = session.engine_mut();
                    match engine.escalate() {
                        Ok(escalated) => limiter::daemon::log_escalations(&escalated),
                        Err(e) => tracing::warn!("escalating: {e:#}"),
                    }
                    if let Err(e) = engine.remove_expired_blocks() {
                        tracing::warn!("removing expired blocks: {e:#}");
                    }
                }
                _ = ticker.tick() => {
                    let now = session.snapshot()?;
                    println!("{}", text::summary_line(&previous, &now, interval));
                    previous = now;
                    if filter_checked.elapsed() >= FILTER_CHECK {
                        filter_checked = Instant::now();
                        let datapath = session.engine_mut().datapath_mut();
                        let held = datapath.maps().keys.count();
                        if let Err(e) = datapath.refresh_key_filter(held) {
                            tracing::warn!("rebuilding the key table's filter: {e:#}");
                        }
                        if let Ok(true) = limiter::kernel::trace::stop_abandoned(session.pin_dir()) {
                            tracing::info!("stopped a trace whose tracer died");
                        }
                    }
                }
                _ = interrupt.recv() => break,
                _ = terminate.recv() => break,
            }
        }
        anyhow::Ok(())
    })?;
    let last = session.snapshot()?;
    drop(session);
    print!("{}", text::stats_table(&last));
    println!(
        "limiter: detached from {} and removed the pins",
        attached.join(", ")
    );
    Ok(())
}
